"""The engine's EAGLE drafting on the device: `eagle.draft` over a batch of windows in one
jitted, vmapped call, with the head's parameters and the target's embedding held here.

`EagleProposer` (host) fills the windows; this object turns them into drafts. The batch is
padded to a power of two (`batch_size`), so a run compiles one program per power of two of
sequences, as the runner's buckets do. Under tensor parallelism the head runs replicated on
every device of the target's mesh (a replicated copy of the embedding: V x h more per
device). Device code.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from paxkv.config import ModelConfig
from paxkv.spec_decode import eagle


class EagleDrafter:
    """`(features [B, WINDOW, h], next_tokens [B, WINDOW], num_real [B])` -> k greedy drafts
    `[B, k]` (numpy) per right-aligned window, as `eagle.draft` gives them one at a time."""

    def __init__(self, params: Any, target: ModelConfig, embedding_of: Callable[[], jax.Array],
                 k: int, mesh: Any = None) -> None:
        """`embedding_of`: the target's current token embedding (read at each call: the
        runner's weights may be replaced, e.g. by `sleep` and `wake_up`)."""
        self.k = k
        self.window = eagle.WINDOW
        self.hidden_size = target.hidden_size
        self.mesh = mesh
        self._embedding_of = embedding_of
        self._source: Any = None        # the runner's embedding the replicated copy is of
        self._embedding: Any = None
        self.params = self._replicated(params) if mesh is not None else params
        def draft(params, embedding, features, next_tokens, num_real):
            return eagle.draft(params, target, embedding, features, next_tokens, num_real, k)

        self._draft = jax.jit(jax.vmap(draft, in_axes=(None, None, 0, 0, 0)))
        self.batch_sizes: set[int] = set()   # the batch sizes compiled so far

    @staticmethod
    def batch_size(n: int) -> int:
        """The padded batch for `n` windows: the power of two >= n."""
        return 1 << max(n - 1, 0).bit_length()

    def _replicated(self, tree: Any) -> Any:
        from jax.sharding import NamedSharding, PartitionSpec
        return jax.device_put(tree, NamedSharding(self.mesh, PartitionSpec()))

    def embedding(self) -> jax.Array:
        source = self._embedding_of()
        if self.mesh is None:
            return source
        if source is not self._source:
            self._source, self._embedding = source, self._replicated(source)
        return self._embedding

    def __call__(self, features: np.ndarray, next_tokens: np.ndarray,
                 num_real: np.ndarray) -> np.ndarray:
        b = features.shape[0]
        if b != self.batch_size(b):
            raise ValueError(f"EagleDrafter: a batch of {b} windows is not padded to a power "
                             f"of two ({self.batch_size(b)})")
        inputs = (features, next_tokens, num_real)
        if self.mesh is not None:
            inputs = self._replicated(inputs)
        self.batch_sizes.add(b)
        return np.asarray(self._draft(self.params, self.embedding(), *inputs))

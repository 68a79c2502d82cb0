"""The device-side description of one engine step: a ragged batch of new tokens.

Every step (prefill, chunked prefill, decode, or any mix) is the same data: the new tokens
of `S` sequences concatenated into `T` slots. The runner pads `T` and `S` up to shape
buckets, so the jitted step compiles once per bucket. Padding tokens write to slot 0..bs-1 of
the reserved null block 0 and padding sequences have `context_lens == 0` and `q_lens == 0`.

The model writes the new tokens' K/V into the pool first (at `slot_mapping`) and then every
query attends through `block_tables` to keys at positions `<=` its own: cached context and
the causal part of its own chunk come out of the same pages.

A model with several KV groups (`cache/kv_layout.py`: sliding and global layers) has one
block table per group: `block_tables` is then `[G, S, max_blocks]` and `slot_mapping`
`[G, T]`, group g's layers reading `block_tables[g]`; a model with one group keeps the 2-D
and 1-D forms (`group_view`).
"""
from __future__ import annotations

from typing import NamedTuple

import jax


class StepBatch(NamedTuple):
    """A ragged batch; a NamedTuple so it is a pytree the jitted step can take whole."""

    token_ids: jax.Array         # [T] int32, new tokens of all sequences concatenated
    positions: jax.Array         # [T] int32, each token's position in its sequence
    slot_mapping: jax.Array      # [T] int32, block * block_size + offset where K/V go; [G, T]
    block_tables: jax.Array      # [S, max_blocks] int32, physical block ids (0 = null); [G, ...]
    context_lens: jax.Array      # [S] int32, tokens cached after this step's write
    cu_q_lens: jax.Array         # [S + 1] int32, start of each sequence's new tokens in T
    logits_indices: jax.Array    # [S] int32, index in T of each sequence's last new token

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    def group_view(self, group: int) -> "StepBatch":
        """The batch as KV group `group`'s layers see it: its block tables and slots."""
        if self.block_tables.ndim == 2:
            return self
        return self._replace(block_tables=self.block_tables[group],
                             slot_mapping=self.slot_mapping[group])

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

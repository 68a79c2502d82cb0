"""The ragged kernels' grid: which (sequence, tile of new tokens) each program takes.

Shared by the Triton kernel (`ragged_paged_attention.py`) and the Mosaic GPU kernel
(`mosaic_prefill.py`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.arith import cdiv


def build_work_list(cu_q_lens: jax.Array, num_tokens: int, block_q: int
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sequence, tile) of every grid item, padding tokens as one last pseudo-sequence.

    Returns `cu` `[S + 2]` (cu_q_lens with `num_tokens` appended), `work_seq` `[W]` (-1 for
    unused items) and `work_tile` `[W]`, `W = cdiv(T, block_q) + S + 1` (static).
    """
    num_seqs = cu_q_lens.shape[0] - 1
    cu = jnp.concatenate([cu_q_lens.astype(jnp.int32), jnp.full((1,), num_tokens, jnp.int32)])
    q_lens = jnp.maximum(cu[1:] - cu[:-1], 0)
    tiles = cdiv(q_lens, block_q)
    ends = jnp.cumsum(tiles)
    num_items = cdiv(num_tokens, block_q) + num_seqs + 1
    w = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.searchsorted(ends, w, side="right").astype(jnp.int32)
    seq_c = jnp.minimum(seq, num_seqs)
    within = w - (ends[seq_c] - tiles[seq_c])
    tile = tiles[seq_c] - 1 - within                    # last tile of a sequence first
    used = w < ends[-1]
    return cu, jnp.where(used, seq_c, -1), jnp.where(used, tile, 0).astype(jnp.int32)

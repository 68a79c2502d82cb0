"""jnp reference for ragged paged attention: per-token gather of its sequence's pages."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.reference import gather_sequences, masked_attention


def ragged_paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                     block_tables: jax.Array, context_lens: jax.Array,
                                     cu_q_lens: jax.Array, k_scale: jax.Array | None = None,
                                     v_scale: jax.Array | None = None, *,
                                     scale: float | None = None,
                                     window: int | None = None) -> jax.Array:
    """Same contract as `ragged_paged_attention` (rows past `cu_q_lens[-1]` are zeros)."""
    num_tokens, _, head_dim = q.shape
    block_size = k_pages.shape[1]
    num_seqs = block_tables.shape[0]
    scale = head_dim ** -0.5 if scale is None else scale
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right")
    real = seq < num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = context_lens[seq] - q_len + (t - cu_q_lens[seq])
    k = gather_sequences(k_pages, k_scale, block_tables)[seq]     # [T, length, H, d]
    v = gather_sequences(v_pages, v_scale, block_tables)[seq]
    key = jnp.arange(block_tables.shape[1] * block_size, dtype=jnp.int32)[None, :]
    visible = (key <= pos[:, None]) & (key < context_lens[seq][:, None]) & real[:, None]
    if window is not None:
        visible &= key > pos[:, None] - window
    return masked_attention(q, k, v, visible, scale).astype(q.dtype)

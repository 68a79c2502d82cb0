"""Paged attention behind one interface, with interchangeable backends.

`attend(q, k_pages, v_pages, batch, ...)` computes, for every new token of a ragged
`StepBatch`, causal attention over its sequence's cached keys (which already include this
step's K/V: the model writes before it attends). Backends:

- "reference": plain jnp gather through the block tables; the ground truth for tests.
- "pallas": the Pallas GPU kernels in `pallas_kernels` (decode kernel when every sequence
  has one new token, ragged kernel otherwise).

"auto" is resolved with the runner's other settings (`config.runner_config`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from paxkv.model.batch import StepBatch


def token_seq_ids(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """Sequence index of each of the `num_tokens` ragged tokens (padding -> last row)."""
    num_seqs = cu_q_lens.shape[0] - 1
    ids = jnp.searchsorted(cu_q_lens[1:], jnp.arange(num_tokens, dtype=jnp.int32), side="right")
    return jnp.minimum(ids, num_seqs - 1).astype(jnp.int32)


def reference_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, batch: StepBatch,
                        scale: float, k_scale: jax.Array | None = None,
                        v_scale: jax.Array | None = None) -> jax.Array:
    """q `[T, Hq, d]` -> `[T, Hq, d]`; gathers each sequence's pages, masks key pos > query pos."""
    t, hq, d = q.shape
    _, bs, hkv, _ = k_pages.shape
    g = hq // hkv
    seq = token_seq_ids(batch.cu_q_lens, t)
    k = k_pages[batch.block_tables].astype(jnp.float32)   # [S, max_blocks, bs, hkv, d]
    v = v_pages[batch.block_tables].astype(jnp.float32)
    if k_scale is not None:
        k = k * k_scale[batch.block_tables][..., None]
        v = v * v_scale[batch.block_tables][..., None]
    s_, mb = batch.block_tables.shape
    k = k.reshape(s_, mb * bs, hkv, d)[seq]                # [T, L, hkv, d]
    v = v.reshape(s_, mb * bs, hkv, d)[seq]
    qg = q.astype(jnp.float32).reshape(t, hkv, g, d)
    scores = jnp.einsum("thgd,tlhd->thgl", qg, k) * scale
    key_pos = jnp.arange(mb * bs, dtype=jnp.int32)
    valid = (key_pos[None, :] <= batch.positions[:, None]) & (
        key_pos[None, :] < batch.context_lens[seq][:, None])
    scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("thgl,tlhd->thgd", p, v) / jnp.where(denom == 0, 1.0, denom)
    return out.reshape(t, hq, d).astype(q.dtype)


def attend(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, batch: StepBatch, *,
           scale: float, backend: str = "reference", decode_only: bool = False,
           k_scale: jax.Array | None = None, v_scale: jax.Array | None = None) -> jax.Array:
    """Dispatch to a backend. `decode_only` (static) says every sequence has one new token."""
    if backend == "reference":
        return reference_attention(q, k_pages, v_pages, batch, scale, k_scale, v_scale)
    if backend == "pallas":
        from paxkv.model import pallas_backend  # GPU kernels; imported only when asked for
        return pallas_backend.attend(q, k_pages, v_pages, batch, scale=scale,
                                     decode_only=decode_only, k_scale=k_scale, v_scale=v_scale)
    raise ValueError(f"unknown attention backend {backend!r}")

"""jnp reference for decode paged attention: gather every page, mask by length, fp32 softmax."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_sequences(pages: jax.Array, scales: jax.Array | None,
                     block_tables: jax.Array) -> jax.Array:
    """Every sequence's pages, `[S, max_blocks * block_size, kv_heads, d]` float32, dequantized
    by their per-token scales when given (blocks-first pages)."""
    x = pages[block_tables].astype(jnp.float32)          # [S, pages, bs, H, d]
    if scales is not None:
        x = x * scales[block_tables][..., None].astype(jnp.float32)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                              block_tables: jax.Array, context_lens: jax.Array,
                              k_scale: jax.Array | None = None,
                              v_scale: jax.Array | None = None, *, scale: float | None = None,
                              pages_layout: str = "blocks_first") -> jax.Array:
    """Same contract as `paged_attention`; plain gathers, no tiling (slow, exact)."""
    if pages_layout == "heads_first":                   # -> blocks_first
        k_pages, v_pages = (jnp.moveaxis(x, 0, 2) for x in (k_pages, v_pages))
        if k_scale is not None:
            k_scale, v_scale = (jnp.moveaxis(x, 0, 2) for x in (k_scale, v_scale))
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    k = gather_sequences(k_pages, k_scale, block_tables)
    v = gather_sequences(v_pages, v_scale, block_tables)
    length = block_tables.shape[1] * block_size
    qg = q.astype(jnp.float32).reshape(batch, num_kv_heads, group, head_dim)
    s = jnp.einsum("bhgd,blhd->bhgl", qg, k, precision="highest") * scale
    valid = jnp.arange(length)[None, :] < context_lens[:, None]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    den = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhgl,blhd->bhgd", p, v, precision="highest") / jnp.where(den > 0, den, 1.0)
    return o.reshape(batch, num_heads, head_dim).astype(q.dtype)

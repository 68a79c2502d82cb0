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


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array,
                     scale: float) -> jax.Array:
    """fp32 attention of each row's query heads `[N, Hq, d]` over its own keys and values
    `[N, L, kv_heads, d]` where `visible` `[N, L]`; a row that sees nothing gives 0."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    qg = q.astype(jnp.float32).reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    s = jnp.einsum("nhgd,nlhd->nhgl", qg, k, precision="highest") * scale
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    den = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("nhgl,nlhd->nhgd", p, v, precision="highest") / jnp.where(den > 0, den, 1.0)
    return o.reshape(n, num_heads, head_dim)


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                              block_tables: jax.Array, context_lens: jax.Array,
                              k_scale: jax.Array | None = None,
                              v_scale: jax.Array | None = None, *, scale: float | None = None,
                              window: int | None = None,
                              pages_layout: str = "blocks_first") -> jax.Array:
    """Same contract as `paged_attention`; plain gathers, no tiling (slow, exact)."""
    if pages_layout == "heads_first":                   # -> blocks_first
        k_pages, v_pages = (jnp.moveaxis(x, 0, 2) for x in (k_pages, v_pages))
        if k_scale is not None:
            k_scale, v_scale = (jnp.moveaxis(x, 0, 2) for x in (k_scale, v_scale))
    head_dim = q.shape[-1]
    block_size = k_pages.shape[1]
    scale = head_dim ** -0.5 if scale is None else scale
    k = gather_sequences(k_pages, k_scale, block_tables)
    v = gather_sequences(v_pages, v_scale, block_tables)
    key = jnp.arange(block_tables.shape[1] * block_size)[None, :]
    visible = key < context_lens[:, None]
    if window is not None:
        visible &= key >= context_lens[:, None] - window
    return masked_attention(q, k, v, visible, scale).astype(q.dtype)


def rope_paged_attention_reference(qkv: jax.Array, cos: jax.Array, sin: jax.Array,
                                   slot_mapping: jax.Array, k_pages: jax.Array,
                                   v_pages: jax.Array, block_tables: jax.Array,
                                   context_lens: jax.Array, window: int | None = None
                                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`rope_paged_attention` unfused: rotate and write the new token (negative slots write
    nothing), then attend over the written pages -> (out, k_pages, v_pages)."""
    from pallas_kernels.layer_ops.rope_kv_write import rope_kv_write_reference  # (cycle)
    nb, bs = k_pages.shape[:2]
    dropped = jnp.where(slot_mapping < 0, nb * bs + 1, slot_mapping)   # out of range: dropped
    q, k_new, v_new = rope_kv_write_reference(qkv, cos, sin, dropped, k_pages, v_pages)
    out = paged_attention_reference(q, k_new, v_new, block_tables, context_lens, window=window)
    return out, k_new, v_new

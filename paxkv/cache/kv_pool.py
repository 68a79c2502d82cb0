"""The KV page pool: a pytree value holding every layer's K and V pages.

Layout per layer: `k[l], v[l]` of shape `[num_blocks, block_size, num_kv_heads, head_dim]`.
Block 0 is the null block: padding tokens write there and padding rows of block tables point
there, so no kernel ever needs a bounds check for padding. The pool is never mutated: `write`
returns a new pool, and the jitted step donates the old one so XLA updates it in place.

Quantized pools (`kv_cache_dtype` fp8 / int8) also carry scales; `None` when unquantized.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from paxkv.config import ModelConfig


class KVPool(NamedTuple):
    k: tuple[jax.Array, ...]                 # per layer [num_blocks, block_size, kv_heads, head_dim]
    v: tuple[jax.Array, ...]
    k_scale: tuple[jax.Array, ...] | None = None
    v_scale: tuple[jax.Array, ...] | None = None

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_layers(self) -> int:
        return len(self.k)


def page_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    return (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)


def init_pool(cfg: ModelConfig, num_blocks: int, block_size: int, dtype=jnp.bfloat16) -> KVPool:
    """Zero-filled pool of `num_blocks` blocks (block 0 included: it is the null block)."""
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
    shape = page_shape(cfg, num_blocks, block_size)
    k = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    v = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    return KVPool(k, v)


def pool_bytes_per_block(cfg: ModelConfig, block_size: int, bytes_per_element: float) -> float:
    """Device bytes one block costs over all layers, K and V."""
    return block_size * cfg.kv_bytes_per_token(bytes_per_element)


def write_layer(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
                slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatter new tokens' K/V `[T, kv_heads, head_dim]` into one layer's pages at their slots."""
    nb, bs, h, d = k_pages.shape
    flat_k = k_pages.reshape(nb * bs, h, d).at[slot_mapping].set(k.astype(k_pages.dtype))
    flat_v = v_pages.reshape(nb * bs, h, d).at[slot_mapping].set(v.astype(v_pages.dtype))
    return flat_k.reshape(nb, bs, h, d), flat_v.reshape(nb, bs, h, d)


def write(pool: KVPool, layer: int, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> KVPool:
    """Functional write of one layer's new K/V; returns the new pool."""
    nk, nv = write_layer(pool.k[layer], pool.v[layer], k, v, slot_mapping)
    ks = pool.k[:layer] + (nk,) + pool.k[layer + 1:]
    vs = pool.v[:layer] + (nv,) + pool.v[layer + 1:]
    return pool._replace(k=ks, v=vs)


def copy_blocks(pool: KVPool, src: jax.Array, dst: jax.Array) -> KVPool:
    """Copy whole blocks src[i] -> dst[i] in every layer (copy-on-write). Pads use 0 -> 0."""
    ks = tuple(k.at[dst].set(k[src]) for k in pool.k)
    vs = tuple(v.at[dst].set(v[src]) for v in pool.v)
    return pool._replace(k=ks, v=vs)

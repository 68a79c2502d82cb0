"""The KV page pool: a pytree value holding every layer's K and V pages.

Layout per slot: `k[s], v[s]` of shape `[num_blocks, block_size, num_kv_heads, head_dim]`. A
block id holds `slots` layer pages (`cache/kv_layout.py`): for a model whose layers all
attend alike there is one slot per layer (`k[l]` is layer l's), for one with several KV
groups layer l's pages are slot `slot_of(l)` of the blocks in its group's table.
Block 0 is the null block: padding tokens write there and padding rows of block tables point
there, so no kernel ever needs a bounds check for padding. The pool is never mutated: `write`
returns a new pool, and the jitted step donates the old one so XLA updates it in place.

Quantized pools (`kv_cache_dtype` fp8 / fp8_e5m2 / int8, see `paxkv.cache.quant`) store 8-bit
codes in the pages and one scale per token and KV head in `k_scale[l], v_scale[l]`
(`[num_blocks, block_size, num_kv_heads]`); both are `None` when unquantized. `write`
quantizes as it scatters, and every function here moves scales together with their pages.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from paxkv.cache import quant
from paxkv.cache.kv_layout import kv_layout
from paxkv.config import ModelConfig


class KVPool(NamedTuple):
    k: tuple[jax.Array, ...]                 # per layer [num_blocks, block_size, kv_heads, head_dim]
    v: tuple[jax.Array, ...]
    k_scale: tuple[jax.Array, ...] | None = None   # per layer [num_blocks, block_size, kv_heads]
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

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


def page_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    return (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)


def init_pool(cfg: ModelConfig, num_blocks: int, block_size: int, dtype=jnp.bfloat16,
              kv_cache_dtype: str = "auto") -> KVPool:
    """Zero-filled pool of `num_blocks` blocks (block 0 included: it is the null block).

    Pages are stored in `quant.storage_dtype(kv_cache_dtype, dtype)`: `dtype` itself for
    "auto". A quantized storage dtype (given either way, e.g. `dtype=jnp.int8` or
    `kv_cache_dtype="int8"`) also allocates the per-token scales.
    """
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
    storage = quant.storage_dtype(kv_cache_dtype, dtype)
    shape = page_shape(cfg, num_blocks, block_size)
    slots = kv_layout(cfg).slots
    k = tuple(jnp.zeros(shape, storage) for _ in range(slots))
    v = tuple(jnp.zeros(shape, storage) for _ in range(slots))
    if not quant.is_quantized(storage):
        return KVPool(k, v)
    ks = tuple(jnp.zeros(shape[:3], quant.SCALE_DTYPE) for _ in range(slots))
    vs = tuple(jnp.zeros(shape[:3], quant.SCALE_DTYPE) for _ in range(slots))
    return KVPool(k, v, ks, vs)


def block_bytes(cfg: ModelConfig, block_size: int, dtype) -> int:
    """Device bytes one block of a pool stored in `dtype` costs: pages plus, when quantized,
    their scales. `init_pool(...)` allocates exactly `num_blocks * block_bytes(...)`."""
    pages, scales = quant.bytes_per_token(kv_layout(cfg).slots, cfg.num_kv_heads, cfg.head_dim,
                                          dtype)
    return block_size * (pages + scales)


def write_layer(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
                slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatter new tokens' K/V `[T, kv_heads, head_dim]` into one layer's pages at their slots."""
    if quant.is_quantized(k_pages.dtype):
        raise ValueError(f"write_layer: k_pages are {k_pages.dtype}, a quantized dtype: use "
                         "write_layer_quantized (it needs the scale pages)")
    nb, bs, h, d = k_pages.shape
    flat_k = k_pages.reshape(nb * bs, h, d).at[slot_mapping].set(k.astype(k_pages.dtype))
    flat_v = v_pages.reshape(nb * bs, h, d).at[slot_mapping].set(v.astype(v_pages.dtype))
    return flat_k.reshape(nb, bs, h, d), flat_v.reshape(nb, bs, h, d)


def write_layer_quantized(k_pages: jax.Array, v_pages: jax.Array, k_scale: jax.Array,
                          v_scale: jax.Array, k: jax.Array, v: jax.Array,
                          slot_mapping: jax.Array
                          ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Quantize new tokens' K/V `[T, kv_heads, head_dim]` (one scale per token and head) and
    scatter codes and scales into one layer's pages; XLA fuses the two into one pass."""
    nb, bs, h, d = k_pages.shape
    if k_scale.shape != (nb, bs, h) or v_scale.shape != (nb, bs, h):
        raise ValueError(f"write_layer_quantized: k_scale/v_scale must be {(nb, bs, h)}, got "
                         f"{k_scale.shape} and {v_scale.shape}")
    kq, ks = quant.quantize(k, k_pages.dtype, k_scale.dtype)
    vq, vs = quant.quantize(v, v_pages.dtype, v_scale.dtype)
    flat_k = k_pages.reshape(nb * bs, h, d).at[slot_mapping].set(kq)
    flat_v = v_pages.reshape(nb * bs, h, d).at[slot_mapping].set(vq)
    flat_ks = k_scale.reshape(nb * bs, h).at[slot_mapping].set(ks)
    flat_vs = v_scale.reshape(nb * bs, h).at[slot_mapping].set(vs)
    return (flat_k.reshape(nb, bs, h, d), flat_v.reshape(nb, bs, h, d),
            flat_ks.reshape(nb, bs, h), flat_vs.reshape(nb, bs, h))


def replace_layer(layers: tuple, layer: int, new) -> tuple:
    """The per-layer tuple `layers` with entry `layer` replaced by `new`."""
    return layers[:layer] + (new,) + layers[layer + 1:]


def layer_of(pool: KVPool, layer: int) -> KVPool:
    """A one-layer pool holding `layer`'s pages (and scales): what one layer's write and
    attention read and return (`paxkv.model.attention`)."""
    pick = lambda xs: None if xs is None else (xs[layer],)  # noqa: E731
    return KVPool(pick(pool.k), pick(pool.v), pick(pool.k_scale), pick(pool.v_scale))


def with_layer(pool: KVPool, layer: int, one: KVPool) -> KVPool:
    """`pool` with layer `layer` replaced by the one-layer pool `one`."""
    put = lambda xs, x: None if xs is None else replace_layer(xs, layer, x[0])  # noqa: E731
    return KVPool(put(pool.k, one.k), put(pool.v, one.v), put(pool.k_scale, one.k_scale),
                  put(pool.v_scale, one.v_scale))


def write(pool: KVPool, layer: int, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> KVPool:
    """Functional write of one layer's new K/V (quantized on the way in when the pool is);
    returns the new pool."""
    if not pool.quantized:
        nk, nv = write_layer(pool.k[layer], pool.v[layer], k, v, slot_mapping)
        return pool._replace(k=replace_layer(pool.k, layer, nk), v=replace_layer(pool.v, layer, nv))
    nk, nv, nks, nvs = write_layer_quantized(pool.k[layer], pool.v[layer], pool.k_scale[layer],
                                             pool.v_scale[layer], k, v, slot_mapping)
    return KVPool(replace_layer(pool.k, layer, nk), replace_layer(pool.v, layer, nv),
                  replace_layer(pool.k_scale, layer, nks), replace_layer(pool.v_scale, layer, nvs))


def read_layer(pool: KVPool, layer: int, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """One layer's K/V pages as values (dequantized when the pool is quantized); for tests."""
    if not pool.quantized:
        return pool.k[layer].astype(dtype), pool.v[layer].astype(dtype)
    return (quant.dequantize(pool.k[layer], pool.k_scale[layer], dtype),
            quant.dequantize(pool.v[layer], pool.v_scale[layer], dtype))


def copy_blocks(pool: KVPool, src: jax.Array, dst: jax.Array) -> KVPool:
    """Copy whole blocks src[i] -> dst[i] in every layer, scales included (copy-on-write).
    Pads use 0 -> 0."""
    return jax.tree.map(lambda x: x.at[dst].set(x[src]), pool)


def gather_blocks(pool: KVPool, ids: jax.Array) -> KVPool:
    """The blocks `ids` of every layer (pages and scales) as a smaller pool (swap out)."""
    return jax.tree.map(lambda x: x[ids], pool)


def scatter_blocks(pool: KVPool, ids: jax.Array, blocks: KVPool) -> KVPool:
    """Write `blocks` (as from `gather_blocks`) into blocks `ids` of `pool` (swap in)."""
    return jax.tree.map(lambda x, b: x.at[ids].set(b.astype(x.dtype)), pool, blocks)

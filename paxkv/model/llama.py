"""Llama-3 as pure functions over a parameter pytree: the paged forward the engine runs.

`forward(params, batch, kv_pool, cfg)` runs one engine step on a ragged `StepBatch`: for each
layer it writes the new tokens' K/V into the page pool at `batch.slot_mapping` and then
attends through `batch.block_tables` (so cached context and the causal part of the new
chunk come from the same pages). It returns float32 logits of the last new token of every
sequence and the new pool. `cfg`, `backend`, `decode_only` and `all_logits` are static.

The network itself is defined once in `layers.py`; the dense reference and the training path
live in `dense.py` and are re-exported here.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from paxkv.cache import kv_pool as kv_pool_lib
from paxkv.cache.kv_pool import KVPool
from paxkv.config import ModelConfig
from paxkv.model.attention import attend
from paxkv.model.batch import StepBatch
from paxkv.model.dense import (DenseCache, dense_forward, dense_forward_jit,  # noqa: F401
                               greedy_generate, grouped_attention, init_cache)
from paxkv.model.layers import INIT_STD, Llama, params_dtype
from paxkv.model.rope import apply_rope, cos_sin

Params = Any  # nested dict of arrays, the Linen "params" collection


def _check_batch(batch: StepBatch, kv_pool: KVPool, cfg: ModelConfig) -> None:
    if batch.token_ids.ndim != 1:
        raise ValueError(f"forward: batch.token_ids must be 1-D [T], got shape {batch.token_ids.shape}")
    for field in ("positions", "slot_mapping"):
        if getattr(batch, field).shape != batch.token_ids.shape:
            raise ValueError(f"forward: batch.{field} shape {getattr(batch, field).shape} != "
                             f"token_ids shape {batch.token_ids.shape}")
    if kv_pool.num_layers != cfg.num_layers:
        raise ValueError(f"forward: kv_pool has {kv_pool.num_layers} layers, "
                         f"cfg.num_layers={cfg.num_layers}")
    if kv_pool.k[0].shape[2:] != (cfg.num_kv_heads, cfg.head_dim):
        raise ValueError(f"forward: kv_pool pages {kv_pool.k[0].shape} do not hold "
                         f"{cfg.num_kv_heads} kv heads of dim {cfg.head_dim}")


def forward(params: Params, batch: StepBatch, kv_pool: KVPool, cfg: ModelConfig, *,
            backend: str = "reference", decode_only: bool = False,
            all_logits: bool = False, mesh: Any = None, hidden_at: jax.Array | None = None,
            hidden_layers: tuple[int, ...] = ()) -> tuple[jax.Array, ...]:
    """One paged step -> (logits `[S, vocab]` float32 at `batch.logits_indices`, new pool).

    With `all_logits=True` the logits of every token are returned instead (`[T, vocab]`),
    e.g. for perplexity. `mesh` (static): the tensor-parallel mesh that `params` and
    `kv_pool` are split over (`paxkv.parallel`); None runs on one device. With
    `hidden_layers` (static) a third output holds those layers' residual stream at token
    indices `hidden_at` (`Llama.__call__`), from the same pass.
    """
    _check_batch(batch, kv_pool, cfg)
    scale = cfg.head_dim ** -0.5
    # On the GPU kernels' backend, on one device, the small per-layer work runs as fused
    # Pallas kernels (residual add + norm; RoPE + KV write, inside the attention kernel on
    # decode steps; `Llama.fused`).
    fused = backend == "pallas" and mesh is None
    if fused:
        cos, sin = cos_sin(batch.positions, cfg)

    def write_and_attend(layer: int, q: jax.Array, k: jax.Array, v: jax.Array, pool: KVPool,
                         batch: StepBatch) -> tuple[jax.Array, KVPool]:
        if fused:   # q holds the packed, unrotated q/k/v heads (`Attention.packed_qkv`)
            from paxkv.model import pallas_backend
            if pallas_backend.fuses_rope_decode(q, pool.k[layer], batch, decode_only=decode_only,
                                                quantized=pool.quantized):
                out, nk, nv = pallas_backend.rope_attend(q, cos, sin, pool.k[layer],
                                                         pool.v[layer], batch, scale=scale)
                return out, pool._replace(k=kv_pool_lib.replace_layer(pool.k, layer, nk),
                                          v=kv_pool_lib.replace_layer(pool.v, layer, nv))
            q, pool = _rotate_and_write(layer, q, cos, sin, pool, batch.slot_mapping)
        else:
            pool = kv_pool_lib.write(pool, layer, k, v, batch.slot_mapping)
        k_scale = None if pool.k_scale is None else pool.k_scale[layer]
        v_scale = None if pool.v_scale is None else pool.v_scale[layer]
        out = attend(q, pool.k[layer], pool.v[layer], batch, scale=scale, backend=backend,
                     decode_only=decode_only, k_scale=k_scale, v_scale=v_scale)
        return out, pool

    if mesh is None:
        def paged_attention(layer: int, q: jax.Array, k: jax.Array, v: jax.Array,
                            pool: KVPool) -> tuple[jax.Array, KVPool]:
            return write_and_attend(layer, q, k, v, pool, batch)
    else:   # each device writes and attends over its own KV heads
        from paxkv.parallel.attention import per_device
        paged_attention = per_device(write_and_attend, batch, mesh)

    model = Llama(cfg, params_dtype(params), fused=fused)
    logits_at = None if all_logits else batch.logits_indices
    return model.apply({"params": params}, batch.token_ids, batch.positions, paged_attention,
                       kv_pool, logits_at=logits_at, hidden_at=hidden_at,
                       hidden_layers=hidden_layers)


def _rotate_and_write(layer: int, qkv: jax.Array, cos: jax.Array, sin: jax.Array, pool: KVPool,
                      slot_mapping: jax.Array) -> tuple[jax.Array, KVPool]:
    """RoPE on the packed q/k/v heads `[T, Hq + 2 Hkv, d]`, k and v into the pool -> (rotated
    q, pool): one kernel for plain pages (`pallas_kernels.layer_ops.rope_kv_write`), else the
    jnp rotation and the pool's write."""
    from pallas_kernels.layer_ops import rope_kv_write
    from pallas_kernels.layer_ops.rope_kv_write import split_heads, supported
    kv_heads = pool.k[layer].shape[2]
    q_heads = qkv.shape[-2] - 2 * kv_heads
    if not pool.quantized and supported(q_heads, kv_heads, qkv.shape[-1]):
        q, nk, nv = rope_kv_write(qkv, cos, sin, slot_mapping, pool.k[layer], pool.v[layer],
                                  interpret=jax.default_backend() != "gpu")
        return q, pool._replace(k=kv_pool_lib.replace_layer(pool.k, layer, nk),
                                v=kv_pool_lib.replace_layer(pool.v, layer, nv))
    q, k, v = split_heads(qkv, kv_heads)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q, kv_pool_lib.write(pool, layer, k, v, slot_mapping)


def forward_all_logits(params: Params, batch: StepBatch, kv_pool: KVPool, cfg: ModelConfig, *,
                       backend: str = "reference") -> tuple[jax.Array, KVPool]:
    """Like `forward` but returns logits of every token, `[T, vocab]` float32."""
    return forward(params, batch, kv_pool, cfg, backend=backend, all_logits=True)


# The engine's step: the pool is donated so XLA updates its pages in place.
forward_jit = jax.jit(forward, static_argnames=("cfg", "backend", "decode_only", "all_logits", "mesh",
                                               "hidden_layers"),
                      donate_argnames=("kv_pool",))


def param_shapes(cfg: ModelConfig, dtype: Any = jnp.float32) -> Params:
    """The parameter tree as `jax.ShapeDtypeStruct`s (no memory touched)."""
    def init(key):
        ids = jnp.zeros((1, 1), jnp.int32)
        fake_attention = lambda layer, q, k, v, state: (
            grouped_attention(q, k, v, ids, ids[0], 1.0), state)
        return Llama(cfg, dtype).init(key, ids, ids, fake_attention)["params"]
    return jax.eval_shape(init, jax.random.key(0))


def _leaf_name(path: tuple) -> str:
    return "/".join(str(getattr(p, "key", p)) for p in path)


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random parameters created on the default device: norms 1, other weights N(0, 0.02).

    Each tensor is made by its own small jitted call, so even an 8B model never needs more
    than its own size (plus one tensor) of device memory, and nothing goes through the host.
    """
    dtype = jnp.dtype(dtype)
    shapes = param_shapes(cfg, dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    out = []
    for index, (path, leaf) in enumerate(leaves):
        if _leaf_name(path).endswith("scale"):
            out.append(_ones(leaf.shape, dtype))
        else:
            out.append(_normal(jax.random.fold_in(key, index), leaf.shape, dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _ones(shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return jnp.ones(shape, dtype)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return (jax.random.normal(key, shape, jnp.float32) * INIT_STD).astype(dtype)

"""Paged attention per device: each device writes and reads only its own KV heads' pages.

The pool is split by KV heads and the q/k/v projections by the same groups, so the pool
write and the attention of one layer need nothing from any other device. Running them under
shard_map makes that explicit (no collective can appear inside) and lets the Pallas kernels,
which XLA cannot partition, run unchanged on the local heads.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import Mesh, PartitionSpec as P

from paxkv.cache.kv_pool import KVPool
from paxkv.model.batch import StepBatch
from paxkv.parallel.mesh import AXIS, shard_map
from paxkv.parallel.sharding import PAGE_SPEC, SCALE_SPEC

HEADS = P(None, AXIS, None)   # q, k, v and the output: [tokens, heads, head_dim]

# (layer, q, k, v, pool, batch) -> (out, pool): one layer's write + attention.
LayerAttention = Callable[[int, jax.Array, jax.Array, jax.Array, KVPool, StepBatch],
                          tuple[jax.Array, KVPool]]


def _layer(pool: KVPool, layer: int) -> KVPool:
    """A one-layer pool holding `layer`'s pages (and scales)."""
    pick = lambda xs: None if xs is None else (xs[layer],)  # noqa: E731
    return KVPool(pick(pool.k), pick(pool.v), pick(pool.k_scale), pick(pool.v_scale))


def _put_layer(pool: KVPool, layer: int, one: KVPool) -> KVPool:
    put = lambda xs, x: None if xs is None else xs[:layer] + x + xs[layer + 1:]  # noqa: E731
    return KVPool(put(pool.k, one.k), put(pool.v, one.v), put(pool.k_scale, one.k_scale),
                  put(pool.v_scale, one.v_scale))


def per_device(fn: LayerAttention, batch: StepBatch, mesh: Mesh) -> Callable[..., Any]:
    """`fn` run on every device over its own heads; the batch is the same everywhere.

    Returns the `(layer, q, k, v, pool) -> (out, pool)` function the model's layers call.
    """
    def attention(layer: int, q: jax.Array, k: jax.Array, v: jax.Array,
                  pool: KVPool) -> tuple[jax.Array, KVPool]:
        one = _layer(pool, layer)
        scales = SCALE_SPEC if pool.quantized else None
        pool_spec = KVPool((PAGE_SPEC,), (PAGE_SPEC,), None if scales is None else (scales,),
                           None if scales is None else (scales,))
        local = shard_map(lambda q, k, v, p, b: fn(0, q, k, v, p, b), mesh,
                          in_specs=(HEADS, HEADS, HEADS, pool_spec, P()),
                          out_specs=(HEADS, pool_spec))
        out, one = local(q, k, v, one, batch)
        return out, _put_layer(pool, layer, one)

    return attention

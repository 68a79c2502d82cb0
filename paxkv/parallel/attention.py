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

# (q, k, v, one-layer pool, batch) -> (out, one-layer pool): one layer's write + attention.
LayerAttention = Callable[[jax.Array, jax.Array, jax.Array, KVPool, StepBatch],
                          tuple[jax.Array, KVPool]]


def per_device(fn: LayerAttention, mesh: Mesh, quantized: bool) -> Callable[..., Any]:
    """`fn` run on every device over its own heads of q, k, v and of a one-layer pool; the
    batch is the same everywhere (`paxkv.model.attention.PagedAttention` calls it)."""
    scales = (SCALE_SPEC,) if quantized else None
    pool_spec = KVPool((PAGE_SPEC,), (PAGE_SPEC,), scales, scales)
    return shard_map(fn, mesh, in_specs=(HEADS, HEADS, HEADS, pool_spec, P()),
                     out_specs=(HEADS, pool_spec))

"""The device mesh of a tensor-parallel engine, and the checks on its size.

One mesh axis, `"tp"`: every weight that is split is split over it, and the KV pool is split
over it by KV heads. The mesh spans every process's devices when the engine runs on several
hosts (`paxkv.parallel.multihost`), so the same code serves one host or many.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from paxkv.config import ModelConfig

AXIS = "tp"


def check_tensor_parallel_size(cfg: ModelConfig, tensor_parallel_size: int,
                               num_devices: int | None = None) -> None:
    """ValueError naming `tensor_parallel_size` when the model or the machine cannot take it.

    The KV pool is split by KV heads, so the size must divide `num_kv_heads`; the fused
    gate/up kernel is grouped like the KV heads (`fusion.group_projections`), so
    `intermediate_size` must split into `num_kv_heads` equal groups.
    """
    tp = tensor_parallel_size
    if not isinstance(tp, (int, np.integer)) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    if num_devices is None:
        num_devices = jax.device_count()
    if tp > num_devices:
        raise ValueError(f"tensor_parallel_size {tp} exceeds the {num_devices} devices present "
                         f"({jax.default_backend()})")
    if cfg.num_kv_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's num_kv_heads "
                         f"({cfg.num_kv_heads}): the KV pool is split by KV heads")
    if tp > 1 and cfg.moe_layers and cfg.moe_intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the experts' width "
                         f"moe_intermediate_size ({cfg.moe_intermediate_size}): each device "
                         "holds every expert's slice of it")
    if tp > 1 and cfg.intermediate_size % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp}: intermediate_size {cfg.intermediate_size} "
                         f"does not split into num_kv_heads ({cfg.num_kv_heads}) equal groups")


def make_mesh(tensor_parallel_size: int, devices: Sequence[Any] | None = None) -> Mesh:
    """A one-axis mesh over the first `tensor_parallel_size` devices (all processes')."""
    devices = list(jax.devices() if devices is None else devices)
    if tensor_parallel_size > len(devices):
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} exceeds the "
                         f"{len(devices)} devices present")
    return Mesh(np.array(devices[:tensor_parallel_size]), (AXIS,))


def shard_map(f: Callable, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
    """`jax.shard_map` where this JAX has it, else `jax.experimental.shard_map.shard_map`.

    Replication checks are off: the Pallas kernels run inside, and their outputs are
    per-device by construction (the specs say so).
    """
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map as experimental_shard_map
    return experimental_shard_map(f, mesh, in_specs, out_specs, check_rep=False)

"""Where every weight and every KV page lives on the tensor-parallel mesh (Megatron layout).

Weights (the grouped layout of `paxkv.model.fusion`, one group per KV head):
    qkv_proj, gate_up_proj   [hidden, groups, cols]   split over groups (column parallel)
    o_proj, down_proj        [in, hidden]             split over rows (row parallel)
    experts' gate/up, down   [E, hidden, I], [E, I, hidden]   split over I, as the MLP's
    router                   replicated (every device routes every token the same way)
    embed_tokens, lm_head    split over the vocabulary
    norms                    replicated
so each device computes its own heads and its own chunk of the MLP, and XLA adds one
all-reduce after o_proj and one after down_proj (the contraction there runs over a split
axis). The embedding lookup becomes a masked local gather plus an all-reduce; the logits
stay split over the vocabulary until sampling, which reduces across devices only the
sequences' last rows (the step never computes logits for other tokens).

The KV pool is split by KV heads: device j holds heads `[j * H / tp, (j + 1) * H / tp)` of
every block (and their scales, for 8-bit pools), so a block id means the same block on every
device and the host-side block manager does not know about devices at all.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paxkv.cache import kv_pool as kvp
from paxkv.config import ModelConfig
from paxkv.parallel.mesh import AXIS

Params = Any

# Page and scale layouts: [num_blocks, block_size, kv_heads, (head_dim)].
PAGE_SPEC = P(None, None, AXIS, None)
SCALE_SPEC = P(None, None, AXIS)
HEADS_AXIS = 2   # the split axis of pages and scales


def _vocab_split(cfg: ModelConfig, mesh: Mesh) -> bool:
    """Split the vocabulary only where it divides evenly (Llama-3's 128,256 does up to 8)."""
    return cfg.vocab_size % mesh.size == 0


def param_spec(path: tuple[str, ...], ndim: int, cfg: ModelConfig, mesh: Mesh) -> P:
    """The PartitionSpec of the parameter at `path` (keys of the params tree). Every family's
    tree uses these names (`paxkv/model/layers.py`): norm gains (q/k norms included) are
    replicated, biases split as their projection's output columns."""
    name = path[-2] if path[-1] in ("kernel", "embedding", "scale", "bias") else path[-1]
    if path[-1] == "scale":
        return P()
    if "experts" in path:   # stacked [E, in, out]: every expert on every device, split by width
        return P(None, None, AXIS) if name in ("gate_proj", "up_proj") else P(None, AXIS, None)
    if name == "router":
        return P()
    if path[-1] == "bias":
        if name == "qkv_proj":
            return P(AXIS, None)         # grouped: [groups, cols]
        if name in ("q_proj", "k_proj", "v_proj"):
            return P(AXIS)
        if name == "o_proj":
            return P()                   # added after the row-parallel all-reduce
        raise ValueError(f"no tensor-parallel placement for parameter {'/'.join(path)}")
    if name in ("qkv_proj", "gate_up_proj"):
        if ndim != 3:
            raise ValueError(f"{'/'.join(path)} must be in the grouped layout "
                             "(fusion.group_projections) to be split")
        return P(None, AXIS, None)
    if name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        return P(None, AXIS)             # the separate kernels, before grouping
    if name in ("o_proj", "down_proj"):
        return P(AXIS, None)
    if name == "embed_tokens":
        return P(AXIS, None) if _vocab_split(cfg, mesh) else P()
    if name == "lm_head":
        return P(None, AXIS) if _vocab_split(cfg, mesh) else P()
    raise ValueError(f"no tensor-parallel placement for parameter {'/'.join(path)}")


def _key_path(path: tuple) -> tuple[str, ...]:
    return tuple(str(getattr(p, "key", p)) for p in path)


def param_shardings(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    """A tree of NamedShardings matching `params` (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(_key_path(path), x.ndim, cfg, mesh)), params)


def shard_params(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    """Parameters in any layout (on host or device) -> grouped and split over `mesh`.

    Each tensor is placed (or regrouped) by its own jitted call whose output sharding is
    the target, so a device receives only its own shard of every tensor it did not hold.
    """
    from paxkv.model.fusion import is_grouped, projection, with_fused_kernels
    grouped = params
    if not is_grouped(params):
        target = {"kernel": NamedSharding(mesh, P(None, AXIS, None)),
                  "bias": NamedSharding(mesh, P(AXIS, None))}
        grouped = with_fused_kernels(params, lambda layer, block, parts, leaf: _jit_grouped(
            cfg.num_kv_heads, target[leaf])(tuple(projection(layer, block, p, cfg, leaf)
                                                  for p in parts)))
    return jax.tree_util.tree_map_with_path(
        lambda path, x: _place(x, NamedSharding(mesh, param_spec(_key_path(path), np.ndim(x), cfg, mesh))),
        grouped)


def _place(x: Any, sharding: NamedSharding) -> jax.Array:
    if isinstance(x, jax.Array):
        if x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        return jax.jit(lambda a: a, out_shardings=sharding)(x)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


@functools.lru_cache(maxsize=None)
def _jit_grouped(groups: int, sharding: NamedSharding) -> Any:
    from paxkv.model.fusion import group_kernel
    return jax.jit(lambda kernels: group_kernel(list(kernels), groups), out_shardings=sharding)


# ---------------------------------------------------------------------------- the KV pool

def pool_shardings(pool: kvp.KVPool, mesh: Mesh) -> kvp.KVPool:
    """NamedShardings of a pool's leaves (pages split by heads, scales with them)."""
    pages, scales = NamedSharding(mesh, PAGE_SPEC), NamedSharding(mesh, SCALE_SPEC)
    layers = len(pool.k)
    return kvp.KVPool((pages,) * layers, (pages,) * layers,
                      (scales,) * layers if pool.quantized else None,
                      (scales,) * layers if pool.quantized else None)


def init_pool(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: Any, mesh: Mesh) -> kvp.KVPool:
    """`kv_pool.init_pool`, each device allocating only its own heads' pages."""
    shapes = jax.eval_shape(lambda: kvp.init_pool(cfg, num_blocks, block_size, dtype))
    make = jax.jit(lambda: kvp.init_pool(cfg, num_blocks, block_size, dtype),
                   out_shardings=pool_shardings(shapes, mesh))
    return make()


def per_device_bytes(tree: Any) -> int:
    """Bytes of `tree` that one device holds (its first addressable shard of every leaf)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.addressable_shards[0].data
        total += shard.size * shard.dtype.itemsize
    return total


def put_replicated(x: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host array -> the same value on every device of `mesh` (every process passes the
    same value: the multi-host step protocol guarantees it)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, P()), lambda index: x[index])


# ---------------------------------------------------------------------------- swap to host

def local_heads(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
    """The range of KV heads (axis 2) that this process's devices hold, in one slice."""
    ranges = sorted({(idx[HEADS_AXIS].start or 0,
                      shape[HEADS_AXIS] if idx[HEADS_AXIS].stop is None else idx[HEADS_AXIS].stop)
                     for idx in sharding.addressable_devices_indices_map(shape).values()})
    for (_, stop), (start, _) in zip(ranges, ranges[1:]):
        if stop != start:
            raise ValueError(f"this process's KV heads {ranges} are not contiguous: build the "
                             "mesh in jax.devices() order")
    return slice(ranges[0][0], ranges[-1][1])


def to_host_local(x: jax.Array) -> np.ndarray:
    """The process-local heads of a head-split array, as one numpy array (swap out)."""
    heads = local_heads(x.sharding, x.shape)
    out = np.empty(x.shape[:HEADS_AXIS] + (heads.stop - heads.start,) + x.shape[HEADS_AXIS + 1:],
                   x.dtype)
    for shard in x.addressable_shards:
        h = shard.index[HEADS_AXIS]
        start = (h.start or 0) - heads.start
        stop = (x.shape[HEADS_AXIS] if h.stop is None else h.stop) - heads.start
        out[:, :, start:stop] = np.asarray(shard.data)
    return out


def from_host_local(local: np.ndarray, sharding: NamedSharding, shape: tuple[int, ...]) -> jax.Array:
    """Process-local heads (as from `to_host_local`) -> a global head-split array (swap in)."""
    heads = local_heads(sharding, shape)

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        h = index[HEADS_AXIS]
        start = (h.start or 0) - heads.start
        stop = (shape[HEADS_AXIS] if h.stop is None else h.stop) - heads.start
        return local[index[:HEADS_AXIS] + (slice(start, stop),)]

    return jax.make_array_from_callback(shape, sharding, shard)

"""Weights straight into their shards: no device ever holds a whole tensor.

`load_checkpoint` reads each device's part of each tensor from its `.safetensors` file and
puts it on that device (`jax.make_array_from_callback`). Splits along a checkpoint tensor's
rows (q/k/v, gate/up, lm_head: HF stores linear weights as `[out, in]`; the embedding) read
one contiguous byte range; splits along its columns (o_proj, down_proj) read bounded chunks
of rows and keep the wanted columns. Host memory therefore holds one device's shard (and its
transposed copy) at a time, plus the shards already handed to the runtime for the current
tensor. The fused q/k/v and gate/up kernels are assembled per shard in the grouped layout of
`fusion.group_projections`, so each device's shard holds its own heads and MLP chunk.

`random_params` builds the same values as `paxkv.model.weights.random_params` (threefry is
partitionable: a value does not depend on how its array is split), each device generating
only its shards, one layer at a time: the 70B preset builds on 4 or 8 GPUs.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from paxkv.config import ModelConfig
from paxkv.model.fusion import FUSED, part_widths
from paxkv.model.weights import CheckpointIndex, TensorSpec, _SAFETENSORS_DTYPES, open_checkpoint
from paxkv.parallel.sharding import param_spec, shard_params

Params = Any
Index = tuple[slice, ...]

_CHUNK_BYTES = 64 << 20   # rows read at a time when a shard is a column range


def _bounds(s: slice, n: int) -> tuple[int, int]:
    start, stop, _ = s.indices(n)
    return start, stop


def read_slice(index: CheckpointIndex, hf_name: str, rows: slice, cols: slice | None = None) -> np.ndarray:
    """Rows `rows` (and columns `cols`) of one checkpoint tensor, reading only those rows.

    1-D tensors take `rows` alone. Reads straight into a fresh host buffer, one contiguous
    range when every column is kept, else in chunks of rows of at most `_CHUNK_BYTES`.
    """
    fname, info, data_start = index.info(hf_name)
    dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
    shape = tuple(info["shape"])
    r0, r1 = _bounds(rows, shape[0])
    row_elems = int(np.prod(shape[1:], dtype=np.int64))
    row_bytes = row_elems * dtype.itemsize
    if len(shape) == 1:
        c0 = c1 = 0
        full_rows = True
    else:
        c0, c1 = (0, shape[1]) if cols is None else _bounds(cols, shape[1])
        full_rows = c0 == 0 and c1 == shape[1]
    out_shape = (r1 - r0,) + (() if len(shape) == 1 else (c1 - c0,) + shape[2:])
    out = np.empty(out_shape, dtype)
    begin = info["data_offsets"][0]
    with open(fname, "rb") as f:
        if full_rows:
            f.seek(data_start + begin + r0 * row_bytes)
            if out.nbytes and f.readinto(out.reshape(-1).view(np.uint8)) != out.nbytes:
                raise ValueError(f"tensor {hf_name!r}: file ends before its data does")
            return out
        step = max(1, _CHUNK_BYTES // max(1, row_bytes))
        chunk = np.empty((min(step, r1 - r0),) + shape[1:], dtype)
        for a in range(r0, r1, step):
            b = min(r1, a + step)
            buf = chunk[:b - a]
            f.seek(data_start + begin + a * row_bytes)
            if f.readinto(buf.reshape(-1).view(np.uint8)) != buf.nbytes:
                raise ValueError(f"tensor {hf_name!r}: file ends before its data does")
            out[a - r0:b - r0] = buf[:, c0:c1]
    return out


def _plain_shard(index: CheckpointIndex, spec: TensorSpec) -> Callable[[Index], np.ndarray]:
    """Callback for a tensor that maps to one parameter (transposed when HF is [out, in])."""
    def shard(idx: Index) -> np.ndarray:
        if len(spec.hf_shape) == 1:
            x = read_slice(index, spec.hf_name, idx[0])
        elif spec.transpose:   # parameter [in, out] = HF [out, in].T
            x = read_slice(index, spec.hf_name, idx[1], idx[0]).T
        else:
            x = read_slice(index, spec.hf_name, idx[0], idx[1])
        return np.ascontiguousarray(x, dtype=index.target)
    return shard


def _expert_shard(index: CheckpointIndex, specs: list[TensorSpec]) -> Callable[[Index], np.ndarray]:
    """Callback for a stacked expert leaf `[E, in, out]`: a shard's experts, each its
    `[in, out]` block read from that expert's HF `[out, in]` tensor."""
    def shard(idx: Index) -> np.ndarray:
        e0, e1 = _bounds(idx[0], len(specs))
        x = np.stack([read_slice(index, specs[e].hf_name, idx[2], idx[1]).T for e in range(e0, e1)])
        return np.ascontiguousarray(x, dtype=index.target)
    return shard


def _grouped_shard(index: CheckpointIndex, layer: int, fused_name: str,
                   leaf: str = "kernel") -> Callable[[Index], np.ndarray]:
    """Callback for a fused kernel in the grouped layout `[hidden, groups, cols]` (or its bias,
    `[groups, cols]`): a shard's groups take rows `[g0 * w / G, g1 * w / G)` of every
    separate HF projection."""
    cfg = index.cfg
    block, parts = FUSED[fused_name]
    groups = cfg.num_kv_heads
    per_group = [w // groups for w in part_widths(cfg, fused_name)]
    suffix = "weight" if leaf == "kernel" else "bias"

    def shard(idx: Index) -> np.ndarray:
        group_axis = 1 if leaf == "kernel" else 0
        g0, g1 = _bounds(idx[group_axis], groups)
        pieces = []
        for part, w in zip(parts, per_group):
            name = f"model.layers.{layer}.{block}.{part}.{suffix}"
            if leaf == "bias":
                pieces.append(read_slice(index, name, slice(g0 * w, g1 * w)).reshape(g1 - g0, w))
                continue
            rows = read_slice(index, name, slice(g0 * w, g1 * w), idx[0])   # [(g1-g0) w, in]
            pieces.append(rows.T.reshape(rows.shape[1], g1 - g0, w))
        x = np.concatenate(pieces, axis=-1)
        x = x[:, idx[1]] if leaf == "bias" else x[:, :, idx[2]]
        return np.ascontiguousarray(x, dtype=index.target)
    return shard


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def load_checkpoint(path: str | os.PathLike, mesh: Mesh, dtype: Any = "bfloat16",
                    progress: bool | None = None) -> tuple[Params, ModelConfig]:
    """An HF checkpoint directory -> (params in the grouped layout split over `mesh`,
    ModelConfig). Every device receives only its shards; ValueErrors as
    `paxkv.model.weights.open_checkpoint` raises them."""
    index = open_checkpoint(path, dtype)
    cfg = index.cfg
    fused_parts = {p for _, parts in FUSED.values() for p in parts}
    jobs: list[tuple[tuple[str, ...], tuple[int, ...], Callable[[Index], np.ndarray]]] = []
    stacked: dict[tuple[str, ...], list[TensorSpec]] = {}
    for spec in index.specs:
        if spec.expert is not None:
            stacked.setdefault(spec.path, []).append(spec)
            continue
        if spec.path[-2] in fused_parts:
            continue
        shape = spec.hf_shape[::-1] if spec.transpose else spec.hf_shape
        jobs.append((spec.path, shape, _plain_shard(index, spec)))
    for tree_path, specs in stacked.items():
        specs.sort(key=lambda s: s.expert)
        jobs.append((tree_path, (len(specs),) + specs[0].hf_shape[::-1], _expert_shard(index, specs)))
    held = {spec.path for spec in index.specs}
    for layer in range(cfg.num_layers):
        for fused_name, (block, parts) in FUSED.items():
            if block == "mlp" and cfg.is_moe_layer(layer):
                continue
            widths = part_widths(cfg, fused_name)
            cols = sum(widths) // cfg.num_kv_heads
            jobs.append(((f"layers_{layer}", block, fused_name, "kernel"),
                         (cfg.hidden_size, cfg.num_kv_heads, cols),
                         _grouped_shard(index, layer, fused_name)))
            if (f"layers_{layer}", block, parts[0], "bias") in held:
                jobs.append(((f"layers_{layer}", block, fused_name, "bias"),
                             (cfg.num_kv_heads, cols), _grouped_shard(index, layer, fused_name, "bias")))
    if progress is None:
        total = sum(int(np.prod(s)) for _, s, _ in jobs) * np.dtype(index.target).itemsize
        progress = total > (1 << 30)
    from tqdm import tqdm
    params: dict[str, Any] = {}
    for tree_path, shape, callback in tqdm(jobs, desc="loading weight shards", disable=not progress):
        sharding = NamedSharding(mesh, param_spec(tree_path, len(shape), cfg, mesh))
        x = jax.make_array_from_callback(shape, sharding, callback, dtype=index.target)
        x.block_until_ready()   # this tensor's host shards can go before the next is read
        _set(params, tree_path, x)
    return params, cfg


def random_params(cfg: ModelConfig, mesh: Mesh, key: jax.Array | int = 0,
                  dtype: Any = "bfloat16") -> Params:
    """`paxkv.model.weights.random_params`' values, grouped and split over `mesh`, built in place.

    Each tensor comes out of a jitted initializer whose output sharding is its shard layout;
    one layer's separate q/k/v and gate/up kernels live only until they are grouped.
    """
    from paxkv.model.layers import INIT_STD
    from paxkv.model.params import init_value, leaf_name as _leaf_name, param_shapes
    from paxkv.model.weights import _resolve_dtype
    if isinstance(key, int):
        key = jax.random.key(key)
    target = _resolve_dtype(dtype, {})
    leaves, _ = jax.tree_util.tree_flatten_with_path(param_shapes(cfg, target))
    per_layer: dict[str, int] = {}
    for path, _ in leaves:
        top = str(getattr(path[0], "key", path[0]))
        per_layer[top] = per_layer.get(top, 0) + 1
    by_top: dict[str, dict] = {}
    built: dict[str, int] = {}
    for i, (path, leaf) in enumerate(leaves):
        keys = tuple(str(getattr(p, "key", p)) for p in path)
        sharding = NamedSharding(mesh, param_spec(keys, leaf.ndim, cfg, mesh))
        value = init_value(cfg, _leaf_name(path))
        if value is not None:
            x = _initializer(leaf.shape, target, sharding, None, value)()
        else:
            x = _initializer(leaf.shape, target, sharding, INIT_STD)(jax.random.fold_in(key, i))
        _set(by_top, keys, x)
        top = keys[0]
        built[top] = built.get(top, 0) + 1
        if top.startswith("layers_") and built[top] == per_layer[top]:   # the layer is whole:
            by_top[top] = shard_params({top: by_top[top]}, cfg, mesh)[top]   # group, drop parts
    return by_top


@functools.lru_cache(maxsize=None)
def _initializer(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding,
                 std: float | None, value: float = 1.0) -> Callable[..., jax.Array]:
    """A jitted initializer writing straight into `sharding`: the constant `value` (std None)
    or N(0, std), drawn as `paxkv.model.params.init_params` draws them."""
    import jax.numpy as jnp
    if std is None:
        return jax.jit(lambda: jnp.full(shape, value, dtype), out_shardings=sharding)
    return jax.jit(lambda k: (jax.random.normal(k, shape, jnp.float32) * std).astype(dtype),
                   out_shardings=sharding)


def load_model(path: str | None, cfg: ModelConfig | None, params: Params | None,
               tensor_parallel_size: int, dtype: str, seed: int) -> tuple[Mesh, Params, ModelConfig]:
    """The tensor-parallel counterpart of LLM's weight setup -> (mesh, params, cfg).

    A checkpoint directory loads straight into shards; given `params` (any layout) are
    regrouped and split; otherwise random weights (seed `seed`, the same values as on one
    device) are built in place.
    """
    from paxkv.model.gguf_file import is_gguf
    from paxkv.model.weights import checkpoint_config, load_gguf
    from paxkv.parallel.mesh import check_tensor_parallel_size, make_mesh
    if cfg is None:
        cfg = checkpoint_config(path)
    check_tensor_parallel_size(cfg, tensor_parallel_size)
    if jax.process_count() > 1 and tensor_parallel_size != jax.device_count():
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} must equal the "
                         f"{jax.device_count()} devices of all {jax.process_count()} processes")
    mesh = make_mesh(tensor_parallel_size)
    if params is not None:
        return mesh, shard_params(params, cfg, mesh), cfg
    if path is not None and is_gguf(path):   # dequantized one tensor at a time, then split
        params, cfg = load_gguf(path, dtype)
        return mesh, shard_params(params, cfg, mesh), cfg
    if path is not None:
        params, cfg = load_checkpoint(path, mesh, dtype)
        return mesh, params, cfg
    return mesh, random_params(cfg, mesh, jax.random.PRNGKey(seed), dtype), cfg

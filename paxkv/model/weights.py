"""Hugging Face checkpoints of every family <-> paxkv parameter trees.

Which tensors a checkpoint holds and where each goes in the tree is the family's to say
(`tensor_specs`, from the module `paxkv/model/registry.py` names); this module reads, checks
and writes them.

Loading streams the checkpoint one tensor at a time: each tensor is read from its
`.safetensors` file into a fresh host buffer, put on the device, transposed / cast there, and
released before the next one is read. Host memory therefore peaks at (on an accelerator) about
one tensor, or (on CPU, where the parameters themselves live in host memory) the model plus
about one tensor: never a float32 copy of the whole model.

The safetensors file format is read directly (an 8-byte header length, a JSON header of
`{name: {dtype, shape, data_offsets}}`, then raw little-endian data) rather than through
`safetensors.safe_open`: its numpy framework cannot represent bfloat16, and its jax framework
materializes each tensor on the default device with no say over placement or host copies.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import struct
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from paxkv.config import ModelConfig
from paxkv.model.families.base import TensorSpec
from paxkv.model.fusion import FUSED_PARTS, projection
from paxkv.model.params import init_params
from paxkv.model.registry import config_from_hf, family_of

Params = Any

_SAFETENSORS_DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
_TARGET_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
# Tensors some checkpoints carry that the forward does not need (recomputed RoPE tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

__all__ = ["TensorSpec", "tensor_specs", "checkpoint_config", "open_checkpoint", "load_checkpoint",
           "load_gguf", "load_tensors", "random_params",
           "hf_config_dict", "hf_tensors", "save_checkpoint", "write_safetensors"]


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor a checkpoint of this config must hold, in HF naming (the family's list)."""
    return family_of(cfg).tensor_specs(cfg)


# ---------------------------------------------------------------------------- safetensors I/O

def read_safetensors_header(path: str) -> tuple[dict[str, Any], int]:
    """(header without `__metadata__`, byte offset where tensor data starts)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{os.path.basename(path)} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def _read_tensor(f, name: str, info: dict[str, Any], data_start: int) -> np.ndarray:
    """Read one tensor into a fresh (not memory-mapped) host buffer."""
    if info["dtype"] not in _SAFETENSORS_DTYPES:
        raise ValueError(f"tensor {name!r} has unsupported safetensors dtype {info['dtype']!r}")
    arr = np.empty(tuple(info["shape"]), _SAFETENSORS_DTYPES[info["dtype"]])
    begin, end = info["data_offsets"]
    if end - begin != arr.nbytes:
        raise ValueError(f"tensor {name!r}: {end - begin} bytes stored for shape "
                         f"{tuple(info['shape'])} {info['dtype']} ({arr.nbytes} expected)")
    f.seek(data_start + begin)
    if arr.nbytes and f.readinto(arr.reshape(-1).view(np.uint8)) != arr.nbytes:
        raise ValueError(f"tensor {name!r}: file ends before its data does")
    return arr


def _checkpoint_files(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors file path, from the shard index or the single file."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"model.safetensors.index.json has no 'weight_map' in {path}")
        out = {}
        for name, fname in weight_map.items():
            full = os.path.join(path, fname)
            if not os.path.exists(full):
                raise ValueError(f"shard {fname!r} (holding {name!r}) listed in "
                                 "model.safetensors.index.json is missing")
            out[name] = full
        return out
    if os.path.exists(single):
        header, _ = read_safetensors_header(single)
        return {name: single for name in header}
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path}")


def _resolve_dtype(dtype: Any, raw: dict[str, Any]) -> Any:
    if dtype == "auto":
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    if isinstance(dtype, str):
        if dtype not in _TARGET_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_TARGET_DTYPES) + ['auto']}, got {dtype!r}")
        return jnp.dtype(_TARGET_DTYPES[dtype])
    try:
        resolved = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype {dtype!r} is not a dtype") from e
    if resolved not in [jnp.dtype(d) for d in _TARGET_DTYPES.values()]:
        raise ValueError(f"dtype must be one of {sorted(_TARGET_DTYPES)}, got {resolved}")
    return resolved


def _prepare_impl(x: jax.Array, dtype: Any, transpose: bool) -> jax.Array:
    x = x.T if transpose else x
    return x.astype(dtype)


_prepare = jax.jit(_prepare_impl, static_argnums=(1, 2))


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


@functools.partial(jax.jit, static_argnums=(1,))
def _empty_stack(x: jax.Array, count: int) -> jax.Array:
    return jnp.zeros((count,) + x.shape, x.dtype)


@functools.partial(jax.jit, donate_argnums=(0,))
def _stack_set(stack: jax.Array, x: jax.Array, index: jax.Array) -> jax.Array:
    return stack.at[index].set(x)


def _put(params: dict, spec: TensorSpec, x: jax.Array, cfg: ModelConfig) -> None:
    """Store one checkpoint tensor at its place: a leaf, or (an expert's weight) its slice of
    the stacked leaf, which is made on the tensor's device when its first slice arrives and
    updated in place after."""
    if spec.expert is None:
        _set(params, spec.path, x)
        return
    try:
        stack = _get(params, spec.path)
    except KeyError:
        stack = _empty_stack(x, cfg.num_experts)
    _set(params, spec.path, _stack_set(stack, x, jnp.int32(spec.expert)))


@dataclasses.dataclass
class CheckpointIndex:
    """A checked checkpoint directory: its config, every tensor's spec, file and header."""

    cfg: ModelConfig
    target: Any                                  # the dtype the parameters are cast to
    specs: list[TensorSpec]
    files: dict[str, str]                        # HF name -> safetensors path
    headers: dict[str, tuple[dict[str, Any], int]]   # path -> (header, data start)

    def info(self, hf_name: str) -> tuple[str, dict[str, Any], int]:
        """(file, header entry, data start) of one tensor."""
        fname = self.files[hf_name]
        header, start = self.headers[fname]
        return fname, header[hf_name], start


def open_checkpoint(path: str | os.PathLike, dtype: Any = "bfloat16") -> CheckpointIndex:
    """Read config.json and every safetensors header; check names and shapes (no data read).

    Raises ValueError naming the tensor or config field on a missing tensor, a wrong shape,
    an unexpected tensor, or an architecture (or config value) paxkv does not serve.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint path {path!r} is not a directory")
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"config.json not found in checkpoint {path!r}")
    with open(config_path) as f:
        raw = json.load(f)
    cfg = config_from_hf(raw, name=os.path.basename(os.path.normpath(path)))
    target = _resolve_dtype(dtype, raw)

    files = _checkpoint_files(path)
    specs = tensor_specs(cfg)
    expected = {s.hf_name for s in specs}
    for name in files:
        if name in expected or name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # some tied checkpoints store the (identical) head anyway
        raise ValueError(f"checkpoint has tensor {name!r} that a {cfg.architecture} with this "
                         "config.json does not use")
    for spec in specs:
        if spec.hf_name not in files:
            raise ValueError(f"checkpoint is missing tensor {spec.hf_name!r}")

    headers: dict[str, tuple[dict[str, Any], int]] = {}
    for spec in specs:
        fname = files[spec.hf_name]
        if fname not in headers:
            headers[fname] = read_safetensors_header(fname)
    # Check every name and shape before reading any data: a bad checkpoint fails in ms.
    for spec in specs:
        header = headers[files[spec.hf_name]][0]
        if spec.hf_name not in header:
            raise ValueError(f"tensor {spec.hf_name!r} is not in "
                             f"{os.path.basename(files[spec.hf_name])} as the index says")
        shape = tuple(header[spec.hf_name]["shape"])
        if shape != spec.hf_shape:
            raise ValueError(f"tensor {spec.hf_name!r} has shape {shape}, "
                             f"expected {spec.hf_shape} for this config.json")
    return CheckpointIndex(cfg, target, specs, files, headers)


def load_gguf(path: str | os.PathLike, dtype: Any = "bfloat16", device: Any = None,
              progress: bool | None = None) -> tuple[Params, ModelConfig]:
    """A GGUF file (`gguf_file.GGUFCheckpoint`) -> (params, ModelConfig), each tensor
    dequantized and placed in turn (`load_tensors`)."""
    from paxkv.model.gguf_file import GGUFCheckpoint
    ckpt = GGUFCheckpoint(path)
    return load_tensors(ckpt.cfg, ckpt.tensors.keys(), ckpt.tensor, dtype, device, progress,
                        source=os.path.basename(ckpt.path)), ckpt.cfg


def checkpoint_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a checkpoint directory or GGUF file, without reading weights."""
    from paxkv.model.gguf_file import GGUFCheckpoint, is_gguf
    if is_gguf(path):
        return GGUFCheckpoint(path).cfg
    return config_from_hf(path, name=os.path.basename(os.path.normpath(os.fspath(path))))


def load_checkpoint(path: str | os.PathLike, dtype: Any = "bfloat16", device: Any = None,
                    progress: bool | None = None) -> tuple[Params, ModelConfig]:
    """Read an HF checkpoint directory, or a GGUF file (`gguf_file.load_gguf`), ->
    (params, ModelConfig).

    `dtype`: "bfloat16" / "float32" / "float16" / "auto" (the checkpoint's) or a dtype.
    `device`: a `jax.Device`, a `jax.sharding.Sharding`, or None for the default device
    (tensor-parallel loading, where no device holds a whole tensor, is
    `paxkv.parallel.loading.load_checkpoint`). Raises ValueError as `open_checkpoint` does.
    """
    from paxkv.model.gguf_file import is_gguf
    if is_gguf(path):
        return load_gguf(path, dtype, device, progress)
    put_device = device if isinstance(device, jax.Device) else None
    sharding = device if isinstance(device, jax.sharding.Sharding) else None
    if device is not None and put_device is None and sharding is None:
        raise ValueError(f"device must be a jax.Device, a Sharding or None, got {device!r}")
    index = open_checkpoint(path, dtype)
    cfg, target, specs, files, headers = (index.cfg, index.target, index.specs, index.files,
                                          index.headers)
    by_file: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        by_file.setdefault(files[spec.hf_name], []).append(spec)
    total_bytes = sum(math.prod(s.hf_shape) for s in specs) * target.itemsize
    if progress is None:
        progress = total_bytes > (1 << 30)

    from tqdm import tqdm
    params: dict[str, Any] = {}
    with tqdm(total=len(specs), desc="loading weights", disable=not progress) as bar:
        for fname, file_specs in by_file.items():
            header, data_start = headers[fname]
            # Read in file order: sequential I/O.
            file_specs.sort(key=lambda s: header[s.hf_name]["data_offsets"][0])
            with open(fname, "rb") as f:
                for spec in file_specs:
                    host = _read_tensor(f, spec.hf_name, header[spec.hf_name], data_start)
                    x = _prepare(jax.device_put(host, put_device), target, spec.transpose)
                    if sharding is not None:
                        x = jax.device_put(x, sharding)
                    x.block_until_ready()  # the host buffer can go before the next read
                    del host
                    _put(params, spec, x, cfg)
                    bar.update(1)
    return params, cfg


def load_tensors(cfg: ModelConfig, held: Iterable[str], tensor: Callable[[str], np.ndarray],
                 dtype: Any = "bfloat16", device: Any = None, progress: bool | None = None,
                 source: str = "checkpoint") -> Params:
    """Parameters from a checkpoint that hands out host tensors by HF name (a GGUF file):
    the names held are checked against the family's `tensor_specs` (missing, unexpected and
    misshapen tensors are ValueErrors naming them), then each tensor is read, placed, cast
    and released before the next, as `load_checkpoint` does."""
    put_device = device if isinstance(device, jax.Device) else None
    sharding = device if isinstance(device, jax.sharding.Sharding) else None
    if device is not None and put_device is None and sharding is None:
        raise ValueError(f"device must be a jax.Device, a Sharding or None, got {device!r}")
    target = _resolve_dtype(dtype, {})
    specs = tensor_specs(cfg)
    expected = {s.hf_name for s in specs}
    for name in held:
        if name not in expected and not (name == "lm_head.weight" and cfg.tie_word_embeddings):
            raise ValueError(f"{source} has tensor {name!r} that a {cfg.architecture} with this "
                             "config does not use")
    held = set(held)
    for spec in specs:
        if spec.hf_name not in held:
            raise ValueError(f"{source} is missing tensor {spec.hf_name!r}")
    if progress is None:
        progress = sum(math.prod(s.hf_shape) for s in specs) * target.itemsize > (1 << 30)
    from tqdm import tqdm
    params: dict[str, Any] = {}
    for spec in tqdm(specs, desc="loading weights", disable=not progress):
        host = tensor(spec.hf_name)
        if tuple(host.shape) != spec.hf_shape:
            raise ValueError(f"{source} tensor {spec.hf_name!r} has shape {tuple(host.shape)}, "
                             f"expected {spec.hf_shape} for this config")
        x = _prepare(jax.device_put(host, put_device), target, spec.transpose)
        if sharding is not None:
            x = jax.device_put(x, sharding)
        x.block_until_ready()
        del host
        _put(params, spec, x, cfg)
    return params


def random_params(cfg: ModelConfig, key: jax.Array | int = 0, dtype: Any = "bfloat16",
                  device: jax.Device | None = None) -> Params:
    """Random weights built directly on the device (jitted init, no host copy): benchmarks."""
    if isinstance(key, int):
        key = jax.random.key(key)
    target = _resolve_dtype(dtype, {})
    if device is None:
        return init_params(cfg, key, target)
    with jax.default_device(device):
        return init_params(cfg, key, target)


# ---------------------------------------------------------------------------- saving

def hf_config_dict(cfg: ModelConfig, dtype: Any) -> dict[str, Any]:
    """A config.json dict transformers loads for `cfg` (its family writes it)."""
    return family_of(cfg).hf_config(cfg, str(jnp.dtype(dtype)))


def hf_tensors(params: Params, cfg: ModelConfig) -> Iterator[tuple[str, jax.Array]]:
    """(HF name, HF-layout array) for every tensor, one at a time (either weight layout:
    fused projections are sliced apart one tensor at a time)."""
    for spec in tensor_specs(cfg):
        try:
            if spec.path[-2] in FUSED_PARTS:
                x = projection(params[spec.path[0]], spec.path[1], spec.path[2], cfg,
                               spec.path[-1])
            else:
                x = _get(params, spec.path)
                if spec.expert is not None:
                    x = x[spec.expert]
        except KeyError as e:
            raise ValueError(f"params is missing {'/'.join(spec.path)} (HF {spec.hf_name!r})") from e
        expected = spec.hf_shape[::-1] if spec.transpose else spec.hf_shape
        if tuple(x.shape) != expected:
            raise ValueError(f"params {'/'.join(spec.path)} has shape {tuple(x.shape)}, "
                             f"expected {expected}")
        yield spec.hf_name, (jnp.transpose(x) if spec.transpose else x)


def save_checkpoint(params: Params, cfg: ModelConfig, path: str | os.PathLike) -> None:
    """Write `config.json` + `model.safetensors` that transformers loads (the family's class).

    Tensors keep the parameters' dtype. Meant for small models (the whole state is gathered
    to host memory once).
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    tensors = {name: np.asarray(x) for name, x in hf_tensors(params, cfg)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg, dtype), f, indent=2)
    write_safetensors(os.path.join(path, "model.safetensors"), tensors, {"format": "pt"})


_NUMPY_TO_SAFETENSORS = {np.dtype(v): k for k, v in _SAFETENSORS_DTYPES.items()}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file, in host memory (`write_safetensors`' reverse)."""
    header, data_start = read_safetensors_header(path)
    with open(path, "rb") as f:
        return {name: _read_tensor(f, name, info, data_start) for name, info in header.items()}


def write_safetensors(path: str, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Write host arrays (bfloat16 included, via ml_dtypes) as one safetensors file."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, arr in tensors.items():
        dt = np.dtype(arr.dtype)
        if dt not in _NUMPY_TO_SAFETENSORS:
            raise ValueError(f"tensor {name!r}: dtype {dt} cannot be written to safetensors")
        header[name] = {"dtype": _NUMPY_TO_SAFETENSORS[dt], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())

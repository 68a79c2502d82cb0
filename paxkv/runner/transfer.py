"""One host-to-device and one device-to-host transfer per engine step.

A step's inputs are about fifteen small int32/float32 arrays (token ids, positions, slots,
block tables, sampling parameters) and its outputs four (tokens, logprobs, top-k ids and
logprobs). Sent one by one, each costs a separate transfer with its own fixed latency; on an
H200 that overhead was larger than the whole device step of a one-sequence decode. Here they
travel as one int32 buffer (float32 arrays reinterpreted bit for bit, not converted) and are
cut apart again on the other side with static offsets, so nothing is recompiled.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# (shape, dtype name) of every array in a packed buffer, in order: a static jit argument.
Spec = tuple[tuple[tuple[int, ...], str], ...]

# The packable dtypes by name; a dict lookup, because `str(dtype)` of ~27 arrays took a tenth
# of a millisecond of every step.
_NAMES = {np.dtype(np.int32): "int32", np.dtype(np.float32): "float32"}


def spec_of(arrays: Sequence[np.ndarray | jax.Array]) -> Spec:
    """The static description of `arrays` (each int32 or float32)."""
    names = _NAMES
    spec = tuple((a.shape, names.get(a.dtype)) for a in arrays)
    for i, (_, name) in enumerate(spec):
        if name is None:
            raise ValueError(f"array {i} has dtype {arrays[i].dtype}; only int32 and float32 are packed")
    return spec


def pack_host(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, Spec]:
    """Host arrays -> (one flat int32 buffer, spec)."""
    spec = spec_of(arrays)
    parts = [np.ascontiguousarray(a).reshape(-1).view(np.int32) for a in arrays]
    return (np.concatenate(parts) if parts else np.zeros(0, np.int32)), spec


def unpack_device(buf: jax.Array, spec: Spec) -> list[jax.Array]:
    """Inside a jitted function: the packed buffer -> the arrays of `spec`."""
    out, start = [], 0
    for shape, dtype in spec:
        size = int(np.prod(shape, dtype=np.int64))
        x = jax.lax.slice_in_dim(buf, start, start + size).reshape(shape)
        if dtype == "float32":
            x = jax.lax.bitcast_convert_type(x, jnp.float32)
        out.append(x)
        start += size
    return out


def pack_device(arrays: Sequence[jax.Array]) -> jax.Array:
    """Inside a jitted function: int32/float32 arrays -> one flat int32 buffer."""
    spec_of(arrays)
    parts = [(jax.lax.bitcast_convert_type(a, jnp.int32) if a.dtype == jnp.float32 else a).reshape(-1)
             for a in arrays]
    return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.int32)


def unpack_host(buf: np.ndarray, spec: Spec) -> list[np.ndarray]:
    """A fetched buffer -> numpy views of the arrays of `spec` (no copies)."""
    out, start = [], 0
    for shape, dtype in spec:
        size = math.prod(shape)     # not np.prod: a few microseconds per array, every step
        out.append(buf[start:start + size].view(np.dtype(dtype)).reshape(shape))
        start += size
    return out

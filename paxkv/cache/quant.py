"""KV-cache quantization: 8-bit pages (fp8 e4m3 / e5m2, int8) with one scale per token and head.

A quantized pool stores each token's K (and V) row of one KV head, `head_dim` values, as
8-bit codes `q` plus one scale `s`, so that `x ~= q * s`. The scale is the row's absolute
maximum over the largest code (`amax / qmax`): every row uses the format's whole range, and
a row's scale is fixed the moment the token is written, so the write is a single fused
quantize-and-scatter and no block ever needs requantizing when later tokens arrive.
(results/kv_quant.md compares this against per-block and per-layer scales.)

Scales are stored in bfloat16: they cost 2 bytes per (token, head) against `head_dim` bytes
of codes (1.6% at head_dim 128). The codes are computed against the *stored* (rounded)
scale, rounded up so the largest element never clips, so bf16 scales lose nothing against
float32 ones.

Names (`kv_cache_dtype`): "auto" (the model's dtype), "bfloat16", "float32", "fp8" (=
"fp8_e4m3", `float8_e4m3fn`, max 448), "fp8_e5m2" (`float8_e5m2`, max 57344), "int8"
(symmetric, codes -127..127).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from paxkv.config import KV_CACHE_DTYPES

_STORAGE = {
    "bfloat16": jnp.bfloat16,
    "float32": jnp.float32,
    "fp8": jnp.float8_e4m3fn,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
    "int8": jnp.int8,
}

# Largest code of each quantized storage dtype (int8 is kept symmetric: -127..127).
_QMAX = {
    jnp.dtype(jnp.float8_e4m3fn): 448.0,
    jnp.dtype(jnp.float8_e5m2): 57344.0,
    jnp.dtype(jnp.int8): 127.0,
}

SCALE_DTYPE = jnp.bfloat16


def storage_dtype(kv_cache_dtype: str, model_dtype: Any = jnp.bfloat16) -> jnp.dtype:
    """The dtype pages are stored in for a `kv_cache_dtype` name ("auto" -> `model_dtype`)."""
    if kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    if kv_cache_dtype not in _STORAGE:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return jnp.dtype(_STORAGE[kv_cache_dtype])


def is_quantized(dtype: Any) -> bool:
    """True for the 8-bit storage dtypes that need scales."""
    return jnp.dtype(dtype) in _QMAX


def qmax(dtype: Any) -> float:
    """Largest code magnitude of a quantized storage dtype."""
    dtype = jnp.dtype(dtype)
    if dtype not in _QMAX:
        raise ValueError(f"dtype {dtype} is not a quantized KV dtype ({sorted(map(str, _QMAX))})")
    return _QMAX[dtype]


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: Any,
                    scale_dtype: Any = SCALE_DTYPE) -> tuple[int, int]:
    """(page bytes, scale bytes) one token costs over all layers, K and V."""
    rows = 2 * num_layers * num_kv_heads
    dtype = jnp.dtype(dtype)
    scales = rows * jnp.dtype(scale_dtype).itemsize if is_quantized(dtype) else 0
    return rows * head_dim * dtype.itemsize, scales


def quantize(x: jax.Array, dtype: Any, scale_dtype: Any = SCALE_DTYPE
             ) -> tuple[jax.Array, jax.Array]:
    """`x [..., d]` -> (codes `[..., d]` in `dtype`, scales `[...]` in `scale_dtype`).

    One scale per row (the last axis is reduced): `x ~= codes * scale`. All-zero rows get
    scale 0 and codes 0.
    """
    dtype = jnp.dtype(dtype)
    top = qmax(dtype)
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = (amax / top).astype(scale_dtype)
    # Round the stored scale up (one ulp) where rounding went down, so |x| / scale <= qmax.
    scale = jnp.where(scale.astype(jnp.float32) * top < amax,
                      jnp.nextafter(scale, jnp.asarray(jnp.inf, scale.dtype)), scale)
    s = scale.astype(jnp.float32)[..., None]
    y = jnp.clip(xf / jnp.where(s > 0, s, 1.0), -top, top)   # clip: float division slack
    if dtype == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype), scale


def dequantize(codes: jax.Array, scale: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """Inverse of `quantize`: `codes [..., d] * scale [...]` in `dtype`."""
    return (codes.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)

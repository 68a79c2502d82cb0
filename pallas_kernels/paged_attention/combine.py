"""The split-K combine of decode attention as one kernel.

Split-K decode writes, per sequence, split and query head, a normalized partial output and
its base-2 log-sum-exp; the combine rescales the partials by `exp2(lse - max lse)` and
averages them. Written in jnp (`combine_splits`), XLA runs it as three small kernels per
layer (the weights, their sum with the products, the cast); at one stream, where each kernel
costs more in launch than in bytes, that was three of the fifteen kernels of a layer. Here it
is one program per (sequence, query head), the splits unrolled, so it is one launch.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def combine_splits(o_part: jax.Array, lse: jax.Array) -> jax.Array:
    """Merge split partials `[B, S, Hq, d]` (normalized) with base-2 LSEs `[B, S, Hq]` (jnp)."""
    mx = jnp.max(lse, axis=1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.exp2(lse - mx)                              # empty splits: exp2(-inf) = 0
    den = jnp.sum(w, axis=1)
    num = jnp.sum(o_part * w[..., None], axis=1)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


def _combine_kernel(lse_ref, o_ref, out_ref, *, num_splits: int):
    h = pl.program_id(1)
    lses = [lse_ref[i, h] for i in range(num_splits)]
    mx = functools.reduce(jnp.maximum, lses)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    num = None
    den = None
    for i in range(num_splits):
        w = jnp.exp2(lses[i] - mx)                      # empty splits: exp2(-inf) = 0
        part = o_ref[i, :] * w
        num = part if num is None else num + part
        den = w if den is None else den + w
    out_ref[...] = (num / jnp.where(den > 0, den, 1.0)).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def combine_splits_kernel(o_part: jax.Array, lse: jax.Array, *, out_dtype=None,
                          interpret: bool = False) -> jax.Array:
    """`combine_splits` as one Pallas launch, output in `out_dtype` (default float32).

    `head_dim` must be a power of two (a Triton block); the split count may be anything.
    """
    batch, num_splits, num_heads, head_dim = o_part.shape
    if lse.shape != (batch, num_splits, num_heads):
        raise ValueError(f"lse must be {(batch, num_splits, num_heads)}, got {lse.shape}")
    out_dtype = jnp.dtype(out_dtype or jnp.float32)
    return pl.pallas_call(
        functools.partial(_combine_kernel, num_splits=num_splits),
        grid=(batch, num_heads),
        in_specs=[pl.BlockSpec((None, num_splits, num_heads), lambda b, h: (b, 0, 0)),
                  pl.BlockSpec((None, num_splits, None, head_dim), lambda b, h: (b, 0, h, 0))],
        out_specs=pl.BlockSpec((None, None, head_dim), lambda b, h: (b, h, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, num_heads, head_dim), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name=f"paxkv_combine_splits_s{num_splits}",
    )(lse, o_part)

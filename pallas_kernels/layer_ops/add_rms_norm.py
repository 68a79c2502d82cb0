"""Residual add fused with RMSNorm: `(x + residual, rms_norm(x + residual) * scale)` in one pass.

A Llama layer adds each sublayer's output to the residual stream and normalizes the sum for
the next sublayer. XLA runs the add and the norm as two kernels (the sum is read by three
consumers, so it is not fused into the norm); vLLM's `fused_add_rms_norm` is one. The sum is
rounded to the activation dtype before it is normalized, as the unfused network does.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention.paging import is_power_of_two, resolve_num_warps


def add_rms_norm_reference(x: jax.Array, residual: jax.Array | None, scale: jax.Array,
                           eps: float, unit_offset: bool = False) -> tuple[jax.Array, jax.Array]:
    """-> (the new residual `x + residual` in x's dtype, its RMSNorm times `scale` in scale's
    dtype). `unit_offset`: the gain is `1 + scale`, added in float32 (Gemma's norms)."""
    total = x if residual is None else (x + residual).astype(x.dtype)
    tf = total.astype(jnp.float32)
    normed = tf * jax.lax.rsqrt(jnp.mean(tf * tf, axis=-1, keepdims=True) + eps)
    return total, (normed * _gain(scale, unit_offset)).astype(scale.dtype)


def _gain(scale: jax.Array, unit_offset: bool) -> jax.Array:
    gain = scale.astype(jnp.float32)
    return gain + 1.0 if unit_offset else gain


def _kernel(*refs, eps: float, has_residual: bool, unit_offset: bool):
    if has_residual:
        x_ref, r_ref, scale_ref, total_ref, normed_ref = refs
        total = (x_ref[...].astype(jnp.float32) + r_ref[...].astype(jnp.float32)).astype(total_ref.dtype)
        total_ref[...] = total
    else:
        x_ref, scale_ref, normed_ref = refs
        total = x_ref[...]
    tf = total.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.sum(tf * tf) / tf.shape[0] + eps)
    normed_ref[...] = (tf * inv * _gain(scale_ref[...], unit_offset)).astype(normed_ref.dtype)


def supported(hidden: int) -> bool:
    """The kernel holds a row as one Triton block: its width must be a power of two."""
    return is_power_of_two(hidden)


def default_num_warps(hidden: int) -> int:
    """Warps per program (one row): 4 from 1024 columns up, else 1."""
    return 4 if hidden >= 1024 else 1


@functools.partial(jax.jit, static_argnames=("eps", "unit_offset", "interpret", "num_warps"))
def add_rms_norm(x: jax.Array, residual: jax.Array | None, scale: jax.Array, *, eps: float,
                 unit_offset: bool = False, interpret: bool = False,
                 num_warps: int | None = None) -> tuple[jax.Array, jax.Array]:
    """`add_rms_norm_reference` as one Pallas launch (one program per row).

    x, residual: `[..., hidden]` (residual None: no add, the new residual is x itself);
    scale: `[hidden]`. The hidden width must be a power of two (`supported`). `num_warps`
    None: `default_num_warps`.
    """
    hidden = x.shape[-1]
    if not supported(hidden):
        raise ValueError(f"add_rms_norm: hidden width {hidden} is not a power of two")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual {residual.shape} != x {x.shape}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, hidden)
    n = rows.shape[0]
    row_spec = pl.BlockSpec((None, hidden), lambda i: (i, 0))
    args = [rows] if residual is None else [rows, residual.reshape(-1, hidden)]
    in_specs = [row_spec] * len(args) + [pl.BlockSpec((hidden,), lambda i: (0,))]
    normed_shape = jax.ShapeDtypeStruct((n, hidden), scale.dtype)
    if residual is None:
        out_shape, out_specs = normed_shape, row_spec
    else:
        out_shape = (jax.ShapeDtypeStruct((n, hidden), x.dtype), normed_shape)
        out_specs = (row_spec, row_spec)
    out = pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), has_residual=residual is not None,
                          unit_offset=unit_offset),
        grid=(n,), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(
            num_warps=resolve_num_warps(num_warps, default_num_warps(hidden)),
            num_stages=1),
        interpret=interpret, name="paxkv_add_rms_norm",
    )(*args, scale)
    if residual is None:
        return x, out.reshape(*lead, hidden)
    total, normed = out
    return total.reshape(*lead, hidden), normed.reshape(*lead, hidden)

"""Residual add fused with RMSNorm: `(x + residual, rms_norm(x + residual) * scale)` in one pass.

A Llama layer adds each sublayer's output to the residual stream and normalizes the sum for
the next sublayer. XLA runs the add and the norm as two kernels (the sum is read by three
consumers, so it is not fused into the norm); vLLM's `fused_add_rms_norm` is one. The sum is
rounded to the activation dtype before it is normalized, as the unfused network does.

`x` may also come as the float32 partial sums of a split-K matmul (`partial_sums`,
`[splits, ..., hidden]`, the model's thin steps: `paxkv.model.split_k`): the kernel adds
them up and rounds them to the residual's dtype first, so the matmul needs no reduction
launch of its own and the result is the one the rounded matmul output would give.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention.paging import is_power_of_two


def add_rms_norm_reference(x: jax.Array, residual: jax.Array | None, scale: jax.Array,
                           eps: float) -> tuple[jax.Array, jax.Array]:
    """-> (the new residual `x + residual` in x's dtype, its RMSNorm times `scale` in scale's dtype)."""
    total = x if residual is None else (x + residual).astype(x.dtype)
    tf = total.astype(jnp.float32)
    normed = tf * jax.lax.rsqrt(jnp.mean(tf * tf, axis=-1, keepdims=True) + eps)
    return total, (normed * scale.astype(jnp.float32)).astype(scale.dtype)


def add_rms_norm_partials_reference(partials: jax.Array, residual: jax.Array, scale: jax.Array,
                                    eps: float) -> tuple[jax.Array, jax.Array]:
    """`add_rms_norm_reference` of the summed partials, rounded to the residual's dtype."""
    x = jnp.sum(partials.astype(jnp.float32), axis=0).astype(residual.dtype)
    return add_rms_norm_reference(x, residual, scale, eps)


def _kernel(*refs, eps: float, has_residual: bool, splits: int):
    if has_residual:
        x_ref, r_ref, scale_ref, total_ref, normed_ref = refs
        if splits:   # x_ref [splits, hidden]: add the partial sums, one row at a time
            x = x_ref[0].astype(jnp.float32)
            for s in range(1, splits):
                x = x + x_ref[s].astype(jnp.float32)
            x = x.astype(total_ref.dtype)
        else:
            x = x_ref[...]
        total = (x.astype(jnp.float32) + r_ref[...].astype(jnp.float32)).astype(total_ref.dtype)
        total_ref[...] = total
    else:
        x_ref, scale_ref, normed_ref = refs
        total = x_ref[...]
    tf = total.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.sum(tf * tf) / tf.shape[0] + eps)
    normed_ref[...] = (tf * inv * scale_ref[...].astype(jnp.float32)).astype(normed_ref.dtype)


def supported(hidden: int) -> bool:
    """The kernel holds a row as one Triton block: its width must be a power of two."""
    return is_power_of_two(hidden)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "partial_sums"))
def add_rms_norm(x: jax.Array, residual: jax.Array | None, scale: jax.Array, *, eps: float,
                 interpret: bool = False, partial_sums: bool = False) -> tuple[jax.Array, jax.Array]:
    """`add_rms_norm_reference` as one Pallas launch (one program per row).

    x, residual: `[..., hidden]` (residual None: no add, the new residual is x itself);
    scale: `[hidden]`. The hidden width must be a power of two (`supported`). With
    `partial_sums` x is `[splits, ..., hidden]`, partial sums that add up to the x to use
    (`add_rms_norm_partials_reference`), and a residual is required; the new residual then
    has the residual's dtype.
    """
    hidden = x.shape[-1]
    if not supported(hidden):
        raise ValueError(f"add_rms_norm: hidden width {hidden} is not a power of two")
    if partial_sums and residual is None:
        raise ValueError("add_rms_norm: partial sums need a residual to add them to")
    x_shape = x.shape[1:] if partial_sums else x.shape
    if residual is not None and residual.shape != x_shape:
        raise ValueError(f"add_rms_norm: residual {residual.shape} != x {x_shape}")
    lead = x_shape[:-1]
    splits = x.shape[0] if partial_sums else 0
    row_spec = pl.BlockSpec((None, hidden), lambda i: (i, 0))
    if partial_sums:
        rows = x.reshape(splits, -1, hidden)
        x_spec = pl.BlockSpec((splits, None, hidden), lambda i: (0, i, 0))
    else:
        rows = x.reshape(-1, hidden)
        x_spec = row_spec
    n = math.prod(lead)
    args = [rows] if residual is None else [rows, residual.reshape(-1, hidden)]
    in_specs = [x_spec, row_spec][:len(args)] + [pl.BlockSpec((hidden,), lambda i: (0,))]
    normed_shape = jax.ShapeDtypeStruct((n, hidden), scale.dtype)
    if residual is None:
        out_shape, out_specs = normed_shape, row_spec
    else:
        total_dtype = residual.dtype if partial_sums else x.dtype
        out_shape = (jax.ShapeDtypeStruct((n, hidden), total_dtype), normed_shape)
        out_specs = (row_spec, row_spec)
    out = pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), has_residual=residual is not None,
                          splits=splits),
        grid=(n,), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4 if hidden >= 1024 else 1, num_stages=1),
        interpret=interpret, name="paxkv_add_rms_norm",
    )(*args, scale)
    if residual is None:
        return x, out.reshape(*lead, hidden)
    total, normed = out
    return total.reshape(*lead, hidden), normed.reshape(*lead, hidden)

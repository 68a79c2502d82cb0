"""`rope_kv_write` for 8-bit pools: rotate q and k, quantize k and v per (token, head) row, store
codes and scales, in one pass.

Unfused, an 8-bit pool's write is the jnp RoPE plus `paxkv.cache.kv_pool.write_layer_quantized`
(quantize, then four scatters): on an H100 about 2 ms of an FP8 decode step over 32 layers at
long context, most of what the FP8 attention kernel saves. Here one program per token does it
all: the rotation as `rope_kv_write`'s, then bit for bit what `paxkv.cache.quant.quantize` does
to the rotated k (in the qkv dtype) and to v. Three steps of that definition have no exact
Triton form, so they are spelled out:

- `nextafter` on the bf16 scale: on scales (never negative) one ulp up is +1 on the bf16 bit
  pattern, i.e. `+ 1 << 16` on the float32 one.
- `jnp.round` (int8) has no Triton lowering: round half to even from `floor`, exactly.
- float32 division lowers to Triton's approximate `div.full.f32`: compiled, the codes divide
  by the scale with `div.rn.f32` (IEEE division, what LLVM emits for XLA's GPU `fdiv`);
  interpreted, plain `/`, the same XLA op as the jnp path's on the host (where XLA divides
  by multiplying with the reciprocal). The scale's own `amax / qmax` is written as the
  product `amax * (1 / qmax)`: XLA's algebraic simplifier rewrites a division by a constant
  into exactly that, so the jnp path computes it too.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.layer_ops.rope_kv_write import (_rotate, default_num_warps,
                                                    rotate_token_q, split_heads, supported)
from pallas_kernels.paged_attention.paging import resolve_num_warps
from paxkv.cache import kv_pool, quant

# One ulp of a scale dtype, counted on the float32 bit pattern of its values.
_SCALE_ULP_BITS = {jnp.dtype(jnp.bfloat16): 1 << 16, jnp.dtype(jnp.float32): 1}


def rope_kv_write_quantized_reference(
        qkv: jax.Array, cos: jax.Array, sin: jax.Array, slot_mapping: jax.Array,
        k_pages: jax.Array, v_pages: jax.Array, k_scale: jax.Array, v_scale: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """-> (rotated q, k_pages, v_pages, k_scale, v_scale): the jnp path (`_rotate`, then
    `kv_pool.write_layer_quantized`, which quantizes with `quant.quantize`)."""
    q, k, v = split_heads(qkv, k_pages.shape[2])
    pages = kv_pool.write_layer_quantized(k_pages, v_pages, k_scale, v_scale,
                                          _rotate(k, cos, sin), v, slot_mapping)
    return (_rotate(q, cos, sin), *pages)


def _divide(x: jax.Array, y: jax.Array, *, interpret: bool) -> jax.Array:
    """x / y (float32, same shapes), correctly rounded when compiled (see the module's doc)."""
    if interpret:
        return x / y
    return plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[x, y], constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]


def _round_half_even(y: jax.Array) -> jax.Array:
    """`jnp.round` of float32 `|y| <= 127` from `floor` (y - floor(y) is exact there)."""
    r = jnp.floor(y)
    frac = y - r
    odd = r * 0.5 != jnp.floor(r * 0.5)
    return jnp.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)


def _quantize(parts, *, top: float, to_int: bool, ulp_bits: int, scale_dtype, interpret: bool):
    """`quant.quantize` of rows split into column blocks (`parts`, float32 `[rows, w]` each) ->
    (codes per part, float32, not yet cast; scale `[rows]` float32, a `scale_dtype` value)."""
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(p), axis=1) for p in parts])
    scale = (amax * float(np.float32(1) / np.float32(top))).astype(scale_dtype)
    scale = scale.astype(jnp.float32)
    bumped = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(scale, jnp.int32) + ulp_bits, jnp.float32)
    scale = jnp.where(scale * top < amax, bumped, scale)
    divisor = jnp.where(scale > 0, scale, 1.0)[:, None]
    codes = []
    for p in parts:
        y = jnp.clip(_divide(p, jnp.broadcast_to(divisor, p.shape), interpret=interpret),
                     -top, top)
        codes.append(_round_half_even(y) if to_int else y)
    return codes, scale


def _kernel(slot_ref, cos_ref, sin_ref, qkv_ref, _k_pages_in, _v_pages_in, _k_scale_in,
            _v_scale_in, q_out_ref, k_pages_ref, v_pages_ref, k_scale_ref, v_scale_ref, *,
            q_heads: int, kv_heads: int, half: int, num_slots: int, top: float, ulp_bits: int,
            interpret: bool):
    t = pl.program_id(0)
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    rotated = rotate_token_q(cos_ref, sin_ref, qkv_ref, q_out_ref, q_heads, half)
    slot = slot_ref[t]
    quantize = functools.partial(
        _quantize, top=top, to_int=jnp.issubdtype(k_pages_ref.dtype, jnp.integer),
        ulp_bits=ulp_bits, scale_dtype=k_scale_ref.dtype, interpret=interpret)

    @pl.when((slot >= 0) & (slot < num_slots))
    def _():
        k1, k2 = rotated(q_heads, kv_heads)
        (c1, c2), k_scale = quantize([k1.astype(jnp.float32), k2.astype(jnp.float32)])
        k_pages_ref[slot, :, lo] = c1.astype(k_pages_ref.dtype)
        k_pages_ref[slot, :, hi] = c2.astype(k_pages_ref.dtype)
        k_scale_ref[slot, :] = k_scale.astype(k_scale_ref.dtype)
        v = qkv_ref[pl.ds(q_heads + kv_heads, kv_heads), :].astype(jnp.float32)
        (cv,), v_scale = quantize([v])
        v_pages_ref[slot] = cv.astype(v_pages_ref.dtype)
        v_scale_ref[slot, :] = v_scale.astype(v_scale_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def rope_kv_write_quantized(qkv: jax.Array, cos: jax.Array, sin: jax.Array,
                            slot_mapping: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                            k_scale: jax.Array, v_scale: jax.Array, *, interpret: bool = False,
                            num_warps: int | None = None
                            ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """`rope_kv_write_quantized_reference` as one Pallas launch (one program per token): ->
    (rotated q `[T, Hq, d]`, k_pages, v_pages, k_scale, v_scale).

    As `rope_kv_write`, for one layer of an 8-bit pool: pages `[num_blocks, block_size, Hkv,
    d]` in a `quant` storage dtype (fp8 e4m3 / e5m2, int8) and their scales `[num_blocks,
    block_size, Hkv]` (bfloat16 or float32), all four aliased to the outputs (in place under a
    donated jit); slots outside the pool are not written.
    """
    t, heads, d = qkv.shape
    nb, bs, hkv, page_d = k_pages.shape
    hq = heads - 2 * hkv
    if page_d != d or hq < 1:
        raise ValueError(f"rope_kv_write_quantized: qkv {qkv.shape} does not hold q heads and "
                         f"the {hkv} k and v heads of dim {page_d} of the pages")
    if not supported(hq, hkv, d):
        raise ValueError(f"rope_kv_write_quantized: heads {hq}/{hkv} and head_dim {d} must be "
                         "powers of two")
    if (not quant.is_quantized(k_pages.dtype) or v_pages.dtype != k_pages.dtype
            or v_pages.shape != k_pages.shape):
        raise ValueError(f"rope_kv_write_quantized: pages must share one 8-bit dtype and shape, "
                         f"got {k_pages.dtype} {k_pages.shape} and {v_pages.dtype} "
                         f"{v_pages.shape}")
    scale_dtype = jnp.dtype(k_scale.dtype)
    if (k_scale.shape != (nb, bs, hkv) or v_scale.shape != (nb, bs, hkv)
            or v_scale.dtype != scale_dtype or scale_dtype not in _SCALE_ULP_BITS):
        raise ValueError(f"rope_kv_write_quantized: k_scale/v_scale must be {(nb, bs, hkv)} "
                         f"bfloat16 or float32, got {k_scale.dtype} {k_scale.shape} and "
                         f"{v_scale.dtype} {v_scale.shape}")
    half = d // 2
    num_slots = nb * bs
    pages_spec = pl.BlockSpec((num_slots, hkv, d), lambda i: (0, 0, 0))
    scale_spec = pl.BlockSpec((num_slots, hkv), lambda i: (0, 0))
    q_out, k_flat, v_flat, ks_flat, vs_flat = pl.pallas_call(
        functools.partial(_kernel, q_heads=hq, kv_heads=hkv, half=half, num_slots=num_slots,
                          top=quant.qmax(k_pages.dtype), ulp_bits=_SCALE_ULP_BITS[scale_dtype],
                          interpret=interpret),
        grid=(t,),
        in_specs=[pl.BlockSpec((t,), lambda i: (0,)),
                  pl.BlockSpec((None, half), lambda i: (i, 0)),
                  pl.BlockSpec((None, half), lambda i: (i, 0)),
                  pl.BlockSpec((None, heads, d), lambda i: (i, 0, 0)),
                  pages_spec, pages_spec, scale_spec, scale_spec],
        out_specs=[pl.BlockSpec((None, hq, d), lambda i: (i, 0, 0)), pages_spec, pages_spec,
                   scale_spec, scale_spec],
        out_shape=[jax.ShapeDtypeStruct((t, hq, d), qkv.dtype),
                   jax.ShapeDtypeStruct((num_slots, hkv, d), k_pages.dtype),
                   jax.ShapeDtypeStruct((num_slots, hkv, d), v_pages.dtype),
                   jax.ShapeDtypeStruct((num_slots, hkv), scale_dtype),
                   jax.ShapeDtypeStruct((num_slots, hkv), scale_dtype)],
        input_output_aliases={4: 1, 5: 2, 6: 3, 7: 4},
        compiler_params=plgpu.CompilerParams(
            num_warps=resolve_num_warps(num_warps, default_num_warps(hq, d)),
            num_stages=1),
        interpret=interpret, name="paxkv_rope_kv_write_quantized",
    )(slot_mapping.astype(jnp.int32), cos.astype(jnp.float32), sin.astype(jnp.float32), qkv,
      k_pages.reshape(num_slots, hkv, d), v_pages.reshape(num_slots, hkv, d),
      k_scale.reshape(num_slots, hkv), v_scale.reshape(num_slots, hkv))
    return (q_out, k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape),
            ks_flat.reshape(k_scale.shape), vs_flat.reshape(v_scale.shape))

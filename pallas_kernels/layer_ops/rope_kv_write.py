"""RoPE fused with the KV-page write: rotate q and k, store k and v at their slots, in one pass.

Unfused, XLA runs the query's rotation, the key's rotation with its scatter into the pages,
and the value's scatter as three kernels per layer (vLLM's `rotary_embedding` and
`reshape_and_cache` are two). Here one program per token reads its heads straight from the
fused q/k/v projection's output (`[T, Hq + 2 Hkv, d]`: q heads, then k, then v, as
`paxkv.model.fusion` lays the columns out; separate q, k, v operands would each be
materialized by a copy first), rotates its query and key heads, and writes its key and value
into the page pool in place (the pages are aliased to the output, so nothing else of the
pool is touched). Rotation as `paxkv.model.rope.apply_rope`: float32 math, "rotate half"
layout, results rounded to the input dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention.paging import is_power_of_two, resolve_num_warps

def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[..., None, :], sin[..., None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def split_heads(qkv: jax.Array, kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Packed `[..., Hq + 2 Hkv, d]` -> q `[..., Hq, d]`, k and v `[..., Hkv, d]`."""
    q_heads = qkv.shape[-2] - 2 * kv_heads
    return (qkv[..., :q_heads, :], qkv[..., q_heads:q_heads + kv_heads, :],
            qkv[..., q_heads + kv_heads:, :])


def rope_kv_write_reference(qkv, cos, sin, slot_mapping, k_pages, v_pages):
    """-> (rotated q, k_pages, v_pages with the rotated k and v at `slot_mapping`) (jnp)."""
    nb, bs, h, d = k_pages.shape
    q, k, v = split_heads(qkv, h)
    k_rot = _rotate(k, cos, sin)
    flat_k = k_pages.reshape(nb * bs, h, d).at[slot_mapping].set(k_rot.astype(k_pages.dtype))
    flat_v = v_pages.reshape(nb * bs, h, d).at[slot_mapping].set(v.astype(v_pages.dtype))
    return _rotate(q, cos, sin), flat_k.reshape(k_pages.shape), flat_v.reshape(v_pages.shape)


def supported(q_heads: int, kv_heads: int, head_dim: int) -> bool:
    """Heads and half the head dimension are Triton blocks: powers of two."""
    return (is_power_of_two(q_heads) and is_power_of_two(kv_heads)
            and head_dim >= 4 and is_power_of_two(head_dim))


def rotate_token_q(cos_ref, sin_ref, qkv_ref, q_out_ref, q_heads: int, half: int):
    """In a program of one token: rotate its `q_heads` query heads into `q_out_ref`; ->
    `rotated(first, heads)`, the rotated (first half, second half) of another run of its
    heads (its keys), in the qkv dtype. Shared by the plain and the 8-bit write kernels."""
    c = cos_ref[...][None, :]
    s = sin_ref[...][None, :]
    lo, hi = pl.ds(0, half), pl.ds(half, half)

    def rotated(first: int, heads: int):
        rows = pl.ds(first, heads)
        x1 = qkv_ref[rows, lo].astype(jnp.float32)
        x2 = qkv_ref[rows, hi].astype(jnp.float32)
        return ((x1 * c - x2 * s).astype(qkv_ref.dtype),
                (x2 * c + x1 * s).astype(qkv_ref.dtype))

    q1, q2 = rotated(0, q_heads)
    q_out_ref[:, lo] = q1
    q_out_ref[:, hi] = q2
    return rotated


def _kernel(slot_ref, cos_ref, sin_ref, qkv_ref, _k_pages_in, _v_pages_in,
            q_out_ref, k_pages_ref, v_pages_ref, *, q_heads: int, kv_heads: int, half: int,
            num_slots: int):
    t = pl.program_id(0)
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    rotated = rotate_token_q(cos_ref, sin_ref, qkv_ref, q_out_ref, q_heads, half)
    k1, k2 = rotated(q_heads, kv_heads)
    slot = slot_ref[t]

    @pl.when((slot >= 0) & (slot < num_slots))
    def _():
        k_pages_ref[slot, :, lo] = k1.astype(k_pages_ref.dtype)
        k_pages_ref[slot, :, hi] = k2.astype(k_pages_ref.dtype)
        v = qkv_ref[pl.ds(q_heads + kv_heads, kv_heads), :]
        v_pages_ref[slot] = v.astype(v_pages_ref.dtype)


def default_num_warps(q_heads: int, head_dim: int) -> int:
    """Warps per program (one token): 4 once the query heads hold 2048 values, else 1."""
    return 4 if q_heads * head_dim >= 2048 else 1


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def rope_kv_write(qkv: jax.Array, cos: jax.Array, sin: jax.Array, slot_mapping: jax.Array,
                  k_pages: jax.Array, v_pages: jax.Array, *, interpret: bool = False,
                  num_warps: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`rope_kv_write_reference` as one Pallas launch (one program per token): -> (rotated q
    `[T, Hq, d]`, k_pages, v_pages).

    qkv `[T, Hq + 2 Hkv, d]` (q heads, k heads, v heads; Hkv from the pages), cos and sin
    `[T, d // 2]` float32, slot_mapping
    int32 `[T]` (`block * block_size + offset`; slots outside the pool are not written), one
    layer's unquantized pages `[num_blocks, block_size, Hkv, d]` (aliased to the outputs: inside
    a jitted step whose pool is donated they are updated in place). `num_warps` None:
    `default_num_warps`.
    """
    t, heads, d = qkv.shape
    nb, bs, hkv, page_d = k_pages.shape
    hq = heads - 2 * hkv
    if page_d != d or hq < 1:
        raise ValueError(f"rope_kv_write: qkv {qkv.shape} does not hold q heads and the {hkv} "
                         f"k and v heads of dim {page_d} of the pages")
    if not supported(hq, hkv, d):
        raise ValueError(f"rope_kv_write: heads {hq}/{hkv} and head_dim {d} must be powers of two")
    half = d // 2
    num_slots = nb * bs
    pages_spec = pl.BlockSpec((num_slots, hkv, d), lambda i: (0, 0, 0))
    q_out, k_flat, v_flat = pl.pallas_call(
        functools.partial(_kernel, q_heads=hq, kv_heads=hkv, half=half, num_slots=num_slots),
        grid=(t,),
        in_specs=[pl.BlockSpec((t,), lambda i: (0,)),
                  pl.BlockSpec((None, half), lambda i: (i, 0)),
                  pl.BlockSpec((None, half), lambda i: (i, 0)),
                  pl.BlockSpec((None, heads, d), lambda i: (i, 0, 0)),
                  pages_spec, pages_spec],
        out_specs=[pl.BlockSpec((None, hq, d), lambda i: (i, 0, 0)), pages_spec, pages_spec],
        out_shape=[jax.ShapeDtypeStruct((t, hq, d), qkv.dtype),
                   jax.ShapeDtypeStruct((num_slots, hkv, d), k_pages.dtype),
                   jax.ShapeDtypeStruct((num_slots, hkv, d), v_pages.dtype)],
        input_output_aliases={4: 1, 5: 2},
        compiler_params=plgpu.CompilerParams(
            num_warps=resolve_num_warps(num_warps, default_num_warps(hq, d)),
            num_stages=1),
        interpret=interpret, name="paxkv_rope_kv_write",
    )(slot_mapping.astype(jnp.int32), cos.astype(jnp.float32), sin.astype(jnp.float32), qkv,
      k_pages.reshape(num_slots, hkv, d), v_pages.reshape(num_slots, hkv, d))
    return q_out, k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape)

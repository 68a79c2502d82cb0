"""The small fused kernels of the GPU path (interpret mode on CPU, compiled on a GPU) against their jnp references,
on fresh random inputs: residual add + RMSNorm, RoPE + KV-page write (slots mid-block, padding
slots outside the pool), and the split-K combine of decode attention (empty splits, split
counts that are not powers of two)."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels.layer_ops import (add_rms_norm, add_rms_norm_reference, rope_kv_write,
                                      rope_kv_write_reference)
from pallas_kernels.paged_attention import combine_splits, combine_splits_kernel
from quick_subset import first_quick


def _f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("lead", first_quick([[1], [7], [2, 3]]))
def test_add_rms_norm_kernel_matches_reference(dtype, with_residual, lead, interpret):
    rng = np.random.default_rng(len(lead) * 10 + lead[-1])
    hidden = 256
    x = jnp.asarray(rng.standard_normal((*lead, hidden)) * 3, dtype)
    res = jnp.asarray(rng.standard_normal((*lead, hidden)), dtype) if with_residual else None
    scale = jnp.asarray(rng.standard_normal(hidden), dtype)
    total, normed = add_rms_norm(x, res, scale, eps=1e-5, interpret=interpret)
    want_total, want_normed = add_rms_norm_reference(x, res, scale, 1e-5)
    assert total.dtype == x.dtype and normed.dtype == scale.dtype
    assert total.shape == x.shape and normed.shape == x.shape
    np.testing.assert_array_equal(_f32(total), _f32(want_total))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2   # one bf16 rounding of the output
    np.testing.assert_allclose(_f32(normed), _f32(want_normed), rtol=tol, atol=tol)


@pytest.mark.parametrize("num_warps", first_quick([1, 8]))
def test_layer_kernels_match_reference_at_other_warp_counts(num_warps, interpret):
    """The `num_warps` tuning argument changes the launch, not the result."""
    rng = np.random.default_rng(num_warps)
    x = jnp.asarray(rng.standard_normal((3, 512)), jnp.bfloat16)
    res = jnp.asarray(rng.standard_normal((3, 512)), jnp.bfloat16)
    scale = jnp.asarray(rng.standard_normal(512), jnp.bfloat16)
    got = add_rms_norm(x, res, scale, eps=1e-5, interpret=interpret, num_warps=num_warps)
    for g, w in zip(got, add_rms_norm_reference(x, res, scale, 1e-5)):
        np.testing.assert_allclose(_f32(g), _f32(w), rtol=1e-2, atol=1e-2)
    qkv = jnp.asarray(rng.standard_normal((4, 12, 32)), jnp.bfloat16)
    angles = rng.uniform(0, 300, (4, 16)).astype(np.float32)
    slots = jnp.asarray([3, 0, 9, 14], jnp.int32)
    pages = jnp.asarray(rng.standard_normal((4, 4, 2, 32)), jnp.bfloat16)
    got = rope_kv_write(qkv, jnp.cos(angles), jnp.sin(angles), slots, pages, pages,
                        interpret=interpret, num_warps=num_warps)
    want = rope_kv_write_reference(qkv, jnp.cos(angles), jnp.sin(angles), slots, pages, pages)
    for g, w in zip(got, want):
        np.testing.assert_allclose(_f32(g), _f32(w), rtol=8e-3, atol=8e-3)


def test_add_rms_norm_kernel_rejects_widths_it_cannot_hold(interpret):
    x = jnp.ones((2, 96), jnp.float32)
    with pytest.raises(ValueError, match="power of two"):
        add_rms_norm(x, None, jnp.ones((96,), jnp.float32), eps=1e-5, interpret=interpret)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(8, 2, 32), (4, 4, 16)])
def test_rope_kv_write_kernel_matches_reference(dtype, q_heads, kv_heads, head_dim, interpret):
    rng = np.random.default_rng(q_heads * head_dim)
    tokens, num_blocks, block_size = 9, 6, 4
    qkv = jnp.asarray(rng.standard_normal((tokens, q_heads + 2 * kv_heads, head_dim)), dtype)
    angles = rng.uniform(0, 300, (tokens, head_dim // 2)).astype(np.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    slots = rng.permutation(num_blocks * block_size)[:tokens].astype(np.int32)
    slots[2] = -1                                    # outside the pool: not written
    slots[5] = num_blocks * block_size + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    v_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    got = rope_kv_write(qkv, cos, sin, jnp.asarray(slots), k_pages, v_pages, interpret=interpret)
    dropped = np.where(slots < 0, num_blocks * block_size + 1, slots)   # jnp drops these too
    want = rope_kv_write_reference(qkv, cos, sin, jnp.asarray(dropped), k_pages, v_pages)
    tol = 1e-6 if dtype == jnp.float32 else 8e-3   # fused multiply-adds; one bf16 rounding
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(_f32(g), _f32(w), rtol=tol, atol=tol)
    # the untouched slots kept their old contents; the written ones changed
    flat_old = _f32(k_pages).reshape(-1, kv_heads, head_dim)
    flat_new = _f32(got[1]).reshape(-1, kv_heads, head_dim)
    written = [s for s in slots if 0 <= s < num_blocks * block_size]
    untouched = sorted(set(range(num_blocks * block_size)) - set(written))
    np.testing.assert_array_equal(flat_new[untouched], flat_old[untouched])
    assert not np.allclose(flat_new[written], flat_old[written])
    # v is stored as it came, in the heads after q's and k's
    v_heads = _f32(qkv)[:, q_heads + kv_heads:]
    for t, s in enumerate(slots):
        if 0 <= s < num_blocks * block_size:
            np.testing.assert_array_equal(_f32(got[2]).reshape(-1, kv_heads, head_dim)[s], v_heads[t])


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_combine_kernel_matches_jnp(num_splits, interpret):
    rng = np.random.default_rng(num_splits)
    batch, heads, head_dim = 3, 8, 32
    o_part = jnp.asarray(rng.standard_normal((batch, num_splits, heads, head_dim)), jnp.float32)
    lse = rng.standard_normal((batch, num_splits, heads)).astype(np.float32) * 4
    if num_splits > 1:
        lse[:, -1] = -np.inf                        # a split past every sequence's end
    lse[1] = -np.inf                                # a padding sequence: no keys at all
    lse = jnp.asarray(lse)
    want = combine_splits(o_part, lse)
    got = combine_splits_kernel(o_part, lse, interpret=interpret)
    np.testing.assert_allclose(_f32(got), _f32(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(_f32(got)[1], 0.0)
    got_bf16 = combine_splits_kernel(o_part, lse, out_dtype=jnp.bfloat16, interpret=interpret)
    assert got_bf16.dtype == jnp.bfloat16
    np.testing.assert_allclose(_f32(got_bf16), _f32(want), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("num_warps", [0, -4, 3])
def test_layer_kernels_refuse_warp_counts_they_cannot_launch(num_warps, interpret):
    """A bad `num_warps` names the field instead of falling back to the default."""
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="num_warps"):
        add_rms_norm(x, None, jnp.ones((64,), jnp.float32), eps=1e-5, interpret=interpret,
                     num_warps=num_warps)
    qkv = jnp.ones((2, 12, 32), jnp.float32)
    cos = jnp.ones((2, 16), jnp.float32)
    pages = jnp.zeros((4, 4, 2, 32), jnp.float32)
    with pytest.raises(ValueError, match="num_warps"):
        rope_kv_write(qkv, cos, cos, jnp.asarray([0, 1], jnp.int32), pages, pages,
                      interpret=interpret, num_warps=num_warps)

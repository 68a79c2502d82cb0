"""Sliding-window attention in the Pallas kernels (interpret mode on CPU, compiled on a GPU)
against the jnp references, on fresh random inputs.

The engine frees the blocks a sliding layer can no longer see, so their block-table entries
may point anywhere: here every page that lies wholly before a query's window is replaced by a
page full of NaN, and the kernels must give the reference's output (computed on the intact
pages) all the same. Windows shorter and longer than the context, not a multiple of the
block size, of one token; contexts ending mid-block; several splits.
"""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest

from kernel_helpers import HEAD_DIM, TOL, decode_case, ragged_case, rel_err
from pallas_kernels.paged_attention import (paged_attention, paged_attention_reference,
                                            rope_paged_attention, rope_paged_attention_reference)
from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                   ragged_paged_attention_reference)
from quick_subset import first_quick


def poisoned(k, v, tables, first_visible, block_size):
    """Pages and tables where every table entry wholly before `first_visible[s]` (the first
    key any query of sequence s may see) points at one extra page of NaN."""
    nan = jnp.full((1,) + k.shape[1:], jnp.nan, k.dtype)
    k2, v2 = jnp.concatenate([k, nan]), jnp.concatenate([v, nan])
    bad = k.shape[0]
    t = np.array(tables)
    for s, first in enumerate(first_visible):
        t[s, :max(0, int(first)) // block_size] = bad
    return k2, v2, jnp.asarray(t)


DECODE_CASES = [
    # (q_heads, kv_heads, block_size, max_blocks, lens, window, splits, ppcb, dtype)
    (8, 2, 8, 12, [90, 7, 0, 41], 20, 1, 2, jnp.float32),      # window < context, mid-block
    (8, 2, 16, 10, [150, 33, 17, 1], 33, 2, 1, jnp.float32),   # splits over the window
    (4, 4, 8, 16, [127, 64, 9, 128], 1, None, 2, jnp.float32),  # a window of one token
    (16, 2, 8, 8, [60, 5, 0, 64], 100, 3, 2, jnp.float32),     # window > every context
    (8, 2, 16, 12, [181, 40, 99, 2], 50, None, 2, jnp.bfloat16),
]


@pytest.mark.parametrize("q_heads,kv_heads,block_size,max_blocks,lens,window,splits,ppcb,dtype",
                         first_quick(DECODE_CASES))
def test_decode_window_skips_pages_before_it(q_heads, kv_heads, block_size, max_blocks, lens,
                                             window, splits, ppcb, dtype, interpret):
    q, k, v, tables, lens = decode_case(window + block_size, batch=len(lens), q_heads=q_heads,
                                        kv_heads=kv_heads, block_size=block_size,
                                        max_blocks=max_blocks, lens=lens, dtype=dtype)
    want = paged_attention_reference(q, k, v, jnp.asarray(tables), jnp.asarray(lens),
                                     window=window)
    kp, vp, tp = poisoned(k, v, tables, lens - window, block_size)
    out = paged_attention(q, kp, vp, tp, jnp.asarray(lens), window=window, num_splits=splits,
                          pages_per_compute_block=ppcb, interpret=interpret)
    assert bool(jnp.isfinite(out).all())
    real = lens > 0
    assert rel_err(out[real], want[real]) < TOL[dtype]
    assert not np.asarray(out[~real]).any()


def test_decode_window_differs_from_full_attention(interpret):
    """The window is not ignored: a context longer than it gives a different output."""
    q, k, v, tables, lens = decode_case(3, batch=2, q_heads=8, kv_heads=2, block_size=8,
                                        max_blocks=8, lens=[60, 61], dtype=jnp.float32)
    args = (q, k, v, jnp.asarray(tables), jnp.asarray(lens))
    full = paged_attention(*args, interpret=interpret)
    windowed = paged_attention(*args, window=16, interpret=interpret)
    assert rel_err(windowed, full) > 0.05
    assert rel_err(windowed, paged_attention_reference(*args, window=16)) < TOL[jnp.float32]


def test_rope_decode_window(interpret):
    """The fused RoPE + KV-write + decode kernel with a window, against its unfused reference."""
    rng = np.random.default_rng(11)
    batch, q_heads, kv_heads, block_size, max_blocks, window = 4, 8, 2, 8, 12, 21
    lens = np.asarray([70, 1, 22, 96], np.int32)
    num_blocks = batch * max_blocks + 2
    shape = (num_blocks, block_size, kv_heads, HEAD_DIM)
    k = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    tables = rng.permutation(np.arange(1, num_blocks))[: batch * max_blocks]
    tables = tables.reshape(batch, max_blocks).astype(np.int32)
    qkv = jnp.asarray(rng.standard_normal((batch, q_heads + 2 * kv_heads, HEAD_DIM)), jnp.float32)
    angles = rng.uniform(0, 6, (batch, HEAD_DIM // 2))
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    pos = lens - 1
    slots = jnp.asarray(tables[np.arange(batch), pos // block_size] * block_size + pos % block_size)
    want, want_k, _ = rope_paged_attention_reference(qkv, cos, sin, slots, k, v,
                                                     jnp.asarray(tables), jnp.asarray(lens),
                                                     window=window)
    kp, vp, tp = poisoned(k, v, tables, lens - window, block_size)
    out, got_k, _ = rope_paged_attention(qkv, cos, sin, slots, kp, vp, tp, jnp.asarray(lens),
                                         window=window, num_splits=2,
                                         pages_per_compute_block=2, interpret=interpret)
    assert rel_err(out, want) < TOL[jnp.float32]
    flat = lambda x: np.asarray(x)[:num_blocks].reshape(-1, kv_heads, HEAD_DIM)  # noqa: E731
    np.testing.assert_allclose(flat(got_k)[np.asarray(slots)], flat(want_k)[np.asarray(slots)],
                               rtol=1e-6, atol=1e-6)


RAGGED_CASES = [
    # (q_lens, ctx_lens, window, block_size, ppcb, block_q, pad, dtype)
    ([40, 1, 13, 0], [100, 57, 13, 0], 24, 8, 2, 8, 3, jnp.float32),   # chunk, decode, prompt
    ([64], [64], 7, 8, 2, 16, 0, jnp.float32),                         # prompt, tiny window
    ([5, 30], [81, 30], 200, 16, 1, 8, 2, jnp.float32),                # window > context
    ([17, 50, 1], [99, 50, 130], 33, 16, 2, 16, 1, jnp.bfloat16),
]


@pytest.mark.parametrize("q_lens,ctx_lens,window,block_size,ppcb,block_q,pad,dtype",
                         first_quick(RAGGED_CASES))
def test_ragged_window_skips_pages_before_it(q_lens, ctx_lens, window, block_size, ppcb,
                                             block_q, pad, dtype, interpret):
    q, k, v, tables, ctx, cu, real = ragged_case(
        window * 7 + len(q_lens), q_lens=q_lens, ctx_lens=ctx_lens, q_heads=8, kv_heads=2,
        block_size=block_size, pad_tokens=pad, dtype=dtype)
    want = ragged_paged_attention_reference(q, k, v, tables, ctx, cu, window=window)
    first_query = np.asarray(ctx_lens) - np.asarray(q_lens)
    kp, vp, tp = poisoned(k, v, np.asarray(tables), first_query - window + 1, block_size)
    out = ragged_paged_attention(q, kp, vp, tp, ctx, cu, window=window, block_q=block_q,
                                 pages_per_compute_block=ppcb, interpret=interpret)
    assert bool(jnp.isfinite(out).all())
    assert rel_err(out[:real], want[:real]) < TOL[dtype]
    assert not np.asarray(out[real:]).any()

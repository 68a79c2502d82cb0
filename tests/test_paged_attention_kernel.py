"""Decode paged-attention kernel (interpret mode on CPU, compiled on a GPU) vs its jnp
reference and paxkv's reference_attention, on fresh random inputs: permuted block tables,
lengths ending mid-block, length 1, padding rows (length 0), GQA 1/4/8, block sizes 8/16/32,
fp32 and bf16, split-K."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels.paged_attention import (
    choose_num_splits,
    paged_attention,
    paged_attention_reference,
)
from kernel_helpers import HEAD_DIM, TOL, rel_err
from paxkv.model.attention import reference_attention
from paxkv.model.batch import StepBatch



def make_case(seed, *, batch, q_heads, kv_heads, block_size, max_blocks, lens, dtype,
              layout="blocks_first"):
    """Random pages, a random permutation of pages into block tables (block 0 = null)."""
    rng = np.random.default_rng(seed)
    num_blocks = batch * max_blocks + 3
    shape = (num_blocks, block_size, kv_heads, HEAD_DIM)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    q = rng.standard_normal((batch, q_heads, HEAD_DIM)).astype(np.float32)
    perm = rng.permutation(np.arange(1, num_blocks))[: batch * max_blocks]
    tables = perm.reshape(batch, max_blocks).astype(np.int32)
    lens = np.asarray(lens, np.int32)
    for b in range(batch):                       # unused table entries point at the null block
        tables[b, -(-int(lens[b]) // block_size):] = 0
    if layout == "heads_first":
        k, v = np.moveaxis(k, 2, 0), np.moveaxis(v, 2, 0)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(tables), jnp.asarray(lens))


def decode_step_batch(tables, lens) -> StepBatch:
    """A decode StepBatch: one new token per sequence, at position len - 1."""
    batch = tables.shape[0]
    return StepBatch(
        token_ids=jnp.zeros((batch,), jnp.int32),
        positions=jnp.maximum(lens - 1, 0),
        slot_mapping=jnp.zeros((batch,), jnp.int32),
        block_tables=tables,
        context_lens=lens,
        cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32),
        logits_indices=jnp.arange(batch, dtype=jnp.int32),
    )


CASES = [
    # (q_heads, kv_heads, block_size, max_blocks, lens, dtype, splits, ppcb)
    (4, 4, 8, 6, [37, 1, 48, 0], jnp.float32, 1, 2),      # GQA 1
    (8, 2, 16, 5, [33, 80, 1, 17], jnp.float32, 2, 1),    # GQA 4, split-K
    (16, 2, 8, 8, [61, 5, 0, 64], jnp.float32, 3, 2),     # GQA 8, uneven splits
    (8, 2, 32, 3, [95, 1, 40, 64], jnp.float32, 2, 1),    # larger block
    (8, 2, 16, 5, [79, 2, 16, 0], jnp.bfloat16, 1, 2),
    (16, 2, 8, 8, [63, 9, 1, 30], jnp.bfloat16, 4, 2),
    (8, 2, 8, 64, [130, 37, 1, 0], jnp.float32, 8, 2),    # contexts far shorter than the table
]


@pytest.mark.slow
@pytest.mark.parametrize("q_heads,kv_heads,block_size,max_blocks,lens,dtype,splits,ppcb", CASES)
def test_decode_matches_references(q_heads, kv_heads, block_size, max_blocks, lens, dtype,
                                   splits, ppcb, interpret):
    seed = q_heads * 1000 + block_size * 10 + splits + (dtype == jnp.bfloat16)
    q, k, v, tables, lens_ = make_case(seed, batch=len(lens), q_heads=q_heads, kv_heads=kv_heads,
                                       block_size=block_size, max_blocks=max_blocks, lens=lens,
                                       dtype=dtype)
    out = paged_attention(q, k, v, tables, lens_, num_splits=splits,
                          pages_per_compute_block=ppcb, interpret=interpret)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert bool(jnp.isfinite(out).all())
    real = np.asarray(lens) > 0
    ref = paged_attention_reference(q, k, v, tables, lens_)
    assert rel_err(out[real], ref[real]) < TOL[dtype]
    np.testing.assert_array_equal(np.asarray(out[~real], np.float32), 0.0)
    model_ref = reference_attention(q, k, v, decode_step_batch(tables, lens_), HEAD_DIM ** -0.5)
    assert rel_err(out[real], model_ref[real]) < TOL[dtype]


@pytest.mark.slow
def test_heads_first_layout_and_default_tuning(interpret):
    q, k, v, tables, lens = make_case(7, batch=3, q_heads=8, kv_heads=2, block_size=16,
                                      max_blocks=4, lens=[50, 3, 64], dtype=jnp.float32,
                                      layout="heads_first")
    out = paged_attention(q, k, v, tables, lens, pages_layout="heads_first", interpret=interpret)
    ref = paged_attention_reference(q, k, v, tables, lens, pages_layout="heads_first")
    assert rel_err(out, ref) < 1e-5


@pytest.mark.slow
def test_quantized_fp8_pages_with_scales(interpret):
    q, k, v, tables, lens = make_case(11, batch=2, q_heads=8, kv_heads=2, block_size=8,
                                      max_blocks=5, lens=[39, 12], dtype=jnp.float32)
    rng = np.random.default_rng(3)
    ks = jnp.asarray(rng.uniform(0.5, 2.0, k.shape[:3]), jnp.float32)
    vs = jnp.asarray(rng.uniform(0.5, 2.0, v.shape[:3]), jnp.float32)
    k8, v8 = k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn)
    out = paged_attention(q, k8, v8, tables, lens, ks, vs, num_splits=2,
                          pages_per_compute_block=2, interpret=interpret)
    ref = paged_attention_reference(q, k8, v8, tables, lens, ks, vs)
    assert rel_err(out, ref) < 1e-5
    batch = decode_step_batch(tables, lens)
    model_ref = reference_attention(q, k8, v8, batch, HEAD_DIM ** -0.5, ks, vs)
    assert rel_err(out, model_ref) < 1e-5


def test_poisoned_pages_past_length_do_not_leak(interpret):
    """NaN in the tail of the last page and in unused table entries must not reach outputs."""
    q, k, v, tables, lens = make_case(5, batch=2, q_heads=8, kv_heads=2, block_size=8,
                                      max_blocks=3, lens=[13, 20], dtype=jnp.float32)
    ref = paged_attention_reference(q, k, v, tables, lens)
    last_page = int(tables[0, 1])
    k = k.at[last_page, 5:].set(jnp.nan).at[0].set(jnp.nan)
    v = v.at[last_page, 5:].set(jnp.nan).at[0].set(jnp.nan)
    out = paged_attention(q, k, v, tables, lens, num_splits=2, pages_per_compute_block=2,
                          interpret=interpret)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2"])
def test_nan_codes_past_length_do_not_leak_from_fp8_pages(fmt, interpret):
    """fp8 has NaN codes (and e5m2 inf): bytes past a sequence's length or in the null block
    must not reach outputs, also on the unmasked fast path of full compute blocks."""
    from paxkv.cache import quant
    q, k, v, tables, lens = make_case(6, batch=2, q_heads=8, kv_heads=2, block_size=8,
                                      max_blocks=3, lens=[13, 24], dtype=jnp.float32)
    q = q.astype(jnp.bfloat16)
    k, k_scale = quant.quantize(k, quant.storage_dtype(fmt))
    v, v_scale = quant.quantize(v, quant.storage_dtype(fmt))
    ref = paged_attention_reference(q, k, v, tables, lens, k_scale, v_scale)
    nan = jnp.array(jnp.nan, k.dtype)
    last_page = int(tables[0, 1])
    k = k.at[last_page, 5:].set(nan).at[0].set(nan)
    v = v.at[last_page, 5:].set(nan).at[0].set(nan)
    out = paged_attention(q, k, v, tables, lens, k_scale, v_scale, num_splits=1,
                          pages_per_compute_block=2, interpret=interpret)
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    assert rel_err(out, ref) < 2e-2


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("dot_dtype", ["bfloat16", "float16"])
def test_8bit_pages_with_either_dot_dtype(fmt, dot_dtype, interpret):
    """8-bit codes are exact in both dot dtypes; the query (softmax scale folded in) and the
    scaled probabilities are rounded to it. Against the reference on the same codes."""
    from paxkv.cache import quant
    q, k, v, tables, lens = make_case(21, batch=3, q_heads=8, kv_heads=2, block_size=8,
                                      max_blocks=6, lens=[45, 1, 33], dtype=jnp.float32)
    q = q.astype(jnp.bfloat16)
    k, k_scale = quant.quantize(k, quant.storage_dtype(fmt))
    v, v_scale = quant.quantize(v, quant.storage_dtype(fmt))
    ref = paged_attention_reference(q, k, v, tables, lens, k_scale, v_scale)
    out = paged_attention(q, k, v, tables, lens, k_scale, v_scale, num_splits=2,
                          pages_per_compute_block=2, dot_dtype=dot_dtype, interpret=interpret)
    assert out.dtype == q.dtype
    assert rel_err(out, ref) < TOL[jnp.bfloat16]


def test_choose_num_splits():
    # the split counts that measured best on an H200 (results/kernels.md)
    assert choose_num_splits(32, 8, 64, 8) == 4
    assert choose_num_splits(64, 8, 128, 8) == 2
    assert choose_num_splits(16, 8, 512, 8) == 8
    assert choose_num_splits(256, 8, 64, 8) == 1          # plenty of programs already
    assert choose_num_splits(1, 8, 2, 8) == 1             # too short to split
    assert choose_num_splits(1, 8, 128, 8) == 8           # one stream, a 2,048-token table
    assert choose_num_splits(1, 8, 128, 8, max_splits=4) == 4
    assert choose_num_splits(64, 8, 128, 8, max_splits=4) == 2   # the cap only lowers
    assert choose_num_splits(1, 8, 128, 8, max_splits=0) == 1


@pytest.mark.parametrize("field,kwargs", [
    ("block_tables", dict(tables=jnp.zeros((3, 4), jnp.int32))),
    ("context_lens", dict(lens=jnp.zeros((2,), jnp.float32))),
    ("q_heads", dict(q=jnp.zeros((2, 7, HEAD_DIM)))),
    ("head_dim", dict(q=jnp.zeros((2, 8, 16)))),
    ("pages_per_compute_block", dict(ppcb=3)),
])
def test_bad_input_names_field(field, kwargs, interpret):
    q, k, v, tables, lens = make_case(0, batch=2, q_heads=8, kv_heads=2, block_size=8,
                                      max_blocks=4, lens=[5, 9], dtype=jnp.float32)
    args = dict(q=q, tables=tables, lens=lens, ppcb=None)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        paged_attention(args["q"], k, v, args["tables"], args["lens"],
                        pages_per_compute_block=args["ppcb"], interpret=interpret)


def test_pipeline_stages_fit_shared_memory():
    """Default stages shrink only where K/V tiles would overflow shared memory (an H200 ran
    out at 256-token pages with three stages); explicit values are kept."""
    from pallas_kernels.paged_attention.paging import SHARED_MEMORY_BUDGET, fit_num_stages

    def stages(default, block_k, rows):
        return fit_num_stages(None, default, block_k=block_k, head_dim=128, kv_itemsize=2,
                              rows=rows, q_itemsize=2)

    assert stages(2, 128, 16) == 2          # decode, 16-token pages x 8
    assert stages(3, 64, 128) == 3          # ragged default, 16-token pages x 4
    assert stages(3, 128, 128) == 2         # ragged, one 128-token page per step
    assert stages(3, 256, 128) == 1         # ragged, one 256-token page per step
    assert stages(2, 256, 16) == 1          # decode, one 256-token page per step
    for block_k in (16, 32, 64, 128, 256):
        s = stages(3, block_k, 128)
        assert s * 2 * block_k * 128 * 2 + 128 * 128 * 2 <= SHARED_MEMORY_BUDGET
    assert fit_num_stages(4, 2, block_k=256, head_dim=128, kv_itemsize=2, rows=16,
                          q_itemsize=2) == 4

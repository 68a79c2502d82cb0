"""Ragged paged-attention kernel (interpret mode on CPU, compiled on a GPU) vs its jnp
reference and paxkv's reference_attention: prompts, chunks over cached context, decode rows
and padding in one batch; permuted block tables, lengths ending mid-block, GQA 1/4/8, block
sizes 8/16/32, fp32 and bf16."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels.ragged_paged_attention import (
    build_work_list,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from kernel_helpers import HEAD_DIM, TOL, ragged_case, rel_err
from paxkv.model.attention import reference_attention
from paxkv.model.batch import StepBatch
from quick_subset import first_quick



def make_case(seed, *, q_lens, ctx_lens, q_heads, kv_heads, block_size, pad_tokens, dtype):
    """`kernel_helpers.ragged_case` with its metadata as the StepBatch the model builds."""
    q, k, v, tables, lens, cu, real = ragged_case(
        seed, q_lens=q_lens, ctx_lens=ctx_lens, q_heads=q_heads, kv_heads=kv_heads,
        block_size=block_size, pad_tokens=pad_tokens, dtype=dtype)
    pos = np.zeros(q.shape[0], np.int32)
    for s in range(len(q_lens)):
        pos[cu[s]:cu[s + 1]] = ctx_lens[s] - q_lens[s] + np.arange(q_lens[s])
    cu_np = np.asarray(cu)
    batch = StepBatch(
        token_ids=jnp.zeros((q.shape[0],), jnp.int32), positions=jnp.asarray(pos),
        slot_mapping=jnp.zeros((q.shape[0],), jnp.int32), block_tables=tables,
        context_lens=lens, cu_q_lens=cu,
        logits_indices=jnp.asarray(np.maximum(cu_np[1:] - 1, 0), jnp.int32))
    return q, k, v, batch, real


CASES = [
    # (q_lens, ctx_lens, q_heads, kv_heads, block_size, pad_tokens, dtype, block_q, ppcb)
    ([13, 1, 20, 0], [13, 40, 53, 0], 4, 4, 8, 3, jnp.float32, 16, 2),     # GQA 1
    ([9, 1, 30], [9, 17, 70], 8, 2, 16, 2, jnp.float32, 4, 1),             # GQA 4
    ([21, 0, 5], [21, 0, 38], 16, 2, 8, 0, jnp.float32, 2, 4),             # GQA 8
    ([40, 3], [95, 3], 8, 2, 32, 5, jnp.float32, 8, 1),                    # block 32
    ([17, 1, 11], [17, 29, 60], 8, 2, 16, 4, jnp.bfloat16, 4, 2),
    ([7, 12], [7, 44], 16, 2, 8, 1, jnp.bfloat16, 2, 2),
]


@pytest.mark.parametrize(
    "q_lens,ctx_lens,q_heads,kv_heads,block_size,pad_tokens,dtype,block_q,ppcb", first_quick(CASES, n=3))
def test_ragged_matches_references(q_lens, ctx_lens, q_heads, kv_heads, block_size, pad_tokens,
                                   dtype, block_q, ppcb, interpret):
    seed = sum(q_lens) * 100 + q_heads + block_size
    q, k, v, batch, real = make_case(seed, q_lens=q_lens, ctx_lens=ctx_lens, q_heads=q_heads,
                                     kv_heads=kv_heads, block_size=block_size,
                                     pad_tokens=pad_tokens, dtype=dtype)
    out = ragged_paged_attention(q, k, v, batch.block_tables, batch.context_lens,
                                 batch.cu_q_lens, block_q=block_q,
                                 pages_per_compute_block=ppcb, interpret=interpret)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert bool(jnp.isfinite(out).all())
    np.testing.assert_array_equal(np.asarray(out[real:], np.float32), 0.0)  # padding tokens
    ref = ragged_paged_attention_reference(q, k, v, batch.block_tables, batch.context_lens,
                                           batch.cu_q_lens)
    assert rel_err(out[:real], ref[:real]) < TOL[dtype]
    model_ref = reference_attention(q, k, v, batch, HEAD_DIM ** -0.5)
    assert rel_err(out[:real], model_ref[:real]) < TOL[dtype]


def test_default_tuning_and_quantized_int8_pages(interpret):
    q, k, v, batch, real = make_case(4, q_lens=[6, 1, 19], ctx_lens=[6, 33, 41], q_heads=8,
                                     kv_heads=2, block_size=8, pad_tokens=2,
                                     dtype=jnp.float32)
    rng = np.random.default_rng(8)
    k8 = jnp.asarray(rng.integers(-127, 128, k.shape), jnp.int8)
    v8 = jnp.asarray(rng.integers(-127, 128, v.shape), jnp.int8)
    ks = jnp.asarray(rng.uniform(0.001, 0.02, k.shape[:3]), jnp.float32)
    vs = jnp.asarray(rng.uniform(0.001, 0.02, v.shape[:3]), jnp.float32)
    out = ragged_paged_attention(q, k8, v8, batch.block_tables, batch.context_lens,
                                 batch.cu_q_lens, ks, vs, interpret=interpret)
    model_ref = reference_attention(q, k8, v8, batch, HEAD_DIM ** -0.5, ks, vs)
    assert rel_err(out[:real], model_ref[:real]) < 1e-5


def test_poisoned_pages_past_context_do_not_leak(interpret):
    q, k, v, batch, real = make_case(6, q_lens=[5, 9], ctx_lens=[13, 9], q_heads=8, kv_heads=2,
                                     block_size=8, pad_tokens=0, dtype=jnp.float32)
    ref = reference_attention(q, k, v, batch, HEAD_DIM ** -0.5)
    tail_page = int(batch.block_tables[0, 1])            # keys 8..15 of sequence 0; 13.. unused
    k = k.at[tail_page, 5:].set(jnp.nan).at[0].set(jnp.nan)
    v = v.at[tail_page, 5:].set(jnp.nan).at[0].set(jnp.nan)
    out = ragged_paged_attention(q, k, v, batch.block_tables, batch.context_lens,
                                 batch.cu_q_lens, block_q=4, pages_per_compute_block=2,
                                 interpret=interpret)
    assert rel_err(out, ref) < 1e-5


def test_work_list_covers_every_token_once():
    cu = jnp.asarray([0, 5, 5, 17, 18], jnp.int32)
    num_tokens, block_q = 21, 4
    cu_ext, seq, tile = build_work_list(cu, num_tokens, block_q)
    covered = np.zeros(num_tokens, int)
    for s, t in zip(np.asarray(seq), np.asarray(tile)):
        if s < 0:
            continue
        start = int(cu_ext[s]) + int(t) * block_q
        end = min(start + block_q, int(cu_ext[s + 1]))
        covered[start:end] += 1
    np.testing.assert_array_equal(covered, 1)            # padding tokens 18..20 included


@pytest.mark.parametrize("field,change", [
    ("cu_q_lens", lambda a: a.update(cu=jnp.zeros((2,), jnp.int32))),
    ("context_lens", lambda a: a.update(lens=jnp.zeros((3,), jnp.int32))),
    ("q_heads", lambda a: a.update(q=jnp.zeros((4, 7, HEAD_DIM)))),
    ("block_q", lambda a: a.update(block_q=-1)),
])
def test_bad_input_names_field(field, change, interpret):
    q, k, v, batch, _ = make_case(0, q_lens=[3, 1], ctx_lens=[3, 9], q_heads=8, kv_heads=2,
                                  block_size=8, pad_tokens=0, dtype=jnp.float32)
    args = dict(q=q, lens=batch.context_lens, cu=batch.cu_q_lens, block_q=None)
    change(args)
    with pytest.raises(ValueError, match=field):
        ragged_paged_attention(args["q"], k, v, batch.block_tables, args["lens"], args["cu"],
                               block_q=args["block_q"], interpret=interpret)

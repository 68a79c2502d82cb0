"""The fused decode kernel (RoPE + KV-page write + attention in one launch) against the two
steps it replaces, run by `rope_paged_attention_reference`: `rope_kv_write_reference`, then
`paged_attention_reference` over the pages it wrote. Fresh random inputs: permuted block
tables, lengths ending mid-block, length 1 (the new token alone), padding rows (length 0,
slot outside the pool), GQA 1/4/8, split-K, fp32 and bf16; interpret mode on the CPU,
compiled on a GPU (`PAXKV_TEST_DEVICE=gpu`)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_helpers import HEAD_DIM, TOL, rel_err
from pallas_kernels.paged_attention import rope_paged_attention, rope_paged_attention_reference
from test_paged_attention_kernel import make_case
from quick_subset import first_quick


def make_fused_case(seed, *, q_heads, kv_heads, block_size, max_blocks, lens, dtype):
    """Pages and tables as `make_case`, packed q/k/v heads of each sequence's new token, its
    rotation angles, and the slot of position `len - 1` (-1 for padding rows)."""
    batch = len(lens)
    _, k, v, tables, lens_ = make_case(seed, batch=batch, q_heads=q_heads, kv_heads=kv_heads,
                                       block_size=block_size, max_blocks=max_blocks, lens=lens,
                                       dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    qkv = jnp.asarray(rng.standard_normal((batch, q_heads + 2 * kv_heads, HEAD_DIM)), dtype)
    angles = rng.uniform(0, 300, (batch, HEAD_DIM // 2)).astype(np.float32)
    t = np.asarray(tables)
    slots = np.full((batch,), -1, np.int32)
    for b, n in enumerate(lens):
        if n > 0:
            slots[b] = t[b, (n - 1) // block_size] * block_size + (n - 1) % block_size
    return (qkv, jnp.cos(angles), jnp.sin(angles), jnp.asarray(slots), k, v, tables, lens_)


CASES = [
    # (q_heads, kv_heads, block_size, max_blocks, lens, dtype, splits, ppcb)
    (4, 4, 8, 6, [37, 1, 48, 0], jnp.float32, 1, 2),      # GQA 1, length 1, padding row
    (8, 2, 16, 5, [33, 80, 2, 17], jnp.float32, 2, 1),    # GQA 4, split-K
    (16, 2, 8, 8, [61, 5, 0, 64], jnp.float32, 3, 2),     # GQA 8, uneven splits
    (8, 2, 16, 5, [79, 2, 16, 0], jnp.bfloat16, 1, 2),
    (8, 2, 8, 64, [130, 37, 1, 0], jnp.bfloat16, 8, 2),   # contexts far shorter than the table
]


@pytest.mark.parametrize("q_heads,kv_heads,block_size,max_blocks,lens,dtype,splits,ppcb", first_quick(CASES, n=3))
def test_fused_decode_matches_rope_write_then_attention(q_heads, kv_heads, block_size, max_blocks,
                                                        lens, dtype, splits, ppcb, interpret):
    seed = q_heads * 100 + block_size + splits
    case = make_fused_case(seed, q_heads=q_heads, kv_heads=kv_heads, block_size=block_size,
                           max_blocks=max_blocks, lens=lens, dtype=dtype)
    qkv, cos, sin, slots, k, v, tables, lens_ = case
    want, want_k, want_v = rope_paged_attention_reference(*case)
    out, got_k, got_v = rope_paged_attention(qkv, cos, sin, slots, k, v, tables, lens_,
                                             num_splits=splits, pages_per_compute_block=ppcb,
                                             interpret=interpret)
    assert out.shape == (len(lens), q_heads, HEAD_DIM) and out.dtype == dtype
    real = np.asarray(lens) > 0
    assert rel_err(out[real], want[real]) < TOL[dtype]
    np.testing.assert_array_equal(np.asarray(out[~real], np.float32), 0.0)
    # the pages: the new tokens' slots hold the rotated key (to rounding: fused multiply-adds,
    # one rounding to the dtype) and the value as it came; every other slot is unchanged
    tol = 1e-6 if dtype == jnp.float32 else 8e-3
    f32 = lambda x: np.asarray(x, np.float32).reshape(-1, kv_heads, HEAD_DIM)
    written = np.asarray(slots)[real]
    untouched = np.setdiff1d(np.arange(f32(k).shape[0]), written)
    np.testing.assert_allclose(f32(got_k)[written], f32(want_k)[written], rtol=tol, atol=tol)
    np.testing.assert_array_equal(f32(got_v)[written], f32(want_v)[written])
    np.testing.assert_array_equal(f32(got_k)[untouched], f32(k)[untouched])
    np.testing.assert_array_equal(f32(got_v)[untouched], f32(v)[untouched])
    assert not np.allclose(f32(got_k)[written], f32(k)[written])


@pytest.mark.slow
def test_fused_decode_ignores_the_stale_slot_it_overwrites(interpret):
    """The new token's attention comes from registers: NaN left in its slot from before (the
    page's old contents) must not reach the output."""
    case = list(make_fused_case(9, q_heads=8, kv_heads=2, block_size=8, max_blocks=4,
                                lens=[21, 8], dtype=jnp.float32))
    want, _, _ = rope_paged_attention_reference(*case)
    flat_k = case[4].reshape(-1, *case[4].shape[2:])
    flat_v = case[5].reshape(-1, *case[5].shape[2:])
    case[4] = flat_k.at[case[3]].set(jnp.nan).reshape(case[4].shape)
    case[5] = flat_v.at[case[3]].set(jnp.nan).reshape(case[5].shape)
    out, _, _ = rope_paged_attention(*case, num_splits=2, pages_per_compute_block=2,
                                     interpret=interpret)
    assert bool(jnp.isfinite(out).all())
    assert rel_err(out, want) < 1e-5


def test_fused_decode_ignores_slots_past_the_length(interpret):
    """NaN in every pool slot the sequences do not own (the null block, other sequences'
    pages, the rest of a last page) must not reach the output, at lengths ending mid-block
    and splits past the end."""
    case = list(make_fused_case(13, q_heads=8, kv_heads=2, block_size=8, max_blocks=8,
                                lens=[21, 3, 40, 0], dtype=jnp.float32))
    want, _, _ = rope_paged_attention_reference(*case)
    tables, lens = np.asarray(case[6]), np.asarray(case[7])
    owned = np.zeros(case[4].shape[0] * case[4].shape[1], bool)
    for b, n in enumerate(lens):
        for t in range(max(int(n) - 1, 0)):          # the new token's slot is written anyway
            owned[tables[b, t // 8] * 8 + t % 8] = True
    for i in (4, 5):
        flat = np.asarray(case[i]).reshape(owned.size, *case[i].shape[2:]).copy()
        flat[~owned] = np.nan
        case[i] = jnp.asarray(flat.reshape(case[i].shape))
    out, _, _ = rope_paged_attention(*case, num_splits=4, pages_per_compute_block=2,
                                     interpret=interpret)
    real = lens > 0
    assert bool(jnp.isfinite(out).all())
    assert rel_err(out[real], want[real]) < 1e-5


@pytest.mark.parametrize("field,change", [
    ("qkv", lambda a: {**a, "qkv": a["qkv"][:, :4]}),
    ("cos and sin", lambda a: {**a, "cos": a["cos"][:, :3]}),
    ("slot_mapping", lambda a: {**a, "slots": a["slots"][:1]}),
    ("block_tables", lambda a: {**a, "tables": a["tables"][:1]}),
])
def test_fused_decode_bad_input_names_field(field, change, interpret):
    qkv, cos, sin, slots, k, v, tables, lens = make_fused_case(
        0, q_heads=8, kv_heads=2, block_size=8, max_blocks=4, lens=[5, 9], dtype=jnp.float32)
    a = change(dict(qkv=qkv, cos=cos, sin=sin, slots=slots, tables=tables))
    with pytest.raises(ValueError, match=field):
        rope_paged_attention(a["qkv"], a["cos"], a["sin"], a["slots"], k, v, a["tables"], lens,
                             interpret=interpret)


@pytest.mark.slow
def test_fused_decode_default_splits_capped(interpret):
    """Without `num_splits` the fused kernel takes `choose_num_splits` capped at
    `rope_decode_max_splits` (4 for this table; one sequence over it would get 8): still the unfused
    steps' output, for a context that ends mid-block and spans several splits."""
    import importlib
    module = importlib.import_module("pallas_kernels.paged_attention.paged_attention")
    assert module.choose_num_splits(1, 2, 64, 2) > module.ROPE_DECODE_MAX_SPLITS
    case = make_fused_case(11, q_heads=8, kv_heads=2, block_size=8, max_blocks=64,
                           lens=[203], dtype=jnp.float32)
    want, want_k, _ = rope_paged_attention_reference(*case)
    out, got_k, _ = rope_paged_attention(*case, pages_per_compute_block=2, interpret=interpret)
    assert rel_err(out, want) < TOL[jnp.float32]
    np.testing.assert_allclose(np.asarray(got_k), np.asarray(want_k), rtol=1e-6, atol=1e-6)


def test_fused_decode_split_cap_follows_the_table_width():
    """Short tables keep the 4-split cap one short-context stream was tuned at; a long context
    (100k tokens in 16-token blocks, 128 tokens a loop step) gets `paged_attention`'s own split
    count, so 8 KV heads of one stream fill the GPU."""
    from pallas_kernels.paged_attention.paged_attention import (
        ROPE_DECODE_MAX_SPLITS, choose_num_splits, rope_decode_max_splits)
    assert rope_decode_max_splits(2048 // 16, 8) == ROPE_DECODE_MAX_SPLITS
    long_pages = 100_000 // 16
    cap = rope_decode_max_splits(long_pages, 8)
    assert choose_num_splits(1, 8, long_pages, 8, max_splits=cap) == choose_num_splits(
        1, 8, long_pages, 8) == 128
    assert choose_num_splits(1, 8, 32_768 // 16, 8, max_splits=rope_decode_max_splits(
        32_768 // 16, 8)) == 64


@pytest.mark.slow
def test_fused_decode_many_splits_over_a_wide_table(interpret):
    """A table wide enough to lift the cap: 8 splits share a 453-token context (ending
    mid-block) and the output is still the unfused steps'."""
    from pallas_kernels.paged_attention.paged_attention import rope_decode_max_splits
    assert rope_decode_max_splits(64, 2) == 8
    case = make_fused_case(12, q_heads=8, kv_heads=2, block_size=8, max_blocks=64,
                           lens=[453, 77], dtype=jnp.float32)
    want, want_k, _ = rope_paged_attention_reference(*case)
    out, got_k, _ = rope_paged_attention(*case, pages_per_compute_block=2, interpret=interpret)
    assert rel_err(out, want) < TOL[jnp.float32]
    np.testing.assert_allclose(np.asarray(got_k), np.asarray(want_k), rtol=1e-6, atol=1e-6)


def test_engine_fuses_rope_only_into_small_decode_steps():
    """The model takes the fused kernel for decode steps of up to
    `AttentionPlan.rope_decode_max_rows` rows with unquantized pages, and the separate RoPE +
    KV-write kernel elsewhere."""
    from types import SimpleNamespace

    from paxkv.cache.kv_pool import KVPool
    from paxkv.config import AttentionPlan, ModelConfig
    from paxkv.model.attention import PagedAttention
    cfg = ModelConfig(vocab_size=16, hidden_size=32 * HEAD_DIM, intermediate_size=16,
                      num_layers=1, num_heads=32, num_kv_heads=8, head_dim=HEAD_DIM)
    plan = AttentionPlan("pallas", fused=True)
    pages = np.zeros((4, 16, 8, HEAD_DIM), np.float32)
    plain, quantized = KVPool((pages,), (pages,)), KVPool((pages,), (pages,), (pages,), (pages,))

    def fused(rows, decode_only=True, pool=plain):
        batch = SimpleNamespace(context_lens=np.zeros(rows), positions=np.zeros(rows))
        attention = PagedAttention.__new__(PagedAttention)
        attention.cfg, attention.plan, attention.decode_only = cfg, plan, decode_only
        qkv = np.zeros((rows, 32 + 16, HEAD_DIM), np.float32)
        return attention.fuses_rope_decode(qkv, pool, batch)
    assert fused(1) and fused(plan.rope_decode_max_rows)
    assert not fused(plan.rope_decode_max_rows * 2)
    assert not fused(8, decode_only=False) and not fused(8, pool=quantized)
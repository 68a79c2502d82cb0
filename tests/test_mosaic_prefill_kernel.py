"""The Mosaic GPU ragged prefill kernel (`ragged_paged_attention(..., backend="mosaic")`) vs the
jnp reference: prompts, chunks over cached context and decode-like rows in one ragged batch,
padding rows, permuted block tables, lengths ending mid-block, GQA 1/4/8, block sizes
8/16/32, bf16 and fp16, one warpgroup and warp-specialized, NaN past the lengths.

Compiled on a Hopper GPU (PAXKV_TEST_DEVICE=gpu); on the CPU in Mosaic GPU's interpret mode,
which JAX has from 0.12 (the products run as plain dots there; see `mosaic_prefill`)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_helpers import ragged_case, rel_err
from pallas_kernels.paged_attention import mosaic_decode, tuning
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.ragged_paged_attention import mosaic_prefill

HEAD_DIM = 64                     # wgmma tiles: the Mosaic kernel takes multiples of 64
TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def make_case(seed, *, head_dim=HEAD_DIM, **case):
    """`kernel_helpers.ragged_case` at the Mosaic kernel's head_dim."""
    return ragged_case(seed, head_dim=head_dim, **case)


def poison_past_lengths(k, v, tables, ctx_lens, block_size):
    """NaN in every byte no query may see: the tail of each sequence's last page and the null
    block. Masked logits and zeroed V rows must keep them out of every output."""
    for s, n in enumerate(ctx_lens):
        if n % block_size:
            page = int(tables[s, n // block_size])
            k = k.at[page, n % block_size:].set(jnp.nan)
            v = v.at[page, n % block_size:].set(jnp.nan)
    return k.at[0].set(jnp.nan), v.at[0].set(jnp.nan)


CASES = [
    # (q_lens, ctx_lens, q_heads, kv_heads, block_size, pad, dtype, block_q, ppcb, stages, ws)
    # GQA 1 (64-token tiles): a 70-token prompt (two tiles), a decode row, a chunk, an empty
    ([70, 1, 20, 0], [70, 40, 83, 0], 2, 2, 8, 3, jnp.bfloat16, None, 8, 2, False),
    # GQA 4: chunk over a long context, 4 stages deep, warp specialized
    ([9, 1, 30], [9, 17, 130], 8, 2, 16, 2, jnp.float16, None, 4, 3, True),
    # GQA 8, 32-token pages, no padding rows
    ([21, 0, 5], [21, 0, 100], 16, 2, 32, 0, jnp.bfloat16, None, 2, 2, True),
    # GQA 4 with a smaller tile than the default, 128-token key blocks, one stage
    ([40, 3, 1], [200, 3, 66], 8, 2, 8, 5, jnp.float16, 8, 16, 1, False),
]


@pytest.mark.parametrize(
    "q_lens,ctx_lens,q_heads,kv_heads,block_size,pad_tokens,dtype,block_q,ppcb,stages,ws", CASES)
def test_mosaic_prefill_matches_reference(q_lens, ctx_lens, q_heads, kv_heads, block_size,
                                          pad_tokens, dtype, block_q, ppcb, stages, ws,
                                          interpret_mosaic):
    seed = sum(q_lens) * 100 + q_heads + block_size
    q, k, v, tables, lens, cu, real = make_case(
        seed, q_lens=q_lens, ctx_lens=ctx_lens, q_heads=q_heads, kv_heads=kv_heads,
        block_size=block_size, pad_tokens=pad_tokens, dtype=dtype)
    ref = ragged_paged_attention_reference(q, k, v, tables, lens, cu)
    k, v = poison_past_lengths(k, v, tables, ctx_lens, block_size)
    out = ragged_paged_attention(q, k, v, tables, lens, cu, backend="mosaic", block_q=block_q,
                                 pages_per_compute_block=ppcb, num_stages=stages,
                                 warp_specialized=ws, interpret=interpret_mosaic)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert bool(jnp.isfinite(out.astype(jnp.float32)).all())
    np.testing.assert_array_equal(np.asarray(out[real:], np.float32), 0.0)  # padding rows
    assert rel_err(out[:real], ref[:real]) < TOL[dtype]
    # each sequence on its own, so that one right sequence cannot hide a wrong one
    for s in range(len(q_lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        if b > a:
            assert rel_err(out[a:b], ref[a:b]) < TOL[dtype], f"sequence {s}"


def test_mosaic_prefill_default_tuning(interpret_mosaic):
    ctx_lens = [50, 140, 1]
    q, k, v, tables, lens, cu, real = make_case(
        7, q_lens=[50, 12, 1], ctx_lens=ctx_lens, q_heads=8, kv_heads=2, block_size=16,
        pad_tokens=1, dtype=jnp.bfloat16)
    ref = ragged_paged_attention_reference(q, k, v, tables, lens, cu)
    k, v = poison_past_lengths(k, v, tables, ctx_lens, 16)
    out = ragged_paged_attention(q, k, v, tables, lens, cu, backend="mosaic",
                                 interpret=interpret_mosaic)
    assert rel_err(out[:real], ref[:real]) < TOL[jnp.bfloat16]
    np.testing.assert_array_equal(np.asarray(out[real:], np.float32), 0.0)


@pytest.mark.slow
def test_work_items_map_every_token_to_its_tile_row():
    cu = jnp.asarray([0, 5, 5, 17, 18], jnp.int32)
    lens = jnp.asarray([5, 3, 40, 9], jnp.int32)
    num_tokens, block_q = 21, 4
    seq, first_pos, kv_end, tile_start, tok_item, tok_row = map(
        np.asarray, mosaic_prefill.work_items(cu, lens, num_tokens, block_q))
    rows = set()
    for t in range(num_tokens):
        w, r = int(tok_item[t]), int(tok_row[t])
        assert tile_start[w] + r == t
        rows.add((w, r))
        if t < 18:                                       # real tokens: causal key range
            s = int(np.searchsorted(np.asarray(cu)[1:], t, side="right"))
            assert seq[w] == s
            pos = int(lens[s]) - (int(cu[s + 1]) - int(cu[s])) + (t - int(cu[s]))
            assert first_pos[w] + r == pos and kv_end[w] >= pos + 1
        else:                                            # padding: no keys
            assert kv_end[w] == 0
    assert len(rows) == num_tokens


def _refusal_case(dtype=jnp.bfloat16, head_dim=HEAD_DIM):
    return make_case(0, q_lens=[3, 1], ctx_lens=[3, 9], q_heads=8, kv_heads=2, block_size=16,
                     pad_tokens=0, dtype=dtype, head_dim=head_dim)


@pytest.mark.parametrize("change,field", [
    (dict(pages=jnp.float8_e4m3fn), "page dtype"),
    (dict(q_dtype=jnp.float16), "q dtype"),
    (dict(head_dim=32), "head_dim"),
    (dict(block_q=32), "block_q"),                     # 32 tokens x group 4 > 64 rows
    (dict(ppcb=2), "multiple of 64"),                  # 16-token pages x 2 = 32 keys a step
])
def test_mosaic_refuses_what_it_cannot_run(change, field):
    q, k, v, tables, lens, cu, _ = _refusal_case(head_dim=change.get("head_dim", HEAD_DIM))
    ks = vs = None
    if "pages" in change:
        k, v = k.astype(change["pages"]), v.astype(change["pages"])
        ks = vs = jnp.ones(k.shape[:3], jnp.bfloat16)
    if "q_dtype" in change:
        q = q.astype(change["q_dtype"])
    with pytest.raises(ValueError, match=field):
        ragged_paged_attention(q, k, v, tables, lens, cu, ks, vs, backend="mosaic",
                               block_q=change.get("block_q"),
                               pages_per_compute_block=change.get("ppcb"), interpret=True)


def test_unknown_backend_is_named():
    q, k, v, tables, lens, cu, _ = _refusal_case()
    with pytest.raises(ValueError, match="backend"):
        ragged_paged_attention(q, k, v, tables, lens, cu, backend="cuda", interpret=True)


def test_auto_backend_reads_the_prefill_table(interpret):
    table = (tuning.Winner("mosaic", ("bfloat16",), min_batch=4, max_context=4096),)
    assert tuning.prefill_backend(jnp.bfloat16, 8, 2048, table) == "mosaic"
    assert tuning.prefill_backend(jnp.bfloat16, 2, 2048, table) == "triton"    # sequences
    assert tuning.prefill_backend(jnp.bfloat16, 8, 8192, table) == "triton"    # context
    assert tuning.prefill_backend(jnp.int8, 8, 2048, table) == "triton"        # dtype
    assert tuning.prefill_backend(jnp.bfloat16, 8, 2048) == "triton"   # shipped table: empty
    for row in tuning.PREFILL_WINNERS:
        assert row.backend in ("triton", "mosaic")
    # auto keeps Triton here (interpret mode, or no winner yet on a GPU): same output
    q, k, v, tables, lens, cu, real = _refusal_case()
    auto = ragged_paged_attention(q, k, v, tables, lens, cu, interpret=interpret)
    triton = ragged_paged_attention(q, k, v, tables, lens, cu, backend="triton",
                                    interpret=interpret)
    np.testing.assert_array_equal(np.asarray(auto, np.float32), np.asarray(triton, np.float32))


def test_default_tuning_fits_shared_memory():
    budget = mosaic_decode.SHARED_MEMORY_BUDGET
    for block_size in (8, 16, 32, 64, 128):
        for head_dim in (64, 128, 256):
            ppcb = mosaic_prefill.default_pages_per_compute_block(block_size, head_dim)
            block_k = block_size * ppcb
            assert block_k % 64 == 0                     # whole wgmma tiles
            stages = mosaic_prefill.fit_num_stages(None, block_k, head_dim, 2)
            assert stages >= 1
            assert (stages * 2 * block_k + 2 * 64) * head_dim * 2 <= budget or stages == 1
    assert mosaic_prefill.fit_num_stages(None, 128, 128, 2) == 2
    assert mosaic_prefill.fit_num_stages(None, 128, 256, 2) == 1
    assert mosaic_prefill.fit_num_stages(3, 128, 256, 2) == 3      # asked for: kept

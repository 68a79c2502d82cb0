"""The Mosaic GPU decode kernel (`paged_attention(..., backend="mosaic")`) vs its jnp
reference: permuted block tables, lengths ending mid-block, length 1 and 0, GQA 1/4/8,
block sizes 8/16/32, split-K, one warpgroup and warp-specialized, NaN past the length.

Compiled on a Hopper GPU (PAXKV_TEST_DEVICE=gpu); on the CPU in Mosaic GPU's interpret mode,
which JAX has from 0.12 (the products run as plain dots there; see `mosaic_decode`)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_helpers import decode_case, rel_err
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.paged_attention import tuning

HEAD_DIM = 64                     # wgmma tiles: the Mosaic kernel takes multiples of 64
TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def make_case(seed, *, batch, q_heads, kv_heads, block_size, max_blocks, lens, dtype):
    q, k, v, tables, lens = decode_case(seed, batch=batch, q_heads=q_heads, kv_heads=kv_heads,
                                        block_size=block_size, max_blocks=max_blocks, lens=lens,
                                        dtype=dtype, head_dim=HEAD_DIM)
    return q, k, v, jnp.asarray(tables), jnp.asarray(lens)


CASES = [
    # (q_heads, kv_heads, block_size, max_blocks, lens, dtype, splits, ppcb, stages, ws)
    (8, 2, 16, 12, [190, 0, 61], jnp.bfloat16, 1, 4, 2, False),    # GQA 4
    (8, 2, 16, 12, [190, 1, 64], jnp.bfloat16, 2, 4, 2, True),     # split-K, warp specialized
    (16, 2, 8, 24, [191, 9, 100], jnp.bfloat16, 3, 8, 3, True),    # GQA 8, uneven splits
    (4, 4, 32, 6, [150, 33, 192], jnp.float16, 1, 2, 2, False),    # GQA 1 (rows padded to 8)
    (8, 2, 16, 8, [128, 127, 5], jnp.float16, 1, 4, 3, True),
]


@pytest.mark.parametrize("q_heads,kv_heads,block_size,max_blocks,lens,dtype,splits,ppcb,stages,ws",
                         CASES)
def test_mosaic_decode_matches_reference(q_heads, kv_heads, block_size, max_blocks, lens, dtype,
                                         splits, ppcb, stages, ws, interpret_mosaic):
    q, k, v, tables, lens_ = make_case(sum(lens) + q_heads, batch=len(lens), q_heads=q_heads,
                                       kv_heads=kv_heads, block_size=block_size,
                                       max_blocks=max_blocks, lens=lens, dtype=dtype)
    ref = paged_attention_reference(q, k, v, tables, lens_)
    # Bytes past each length (the tail of its last page, the null block) are NaN: masked
    # logits and zeroed V rows must keep them out of every output.
    for b, n in enumerate(lens):
        if n % block_size:
            page = int(tables[b, n // block_size])
            k = k.at[page, n % block_size:].set(jnp.nan)
            v = v.at[page, n % block_size:].set(jnp.nan)
    k, v = k.at[0].set(jnp.nan), v.at[0].set(jnp.nan)
    out = paged_attention(q, k, v, tables, lens_, backend="mosaic", num_splits=splits,
                          pages_per_compute_block=ppcb, num_stages=stages, warp_specialized=ws,
                          interpret=interpret_mosaic)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert bool(jnp.isfinite(out.astype(jnp.float32)).all())
    real = np.asarray(lens) > 0
    assert rel_err(out[real], ref[real]) < TOL[dtype]
    np.testing.assert_array_equal(np.asarray(out[~real], np.float32), 0.0)


def test_mosaic_default_tuning(interpret_mosaic):
    q, k, v, tables, lens = make_case(3, batch=2, q_heads=8, kv_heads=2, block_size=16,
                                      max_blocks=16, lens=[250, 77], dtype=jnp.bfloat16)
    out = paged_attention(q, k, v, tables, lens, backend="mosaic", interpret=interpret_mosaic)
    assert rel_err(out, paged_attention_reference(q, k, v, tables, lens)) < 1e-2


@pytest.mark.parametrize("change,field", [
    (dict(pages=jnp.float8_e4m3fn), "page dtype"),
    (dict(layout="heads_first"), "pages_layout"),
    (dict(q_dtype=jnp.float16), "q dtype"),
])
def test_mosaic_refuses_what_it_cannot_run(change, field):
    q, k, v, tables, lens = make_case(0, batch=2, q_heads=8, kv_heads=2, block_size=16,
                                      max_blocks=4, lens=[40, 9], dtype=jnp.bfloat16)
    ks = vs = None
    if "pages" in change:
        k, v = k.astype(change["pages"]), v.astype(change["pages"])
        ks = vs = jnp.ones(k.shape[:3], jnp.bfloat16)
    if "layout" in change:
        k, v = jnp.moveaxis(k, 2, 0), jnp.moveaxis(v, 2, 0)
    if "q_dtype" in change:
        q = q.astype(change["q_dtype"])
    with pytest.raises(ValueError, match=field):
        paged_attention(q, k, v, tables, lens, ks, vs, backend="mosaic",
                        pages_layout=change.get("layout", "blocks_first"), interpret=True)


def test_unknown_backend_is_named():
    q, k, v, tables, lens = make_case(0, batch=2, q_heads=8, kv_heads=2, block_size=16,
                                      max_blocks=4, lens=[40, 9], dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="backend"):
        paged_attention(q, k, v, tables, lens, backend="cuda", interpret=True)


def test_auto_backend_reads_the_table():
    table = (tuning.Winner("mosaic", ("bfloat16",), min_batch=64, max_context=4096),)
    assert tuning.decode_backend(jnp.bfloat16, 64, 2048, table) == "mosaic"
    assert tuning.decode_backend(jnp.bfloat16, 32, 2048, table) == "triton"     # batch
    assert tuning.decode_backend(jnp.bfloat16, 64, 8192, table) == "triton"     # context
    assert tuning.decode_backend(jnp.int8, 64, 2048, table) == "triton"         # dtype
    for row in tuning.DECODE_WINNERS:            # the shipped table names real backends
        assert row.backend in ("triton", "mosaic")

"""The "pallas" attention backend (kernels in interpret mode on CPU) against the "reference"
backend, on StepBatches built the way the model builds them: new tokens' K/V written into the
pool at their slots first, then attention. Decode-only and mixed steps, padding sequences
and padding tokens."""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest

from paxkv.cache.kv_pool import KVPool, write_layer
from paxkv.config import AttentionPlan, ModelConfig
from paxkv.model.attention import PagedAttention
from paxkv.model.batch import StepBatch

HEAD_DIM, Q_HEADS, KV_HEADS, BLOCK = 32, 8, 2, 8
CFG = ModelConfig(vocab_size=16, hidden_size=Q_HEADS * HEAD_DIM, intermediate_size=16,
                  num_layers=1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


def attend(q, k, v, batch, *, backend, decode_only, window=None):
    """The attention module's choice of kernel for this step (no write: the pages hold it)."""
    attention = PagedAttention(CFG, batch, AttentionPlan(backend), decode_only)
    return attention.attend(q, KVPool((k,), (v,)), batch, window)


def build_step(seed, q_lens, ctx_lens, pad_tokens, dtype):
    """Pool with cached context, a StepBatch for the new tokens, and the pool after writing."""
    rng = np.random.default_rng(seed)
    seqs = len(q_lens)
    max_blocks = max(-(-c // BLOCK) for c in ctx_lens) + 1
    num_blocks = seqs * max_blocks + 1
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    v_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    tables = rng.permutation(np.arange(1, num_blocks))[: seqs * max_blocks]
    tables = tables.reshape(seqs, max_blocks).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tokens = int(cu[-1]) + pad_tokens
    pos = np.zeros(tokens, np.int32)
    slots = np.arange(tokens, dtype=np.int32) % BLOCK         # padding -> null block 0
    for s in range(seqs):
        if ctx_lens[s] == 0:
            tables[s] = 0                                      # padding sequence
        p = ctx_lens[s] - q_lens[s] + np.arange(q_lens[s])
        pos[cu[s]:cu[s + 1]] = p
        slots[cu[s]:cu[s + 1]] = tables[s, p // BLOCK] * BLOCK + p % BLOCK
    batch = StepBatch(
        token_ids=jnp.zeros((tokens,), jnp.int32), positions=jnp.asarray(pos),
        slot_mapping=jnp.asarray(slots), block_tables=jnp.asarray(tables),
        context_lens=jnp.asarray(ctx_lens, jnp.int32), cu_q_lens=jnp.asarray(cu),
        logits_indices=jnp.asarray(np.maximum(cu[1:] - 1, 0), jnp.int32))
    new_k = jnp.asarray(rng.standard_normal((tokens, KV_HEADS, HEAD_DIM)), dtype)
    new_v = jnp.asarray(rng.standard_normal((tokens, KV_HEADS, HEAD_DIM)), dtype)
    k_pages, v_pages = write_layer(k_pages, v_pages, new_k, new_v, batch.slot_mapping)
    q = jnp.asarray(rng.standard_normal((tokens, Q_HEADS, HEAD_DIM)), dtype)
    return q, k_pages, v_pages, batch, int(cu[-1])


@pytest.mark.parametrize("q_lens,ctx_lens,pad_tokens,decode_only,dtype", [
    ([1, 1, 1, 0], [23, 1, 40, 0], 1, True, jnp.float32),        # decode + padding seq/token
    ([1, 1, 1], [9, 64, 17], 0, True, jnp.bfloat16),
    ([1, 12, 30, 0], [50, 12, 41, 0], 3, False, jnp.float32),    # decode + prompt + chunk
    ([5, 1], [5, 33], 2, False, jnp.bfloat16),
])
@pytest.mark.slow
def test_pallas_backend_matches_reference(q_lens, ctx_lens, pad_tokens, decode_only, dtype):
    q, k, v, batch, real = build_step(len(q_lens) * 10 + pad_tokens, q_lens, ctx_lens,
                                      pad_tokens, dtype)
    out = attend(q, k, v, batch, backend="pallas", decode_only=decode_only)
    ref = attend(q, k, v, batch, backend="reference", decode_only=decode_only)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert bool(jnp.isfinite(out).all())                         # padding rows included
    o, r = np.asarray(out[:real], np.float64), np.asarray(ref[:real], np.float64)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert np.linalg.norm(o - r) / np.linalg.norm(r) < tol


@pytest.mark.parametrize("q_lens,ctx_lens,pad_tokens,decode_only,window", [
    ([1, 1, 1, 0], [23, 1, 40, 0], 1, True, 9),         # decode: the window cuts two contexts
    ([1, 12, 30, 0], [50, 12, 41, 0], 3, False, 16),    # decode + prompt + chunk
])
def test_pallas_backend_sliding_window_matches_reference(q_lens, ctx_lens, pad_tokens,
                                                         decode_only, window):
    """A sliding layer's step through the attention module: the Pallas kernel it picks equals
    the reference, and differs from full attention."""
    q, k, v, batch, real = build_step(window, q_lens, ctx_lens, pad_tokens, jnp.float32)
    out = attend(q, k, v, batch, backend="pallas", decode_only=decode_only, window=window)
    ref = attend(q, k, v, batch, backend="reference", decode_only=decode_only, window=window)
    full = attend(q, k, v, batch, backend="reference", decode_only=decode_only)
    o, r, f = (np.asarray(x[:real], np.float64) for x in (out, ref, full))
    assert np.linalg.norm(o - r) / np.linalg.norm(r) < 1e-5
    assert np.linalg.norm(f - r) / np.linalg.norm(r) > 1e-2

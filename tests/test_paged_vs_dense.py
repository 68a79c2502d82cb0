"""Paged forward == dense forward (contiguous cache) for every kind of step and block size.

Steps are packed by the engine's own `Runner.pack`, over randomly permuted block tables, so
this also checks slot mapping, cu_q_lens, padding buckets and logits indices.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv.cache import kv_pool as kvp
from paxkv.config import ModelConfig
from paxkv.model.dense import dense_forward
from paxkv.model.fusion import fuse_projections
from paxkv.model.forward import forward
from paxkv.model.params import init_params
from paxkv.engine.step_io import WorkItem
from paxkv.runner import Runner

from engine_helpers import make_runner_config

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=256)


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG, jax.random.PRNGKey(0), jnp.float32)
    return jax.tree.map(lambda x: x * 5.0 if x.ndim == 2 else x, p)  # spread the logits


@pytest.fixture(scope="module")
def dense_logits(params):
    rng = np.random.default_rng(5)
    lens = [13, 29, 40, 1]   # none a multiple of 8, 16 or 32
    seqs = [rng.integers(0, CFG.vocab_size, size=n).tolist() for n in lens]
    logits = [np.asarray(dense_forward(params, jnp.asarray([s]), CFG)[0][0]) for s in seqs]
    return seqs, logits


def run_schedule(params, seqs, block_size, chunk_sizes, seed, backend="reference"):
    """Feed each sequence in chunks (cycling `chunk_sizes`); all sequences share each step."""
    max_len = max(len(s) for s in seqs)
    blocks_per_seq = -(-max_len // block_size)
    num_blocks = 1 + blocks_per_seq * len(seqs)
    perm = np.random.default_rng(seed).permutation(np.arange(1, num_blocks))
    tables = [perm[i * blocks_per_seq:(i + 1) * blocks_per_seq].tolist() for i in range(len(seqs))]
    runner = Runner(params, make_runner_config(
        CFG, block_size=block_size, num_blocks=num_blocks, max_num_seqs=8,
        max_num_batched_tokens=128, max_model_len=max_len + block_size))
    pool = kvp.init_pool(CFG, num_blocks, block_size, jnp.float32)
    done = [0] * len(seqs)
    got = [np.zeros((len(s), CFG.vocab_size), np.float32) for s in seqs]
    step = 0
    kinds = set()
    while any(d < len(s) for d, s in zip(done, seqs)):
        items, owners = [], []
        for i, s in enumerate(seqs):
            if done[i] < len(s):
                n = min(chunk_sizes[(step + i) % len(chunk_sizes)], len(s) - done[i])
                items.append(WorkItem(s[done[i]:done[i] + n], done[i], tables[i]))
                owners.append((i, done[i], n))
        batch, decode_only = runner.pack(items)
        kinds.add("decode" if decode_only else ("mixed" if any(n == 1 for *_, n in owners) else "prefill"))
        logits, pool = forward(params, jax.tree.map(jnp.asarray, batch), pool, CFG,
                               backend=backend, decode_only=decode_only, all_logits=True)
        logits = np.asarray(logits)
        for j, (i, start, n) in enumerate(owners):
            a = batch.cu_q_lens[j]
            got[i][start:start + n] = logits[a:a + n]
            done[i] += n
        step += 1
    return got, kinds


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("chunks", [(64,), (5, 16, 7), (1,), (9, 1, 1)],
                         ids=["prefill", "chunked", "decode", "mixed"])
def test_paged_logits_equal_dense(params, dense_logits, block_size, chunks):
    seqs, ref = dense_logits
    got, kinds = run_schedule(params, seqs, block_size, chunks, seed=block_size)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=0)
    if chunks == (1,):
        assert kinds == {"decode"}
    if chunks == (9, 1, 1):
        assert "mixed" in kinds


@pytest.mark.slow
@pytest.mark.parametrize("chunks", [(5, 16, 7), (9, 1, 1), (1,)], ids=["chunked", "mixed", "decode"])
def test_fused_gpu_layers_equal_dense(params, dense_logits, chunks):
    """The GPU backend's path (Pallas kernels in interpret mode): attention, and the fused
    layer kernels it brings (residual add + norm, RoPE + KV-page write, split combine), on
    the weights in the serving layout the engine runs (one q/k/v matmul, one gate/up)."""
    seqs, ref = dense_logits
    got, kinds = run_schedule(fuse_projections(params), seqs, 8, chunks, seed=3,
                              backend="pallas")
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=0)
    assert "decode" in kinds or "mixed" in kinds

"""Thin matmuls as split-K partial sums (`paxkv.model.split_k`): the partials add up to the
plain product, the plan applies only to thin fused steps, and the fused forward of a thin
step is the same with and without the split."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv.model import split_k
from paxkv.model.split_k import NO_SPLIT, SplitK


@pytest.mark.parametrize("lead", [(3,), (2, 5)])
@pytest.mark.parametrize("splits", [2, 4])
def test_partials_add_up_to_the_product(lead, splits):
    rng = np.random.default_rng(splits + len(lead))
    x = jnp.asarray(rng.standard_normal((*lead, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 24)), jnp.float32)
    y = split_k.matmul(x, w, splits)
    assert isinstance(y, SplitK) and y.partials.shape == (splits, *lead, 24)
    assert y.partials.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(y.total(jnp.float32)), want, rtol=1e-4, atol=1e-4)
    # each partial is its own K slice
    k = 64 // splits
    np.testing.assert_allclose(np.asarray(y.partials[1]),
                               np.asarray(x)[..., k:2 * k] @ np.asarray(w)[k:2 * k],
                               rtol=1e-4, atol=1e-4)


def test_no_split_when_it_does_not_divide_k():
    x, w = jnp.ones((2, 30), jnp.bfloat16), jnp.ones((30, 8), jnp.bfloat16)
    for splits in (1, 4):
        y = split_k.matmul(x, w, splits)
        assert not isinstance(y, SplitK) and y.dtype == jnp.bfloat16


def test_plan_only_for_thin_fused_steps():
    assert split_k.plan(8, enabled=False) == NO_SPLIT
    assert split_k.plan(split_k.THIN_ROWS + 1, enabled=True) == NO_SPLIT
    thin = split_k.plan(split_k.THIN_ROWS, enabled=True)
    assert thin != NO_SPLIT and thin._asdict() == split_k.SPLITS


def test_take_rows_of_partials():
    p = SplitK(jnp.arange(2 * 6 * 4, dtype=jnp.float32).reshape(2, 6, 4))
    at = jnp.asarray([5, 0])
    got = split_k.take_rows(p, at, 4)
    np.testing.assert_array_equal(np.asarray(got.partials), np.asarray(p.partials)[:, [5, 0]])
    np.testing.assert_array_equal(np.asarray(split_k.take_rows(p.partials[0], at, 4)),
                                  np.asarray(p.partials[0])[[5, 0]])


def test_thin_fused_step_is_the_same_without_the_split(monkeypatch):
    """One thin decode-shaped step on the fused path: logits and pool with the split-K
    partials equal those of the plain matmuls (float32 weights; only the sum order moves).
    The weights are in the serving layout, so q/k/v is one matmul that splits too."""
    from paxkv.cache import kv_pool as kvp
    from paxkv.config import ModelConfig
    from paxkv.model.batch import StepBatch
    from paxkv.model.fusion import fuse_projections
    from paxkv.model.llama import forward, init_params
    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                      max_position_embeddings=128)
    params = fuse_projections(init_params(cfg, jax.random.PRNGKey(3), jnp.float32))
    params = jax.tree.map(lambda a: a * 4.0 if a.ndim == 2 else a, params)
    rng = np.random.default_rng(0)
    block_size, num_blocks, seqs = 8, 12, 3
    pool = kvp.init_pool(cfg, num_blocks, block_size, jnp.float32)
    pool = pool._replace(k=tuple(jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in pool.k),
                         v=tuple(jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in pool.v))
    lens = np.array([5, 13, 21])            # context lengths ending mid-block
    tables = rng.permutation(np.arange(1, num_blocks))[:seqs * 3].reshape(seqs, 3)
    slots = tables[np.arange(seqs), (lens - 1) // block_size] * block_size + (lens - 1) % block_size
    batch = StepBatch(
        token_ids=jnp.asarray(rng.integers(0, cfg.vocab_size, seqs), jnp.int32),
        positions=jnp.asarray(lens - 1, jnp.int32),
        slot_mapping=jnp.asarray(slots, jnp.int32),
        block_tables=jnp.asarray(tables, jnp.int32),
        context_lens=jnp.asarray(lens, jnp.int32),
        cu_q_lens=jnp.asarray(np.arange(seqs + 1), jnp.int32),
        logits_indices=jnp.asarray(np.arange(seqs), jnp.int32))
    assert split_k.plan(seqs, True) != NO_SPLIT
    got = forward(params, batch, pool, cfg, backend="pallas", decode_only=True)
    monkeypatch.setattr(split_k, "SPLITS", {name: 1 for name in split_k.SPLITS})
    want = forward(params, batch, pool, cfg, backend="pallas", decode_only=True)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=2e-5, atol=2e-5)
    for g, w in zip(got[1].k + got[1].v, want[1].k + want[1].v):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)

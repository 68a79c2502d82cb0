"""Warming L2 with the next weight (`pallas_kernels.layer_ops.l2_prefetch`).

The plan (which chunks, how many programs) is checked on the host. The kernels that warm L2
must compute exactly what they compute without it, with the prefetch in their own programs'
tails and in programs of its own: in interpret mode they leave it out, so the kernel cases
below only say something compiled (`PAXKV_TEST_DEVICE=gpu`); the SwiGLU kernel, new with this
path, is checked against its reference everywhere.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.layer_ops import add_rms_norm, l2_prefetch
from pallas_kernels.layer_ops.swiglu import swiglu, swiglu_reference
from pallas_kernels.paged_attention import combine_splits_kernel


@pytest.fixture(params=["tail", "extra"], autouse=True)
def place(request, monkeypatch):
    """Every case with the prefetch issued by the work programs and by programs of its own
    (the kernels read PLACE when traced: their jit caches are cleared around each case)."""
    jax.clear_caches()
    monkeypatch.setattr(l2_prefetch, "PLACE", request.param)
    yield request.param
    jax.clear_caches()


def _chunks(p: l2_prefetch.PrefetchPlan) -> np.ndarray:
    """Every chunk index the plan's programs issue (spare lanes included)."""
    i = np.arange(p.programs * p.per_program)
    return l2_prefetch.chunk_index(np.minimum(i, p.count - 1), p)


@pytest.mark.parametrize("shape,budget,chunk", [
    ((4096, 6144), 16 << 20, 32 << 10),     # a part of the 8B q/k/v weight
    ((4096, 4096), 64 << 20, 32 << 10),     # more than the whole o weight
    ((14336, 4096), 8 << 20, 1 << 10),      # many small chunks
    ((96, 40), 5000, 256),                  # a weight of a few chunks
])
def test_plan_spreads_its_budget_over_the_whole_weight(shape, budget, chunk):
    w = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    total = np.prod(shape) * 2 // chunk
    p = l2_prefetch.plan(w, budget, chunk_bytes=chunk)
    assert p.count == min(total, budget // chunk) and p.bytes <= budget and p.total == total
    issued = np.unique(_chunks(p))
    assert len(issued) == p.count                                # distinct chunks
    assert issued.min() == 0 and issued.max() < total            # inside the weight
    gaps = np.diff(np.append(issued, total))
    assert gaps.max() - gaps.min() <= 1                          # evenly spread to its end
    assert p.per_program & (p.per_program - 1) == 0              # a Triton block
    assert (p.programs - 1) * p.per_program < p.count <= p.programs * p.per_program


def test_plan_is_none_without_budget_and_refuses_odd_chunks():
    w = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    assert l2_prefetch.plan(w, 0) is None
    assert l2_prefetch.plan(w, 100, chunk_bytes=1024) is None    # under one chunk
    with pytest.raises(ValueError, match="chunk_bytes"):
        l2_prefetch.plan(w, 1 << 20, chunk_bytes=48)


def test_budget_only_for_small_steps_where_enabled(monkeypatch):
    monkeypatch.setattr(l2_prefetch, "ENABLED", True)
    assert l2_prefetch.budget("o", 1) == l2_prefetch.BUDGETS["o"]
    assert l2_prefetch.budget("o", l2_prefetch.MAX_ROWS + 1) == 0
    assert l2_prefetch.budget("unknown", 1) == 0
    monkeypatch.setattr(l2_prefetch, "ENABLED", False)
    assert l2_prefetch.budget("o", 1) == 0
    assert l2_prefetch.extra_rows(None) == 0
    p = l2_prefetch.plan(jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16), 32 << 20)
    assert l2_prefetch.extra_rows(p, (8, 8)) * 64 >= p.programs


def _weight(rng, shape=(512, 384)):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


@pytest.mark.parametrize("rows", [1, 8])
def test_norm_kernel_with_prefetch_programs_computes_the_same(rows, interpret):
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 1024)), jnp.bfloat16)
    res = jnp.asarray(rng.standard_normal((rows, 1024)), jnp.bfloat16)
    scale = jnp.asarray(rng.standard_normal(1024), jnp.bfloat16)
    want = add_rms_norm(x, res, scale, eps=1e-5, interpret=interpret)
    got = add_rms_norm(x, res, scale, eps=1e-5, interpret=interpret, prefetch=_weight(rng),
                       prefetch_bytes=1 << 18)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lead,inter", [((1,), 96), ((8,), 14336 // 64), ((2, 3), 4096)])
def test_swiglu_kernel_matches_reference(dtype, lead, inter, interpret):
    rng = np.random.default_rng(inter)
    gate_up = jnp.asarray(rng.standard_normal((*lead, 2 * inter)) * 3, dtype)
    want = swiglu_reference(gate_up)
    for kwargs in ({}, {"prefetch": _weight(rng), "prefetch_bytes": 1 << 18}):
        got = swiglu(gate_up, interpret=interpret, **kwargs)
        assert got.shape == (*lead, inter) and got.dtype == dtype
        # the same operations and roundings; the exponentials differ in their last bits
        tol = 1e-6 if dtype == jnp.float32 else 8e-3
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=tol, atol=tol)


def test_split_combine_with_prefetch_computes_the_same(interpret):
    rng = np.random.default_rng(5)
    o_part = jnp.asarray(rng.standard_normal((3, 4, 8, 32)), jnp.float32)
    lse = jnp.asarray(rng.standard_normal((3, 4, 8)) * 4, jnp.float32)
    want = combine_splits_kernel(o_part, lse, out_dtype=jnp.bfloat16, interpret=interpret)
    got = combine_splits_kernel(o_part, lse, out_dtype=jnp.bfloat16, interpret=interpret,
                                prefetch=_weight(rng), prefetch_bytes=1 << 18)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

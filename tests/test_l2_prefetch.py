"""The L2 prefetch kernel (`pallas_kernels.layer_ops.l2_prefetch`): its plan on the host, and,
compiled on a GPU (`PAXKV_TEST_DEVICE=gpu`), that it runs, writes its zero token, and leaves
the weight as it was."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.layer_ops import l2_prefetch


def _issued(p: l2_prefetch.PrefetchPlan) -> np.ndarray:
    i = np.arange(p.programs * p.per_program)
    return np.asarray(l2_prefetch.chunk_index(np.minimum(i, p.count - 1), p))


@pytest.mark.parametrize("order", ["head", "spread"])
@pytest.mark.parametrize("shape,budget,chunk", [
    ((4096, 6144), 16 << 20, 32 << 10),     # part of the 8B q/k/v weight
    ((4096, 4096), 64 << 20, 32 << 10),     # more than the whole o weight
    ((14336, 4096), 8 << 20, 1 << 10),      # many small chunks
    ((96, 40), 5000, 256),                  # a weight of a few chunks
])
def test_plan_covers_its_budget_inside_the_weight(shape, budget, chunk, order):
    w = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    total = np.prod(shape) * 2 // chunk
    p = l2_prefetch.plan(w, budget, chunk_bytes=chunk, order=order)
    assert p.count == min(total, budget // chunk) and p.bytes <= budget and p.total == total
    issued = np.unique(_issued(p))
    assert len(issued) == p.count and issued.min() == 0 and issued.max() < total
    if order == "head":
        np.testing.assert_array_equal(issued, np.arange(p.count))
    else:
        gaps = np.diff(np.append(issued, total))
        assert gaps.max() - gaps.min() <= 1
    assert p.per_program & (p.per_program - 1) == 0
    assert (p.programs - 1) * p.per_program < p.count <= p.programs * p.per_program


def test_plan_refuses_bad_settings_and_is_none_without_budget():
    w = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    assert l2_prefetch.plan(w, 0) is None
    assert l2_prefetch.plan(w, 100, chunk_bytes=1024) is None
    with pytest.raises(ValueError, match="chunk_bytes"):
        l2_prefetch.plan(w, 4096, chunk_bytes=1000)
    with pytest.raises(ValueError, match="order"):
        l2_prefetch.plan(w, 4096, order="tail")


@pytest.mark.parametrize("shape,budget", [((1024, 768), 1 << 20), ((4096, 4096), 64 << 20)])
def test_prefetch_kernel_leaves_the_weight_and_returns_zero(shape, budget, interpret):
    rng = np.random.default_rng(0)
    host = rng.standard_normal(shape).astype(np.float32)
    w = jnp.asarray(host, jnp.bfloat16)
    after = jnp.asarray(rng.standard_normal((8, 48, 128)), jnp.bfloat16)
    p = l2_prefetch.plan(w, budget)
    token = l2_prefetch.prefetch_to_l2(w, after, p=p, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(token), np.zeros(1, np.int32))
    np.testing.assert_array_equal(np.asarray(w, np.float32),
                                  np.asarray(jnp.asarray(host, jnp.bfloat16), np.float32))

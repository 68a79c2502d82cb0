"""The MoE grouped matmul kernel against its jnp reference and XLA's ragged_dot, on fresh random
inputs: empty experts, runs that end mid-tile, columns that end mid-block, one expert holding
every row. `PAXKV_TEST_DEVICE=gpu` runs the compiled kernel."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference, tile_list
from pallas_kernels.grouped_matmul import tuning


def _case(seed, sizes, k, n, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    m = int(sum(sizes))
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("sizes,k,n,tiles", [
    ([0, 1, 0, 0, 0, 1, 0, 0], 64, 96, dict(block_m=16, block_n=32, block_k=32)),      # decode
    ([10, 0, 20, 7], 128, 80, dict(block_m=16, block_n=32, block_k=64)),             # n mid-block
    ([0, 0, 45], 64, 64, dict(block_m=32, block_n=64, block_k=16)),                  # one expert
    ([40, 0, 100, 60, 0, 50, 30, 20], 256, 128, dict(block_m=64, block_n=128, block_k=64)),
])
def test_kernel_matches_reference(interpret, sizes, k, n, tiles):
    x, w, g = _case(sum(sizes) + k, sizes, k, n)
    got = grouped_matmul(x, w, g, interpret=interpret, num_warps=4, num_stages=2, **tiles)
    want = grouped_matmul_reference(x, w, g)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    xla = jax.lax.ragged_dot(x, w, g)
    np.testing.assert_allclose(np.asarray(got), np.asarray(xla), rtol=2e-5, atol=2e-5)


def test_bf16_rows_past_the_runs_are_zero(interpret):
    """bf16 operands, float32 accumulation; M larger than the runs (padding rows) gives 0 there."""
    x, w, g = _case(3, [5, 0, 12], 64, 64, jnp.bfloat16)
    x = jnp.concatenate([x, jnp.ones((7, 64), jnp.bfloat16)])
    got = grouped_matmul(x, w, g, block_m=16, block_n=64, block_k=32, interpret=interpret)
    want = grouped_matmul_reference(x, w, g)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-2, atol=1e-2)
    assert not np.asarray(got[17:], np.float32).any()


def test_tile_list_covers_each_run_once():
    sizes = np.array([0, 33, 16, 0, 1, 70], np.int32)
    bm = 16
    expert, first, end = (np.asarray(a) for a in tile_list(jnp.asarray(sizes), int(sizes.sum()), bm))
    assert len(expert) == -(-sizes.sum() // bm) + len(sizes)
    covered = np.zeros(sizes.sum(), np.int32)
    starts = np.cumsum(sizes) - sizes
    for e, a, b in zip(expert, first, end):
        if b > a:
            assert b - a <= bm and starts[e] <= a and b <= starts[e] + sizes[e]
            covered[a:b] += 1
    assert (covered == 1).all()
    assert sum(1 for a, b in zip(first, end) if b > a) == sum(-(-s // bm) for s in sizes)


def test_moe_backends_agree(interpret):
    """`paxkv.model.moe.grouped_matmul`: the Pallas backend equals XLA's ragged_dot."""
    from paxkv.model.moe import grouped_matmul as moe_gmm
    x, w, g = _case(11, [3, 0, 9, 4], 64, 48)
    np.testing.assert_allclose(np.asarray(moe_gmm(x, w, g, backend="pallas")),
                               np.asarray(moe_gmm(x, w, g, backend="xla")), rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="backend"):
        moe_gmm(x, w, g, backend="triton")


def test_tuning_pick_first_match():
    a, b = tuning.Tiles(16, 64, 128), tuning.Tiles(64, 128, 64)
    table = (tuning.Winner(a, 1, 16), tuning.Winner(b, 17, 512))
    assert tuning.pick(2, table) == a and tuning.pick(17, table) == b
    assert tuning.pick(513, table) is None


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_m=8), "block_m"), (dict(block_k=48), "block_k"), (dict(block_k=256), "multiple"),
])
def test_bad_tiles_are_refused(kwargs, match):
    x, w, g = _case(0, [2, 2], 64, 32)
    with pytest.raises(ValueError, match=match):
        grouped_matmul(x, w, g, interpret=True, **kwargs)

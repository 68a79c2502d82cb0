"""The thin Mosaic GPU matmul against jnp on fresh random inputs: row counts that are not a
multiple of 8, tilings with several blocks and pipeline depths both below and above the
number of K steps, PDL on and off (on the CPU, in Mosaic's interpret mode, JAX >= 0.12)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.layer_ops.mosaic_gemv import thin_matmul, thin_matmul_reference


@pytest.mark.parametrize("warp_specialized", [False, True], ids=["one_wg", "producer_wg"])
@pytest.mark.parametrize("rows,k,n,tile_n,tile_k,stages,pdl", [
    (1, 256, 96, 48, 128, 2, True),
    (8, 512, 64, 32, 64, 3, True),
    (8, 1280, 64, 32, 128, 3, True),     # K steps not a multiple of the stages
    (5, 384, 128, 64, 64, 8, False),     # more stages than K steps
    (13, 256, 48, 16, 128, 1, True),     # two row tiles of 8, one stage
])
def test_thin_matmul_matches_reference(interpret_mosaic, rows, k, n, tile_n, tile_k, stages, pdl,
                                       warp_specialized):
    key = jax.random.PRNGKey(rows * 1000 + k + n)
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (rows, k), jnp.float32).astype(jnp.bfloat16)
    w_t = (jax.random.normal(kw, (n, k), jnp.float32) * 0.05).astype(jnp.bfloat16)
    got = thin_matmul(x, w_t, tile_n=tile_n, tile_k=tile_k, num_stages=stages, pdl=pdl,
                      warp_specialized=warp_specialized, interpret=interpret_mosaic)
    want = thin_matmul_reference(x, w_t)
    assert got.shape == (rows, n) and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("field,kwargs,match", [
    ("tile_n", dict(tile_n=40), "tile_n"),
    ("tile_k", dict(tile_n=32, tile_k=96), "tile_k"),
])
def test_thin_matmul_refuses_bad_tiling(field, kwargs, match):
    x = jnp.zeros((8, 256), jnp.bfloat16)
    w_t = jnp.zeros((64, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        thin_matmul(x, w_t, interpret=True, **kwargs)


def test_thin_matmul_refuses_too_many_rows():
    with pytest.raises(ValueError, match="rows"):
        thin_matmul(jnp.zeros((65, 256), jnp.bfloat16), jnp.zeros((64, 256), jnp.bfloat16),
                    tile_n=32, interpret=True)

"""The Mosaic GPU residual add + RMSNorm (`layer_ops.mosaic_add_rms_norm`) against its jnp
reference on fresh random inputs: with and without the residual, float32 and bfloat16, PDL
and the early release on and off (compiled), several row counts and widths.

Compiled on a Hopper GPU (PAXKV_TEST_DEVICE=gpu); on the CPU in Mosaic GPU's interpret mode
(JAX >= 0.12), where PDL is off."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.layer_ops import add_rms_norm_reference
from pallas_kernels.layer_ops.mosaic_add_rms_norm import mosaic_add_rms_norm, supported


def _f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("lead,hidden", [((1,), 256), ((8,), 4096), ((2, 3), 384)])
@pytest.mark.parametrize("pdl,release", [(True, True), (True, False), (False, False)])
def test_mosaic_add_rms_norm_matches_reference(dtype, with_residual, lead, hidden, pdl, release,
                                               interpret_mosaic):
    if interpret_mosaic and (pdl, release) != (True, True):
        pytest.skip("PDL is off in interpret mode: the other settings run the same code")
    rng = np.random.default_rng(sum(lead) * 7 + hidden + with_residual)
    x = jnp.asarray(rng.standard_normal((*lead, hidden)) * 3, dtype)
    res = jnp.asarray(rng.standard_normal((*lead, hidden)), dtype) if with_residual else None
    scale = jnp.asarray(rng.standard_normal(hidden), dtype)
    total, normed = mosaic_add_rms_norm(x, res, scale, eps=1e-5, pdl=pdl, release=release,
                                        interpret=interpret_mosaic)
    want_total, want_normed = add_rms_norm_reference(x, res, scale, 1e-5)
    assert total.dtype == x.dtype and normed.dtype == scale.dtype
    assert total.shape == x.shape and normed.shape == x.shape
    np.testing.assert_array_equal(_f32(total), _f32(want_total))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2   # one bf16 rounding of the output
    np.testing.assert_allclose(_f32(normed), _f32(want_normed), rtol=tol, atol=tol)


def test_mosaic_add_rms_norm_rejects_widths_it_cannot_hold():
    assert supported(4096) and not supported(200) and not supported(128 * 257)
    x = jnp.zeros((2, 200), jnp.float32)
    with pytest.raises(ValueError, match="hidden width 200"):
        mosaic_add_rms_norm(x, None, jnp.ones(200), eps=1e-5, interpret=True)

"""The early release of the next kernel (`pallas_kernels.early_launch`): when it is emitted, and
that a chain of a releasing kernel and the XLA matmul it lets launch early computes what the
chain computes without it, on fresh random inputs (the compiled chain on a GPU with
`PAXKV_TEST_DEVICE=gpu`; on the CPU the release is interpreted as nothing)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import early_launch
from pallas_kernels.layer_ops import add_rms_norm, add_rms_norm_reference
from pallas_kernels.paged_attention import combine_splits, combine_splits_kernel


@pytest.fixture
def release_setting():
    """Restore the module's setting after a test changes it."""
    saved = early_launch.ENABLED
    yield
    early_launch.ENABLED = saved
    jax.clear_caches()


def test_enabled_follows_setting_and_mode(release_setting):
    early_launch.ENABLED = None
    assert early_launch.enabled(interpret=False) == (jax.default_backend() == "gpu")
    assert not early_launch.enabled(interpret=True)
    early_launch.ENABLED = True
    assert early_launch.enabled(interpret=False)
    assert not early_launch.enabled(interpret=True)   # the interpreter runs no GPU code
    early_launch.ENABLED = False
    assert not early_launch.enabled(interpret=False)


def _copy_releasing(x: jax.Array, interpret: bool) -> jax.Array:
    def kernel(x_ref, o_ref):
        early_launch.release_dependents(x_ref)
        o_ref[...] = x_ref[...] * 2

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
                          interpret=interpret)(x)


def test_release_changes_no_value(interpret):
    """The instruction inside a kernel, compiled on a GPU (discharged as nothing otherwise)."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 128)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(_copy_releasing(x, interpret)), np.asarray(x) * 2)


@pytest.mark.parametrize("release", [True, False])
def test_norm_then_matmul_equals_reference(release, interpret, release_setting):
    """add + RMSNorm releases the matmul that reads its output: the matmul still reads the
    finished output (8 rows, as at one decode stream, and 37, several blocks per SM)."""
    early_launch.ENABLED = release
    jax.clear_caches()
    rng = np.random.default_rng(1 + release)
    hidden, out = 1024, 3072

    @functools.partial(jax.jit, static_argnames="rows")
    def chain(x, res, scale, w, rows):
        del rows
        total, normed = add_rms_norm(x, res, scale, eps=1e-5, interpret=interpret)
        return total, jnp.dot(normed, w, preferred_element_type=jnp.float32)

    for rows in (8, 37):
        x = jnp.asarray(rng.standard_normal((rows, hidden)), jnp.bfloat16)
        res = jnp.asarray(rng.standard_normal((rows, hidden)), jnp.bfloat16)
        scale = jnp.asarray(rng.standard_normal(hidden), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((hidden, out)) / 32, jnp.bfloat16)
        total, y = chain(x, res, scale, w, rows)
        want_total, want_normed = add_rms_norm_reference(x, res, scale, 1e-5)
        want = jnp.dot(want_normed, w, preferred_element_type=jnp.float32)
        np.testing.assert_array_equal(np.asarray(total, np.float32),
                                      np.asarray(want_total, np.float32))
        np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=2e-2, atol=2e-2)


def test_combine_then_matmul_equals_reference(interpret, release_setting):
    """The split combine releases the o matmul after it."""
    early_launch.ENABLED = True
    jax.clear_caches()
    rng = np.random.default_rng(7)
    batch, splits, heads, head_dim = 3, 4, 32, 128
    o_part = jnp.asarray(rng.standard_normal((batch, splits, heads, head_dim)), jnp.float32)
    lse = jnp.asarray(rng.standard_normal((batch, splits, heads)) * 4, jnp.float32)
    lse = lse.at[1, 2].set(-jnp.inf)                    # an empty split
    w = jnp.asarray(rng.standard_normal((heads * head_dim, 512)) / 64, jnp.float32)

    @jax.jit
    def chain(o_part, lse, w):
        merged = combine_splits_kernel(o_part, lse, interpret=interpret)
        return jnp.dot(merged.reshape(batch, -1), w)

    want = jnp.dot(combine_splits(o_part, lse).reshape(batch, -1), w)
    np.testing.assert_allclose(np.asarray(chain(o_part, lse, w)), np.asarray(want),
                               rtol=1e-4, atol=1e-4)

"""The packed one-buffer transfers of a step's inputs and outputs (paxkv/transfer.py)."""
import jax
import numpy as np
import pytest

from paxkv.runner import transfer


def _arrays(rng):
    return [rng.integers(-2**31, 2**31 - 1, size=(7,), dtype=np.int64).astype(np.int32),
            rng.standard_normal((3, 5)).astype(np.float32),
            np.zeros((0, 4), np.int32),
            np.array([np.nan, -np.inf, 1e-38, -0.0], np.float32),
            rng.integers(0, 100, size=(2, 3, 2)).astype(np.int32)]


def test_host_to_device_round_trip_is_bit_exact():
    arrays = _arrays(np.random.default_rng(0))
    buf, spec = transfer.pack_host(arrays)
    assert buf.dtype == np.int32 and buf.ndim == 1
    out = jax.jit(transfer.unpack_device, static_argnums=1)(jax.device_put(buf), spec)
    for a, b in zip(arrays, out):
        b = np.asarray(b)
        assert b.dtype == a.dtype and b.shape == a.shape
        assert np.array_equal(a.view(np.int32), b.view(np.int32))   # NaN and -0.0 included


def test_device_to_host_round_trip_is_bit_exact():
    arrays = _arrays(np.random.default_rng(1))
    buf = jax.jit(transfer.pack_device)([jax.device_put(a) for a in arrays])
    out = transfer.unpack_host(np.asarray(buf), transfer.spec_of(arrays))
    for a, b in zip(arrays, out):
        assert b.dtype == a.dtype and b.shape == a.shape
        assert np.array_equal(a.view(np.int32), b.view(np.int32))


def test_other_dtypes_are_refused_by_name():
    with pytest.raises(ValueError, match="array 1 has dtype float64"):
        transfer.pack_host([np.zeros(2, np.int32), np.zeros(2, np.float64)])

"""Test-wide settings, deterministic.

By default the tests run on the CPU and the Pallas kernels in interpret mode. With
`PAXKV_TEST_DEVICE=gpu` JAX keeps its GPU, the `interpret` fixture turns False and the same
kernel tests assert the compiled kernels against their jnp references:

    PAXKV_TEST_DEVICE=gpu python3 -m pytest tests -k kernel
"""
import os
import shutil
import tempfile

import pytest

TEST_DEVICE = os.environ.get("PAXKV_TEST_DEVICE", "cpu").lower()
if TEST_DEVICE not in ("cpu", "gpu"):
    raise ValueError(f"PAXKV_TEST_DEVICE must be 'cpu' or 'gpu', got {TEST_DEVICE!r}")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
else:
    os.environ.setdefault("JAX_PLATFORMS", "cuda")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's compiled programs go to a directory of its own, shared with the servers it
# starts (they inherit the environment), never to the user's persistent cache.
_SUITE_CACHE = None
if "PAXKV_COMPILATION_CACHE_DIR" not in os.environ:
    _SUITE_CACHE = tempfile.mkdtemp(prefix="paxkv-tests-xla-")
    os.environ["PAXKV_COMPILATION_CACHE_DIR"] = _SUITE_CACHE

# Eight host-platform devices, for the tensor-parallel tests to run in this process (one set
# of compiled programs, no second interpreter). Everything else uses the default device, as
# on a machine with one CPU device, so no other test sees a difference.
_DEVICES = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES}".strip()
if TEST_DEVICE == "gpu":
    import jax

    # The jnp references are the truth: exact float32 products on the GPU too, rather than
    # the TF32 that XLA would otherwise pick for float32 dots.
    jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def on_gpu() -> bool:
    """Whether JAX runs on a GPU (only when asked for with PAXKV_TEST_DEVICE=gpu)."""
    import jax
    return jax.default_backend() == "gpu"


@pytest.fixture(scope="session")
def interpret(on_gpu) -> bool:
    """Pallas interpret mode off the GPU; compiled kernels on it."""
    return not on_gpu


@pytest.fixture(scope="session")
def tiny_llm():
    """One LLM on the embedded model shared by the sampling tests (engine_helpers)."""
    from engine_helpers import shared_tiny_llm
    return shared_tiny_llm()


@pytest.fixture(scope="session")
def tiny_hf():
    from engine_helpers import shared_tiny_hf
    return shared_tiny_hf()


def pytest_sessionfinish(session, exitstatus) -> None:
    if _SUITE_CACHE is not None:
        shutil.rmtree(_SUITE_CACHE, ignore_errors=True)

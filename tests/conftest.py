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
def interpret_mosaic(on_gpu) -> bool:
    """For the Mosaic GPU kernels: False (compiled) on a Hopper GPU, True on the CPU where JAX
    can interpret Mosaic GPU (from 0.12); skips elsewhere, with the reason."""
    import jax

    from pallas_kernels.paged_attention import mosaic_decode
    if on_gpu:
        cc = str(getattr(jax.devices()[0], "compute_capability", ""))
        if not cc.startswith("9"):
            pytest.skip(f"the Mosaic GPU kernels target Hopper (sm_90), not sm_{cc}")
        return False
    if mosaic_decode.interpret_params() is None:
        pytest.skip(f"Mosaic GPU has no CPU interpret mode in JAX {jax.__version__} (it has from "
                    "0.12); these tests run compiled on a Hopper GPU with PAXKV_TEST_DEVICE=gpu")
    return True


@pytest.fixture(scope="session")
def tiny_llm():
    """One LLM on the embedded model shared by the sampling tests (engine_helpers)."""
    from engine_helpers import shared_tiny_llm
    return shared_tiny_llm()


@pytest.fixture(scope="session")
def tiny_hf():
    from engine_helpers import shared_tiny_hf
    return shared_tiny_hf()


def _memory_maps() -> tuple[int, int] | None:
    """(memory maps of this process, the kernel's limit), where Linux says."""
    try:
        with open("/proc/self/maps") as f:
            count = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return count, int(f.read())
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Every XLA CPU executable stays loaded (about three memory maps each) for as long as
    JAX's caches hold it, and one process runs the whole suite: past the kernel's limit on
    memory maps (vm.max_map_count, 65530 by default) the next compilation cannot map its
    code and XLA crashes the process. After a module, once a third of the limit is used, the
    caches are dropped (programs the next modules share are compiled again)."""
    yield
    maps = _memory_maps()
    if maps is not None and maps[0] > maps[1] // 3:
        import gc

        import jax
        jax.clear_caches()
        gc.collect()


def pytest_sessionfinish(session, exitstatus) -> None:
    if _SUITE_CACHE is not None:
        shutil.rmtree(_SUITE_CACHE, ignore_errors=True)

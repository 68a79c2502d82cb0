"""Test-wide settings: CPU only (Pallas kernels run in interpret mode), deterministic."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llm():
    """One LLM on the embedded model shared by the sampling tests (engine_helpers)."""
    from engine_helpers import shared_tiny_llm
    return shared_tiny_llm()


@pytest.fixture(scope="session")
def tiny_hf():
    from engine_helpers import shared_tiny_hf
    return shared_tiny_hf()

"""Test-wide settings: CPU only (Pallas kernels run in interpret mode), deterministic."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

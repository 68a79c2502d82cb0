"""Test-wide settings: CPU only (Pallas kernels run in interpret mode), deterministic."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Eight host-platform devices, for the tensor-parallel tests to run in this process (one set
# of compiled programs, no second interpreter). Everything else uses the default device, as
# on a machine with one CPU device, so no other test sees a difference.
_DEVICES = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES}".strip()

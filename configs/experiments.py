"""Settings of the paper-style experiments, one frozen dataclass per experiment.

Every experiment has a "cpu" setting (minutes at most on a laptop-class CPU, what
`scripts/run_all.sh` runs by default) and, where it needs an accelerator, a "gpu" setting
(Llama-3-8B shapes with random bf16 weights on one NVIDIA H200). `get(experiment, setting)`
returns the settings; experiments can override single fields from flags.
"""
from __future__ import annotations

import dataclasses

MiB = 2**20
GiB = 2**30

# Memory as the driver reports it (nvidia-smi "total"), which is what a serving engine can
# ask for: an "H200 141 GB" has 143,771 MiB = 140.4 GiB.
GPUS: dict[str, int] = {
    "RTX 4090 (24 GB)": 24564 * MiB,
    "A100 (40 GB)": 40960 * MiB,
    "H100 (80 GB)": 81559 * MiB,
    "H200 (141 GB)": 143771 * MiB,
}


@dataclasses.dataclass(frozen=True)
class CapacitySettings:
    """The KV capacity planner over devices, models and KV dtypes (arithmetic; the gpu
    setting also allocates the planned pool on the device to check the plan)."""

    models: tuple[str, ...] = ("llama3-8b",)
    gpus: tuple[str, ...] = tuple(GPUS)
    weight_dtype_bytes: float = 2.0                   # bf16 weights
    # (model, gpu, weight bytes) plans outside the grid: Llama-3-70B only fits one device
    # with 8-bit weights, and only the H200.
    extra_plans: tuple[tuple[str, str, float], ...] = (("llama3-70b", "H200 (141 GB)", 1.0),)
    kv_dtypes: tuple[tuple[str, float], ...] = (("bf16", 2.0), ("fp8", 1.0))
    block_size: int = 16
    # Two budgets: the whole device (the back-of-envelope worked example), and the engine's
    # default of 90% of the device minus a reserve for activations and compiler scratch.
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: int = 1 * GiB
    # The sequence length the "concurrent sequences" column is computed for.
    seq_len: int = 2048
    # gpu setting only: measure weights and allocate the planned pool on the device.
    measure_on_device: bool = False
    device_model: str = "llama3-8b"


@dataclasses.dataclass(frozen=True)
class KVUtilizationSettings:
    """Share of reserved KV memory holding real token states, by simulation of the scheduler."""

    # (trace, number of requests). Alpaca's requests are short: more of them keep the server
    # saturated for long enough to measure its steady state.
    traces: tuple[tuple[str, int], ...] = (("sharegpt", 2000), ("alpaca", 6000))
    seed: int = 0
    block_sizes: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    # Static reservation baselines: to max_model_len ("max", the engine's static policy),
    # to the next power of two of the final length ("pow2") and to the final length
    # itself ("oracle"), the paper's three Orca variants.
    static_policies: tuple[str, ...] = ("max", "pow2", "oracle")
    max_model_len: int = 2048
    # KV pool size in token slots: about the KV room of the paper's setting (OPT-13B on an
    # A100-40GB: 14,503 tokens by experiments/capacity.py), so memory, not the batch-size
    # cap, limits the batch, as in the paper. The shares measured hardly depend on it.
    pool_tokens: int = 14336
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # The block size whose utilization is the headline "paged" figure (vLLM's default).
    headline_block_size: int = 16


SETTINGS: dict[str, dict[str, object]] = {
    "capacity": {
        "cpu": CapacitySettings(),
        "gpu": CapacitySettings(measure_on_device=True),
    },
    "kv_utilization": {
        "cpu": KVUtilizationSettings(),
        # Tiny: a smoke test of the whole program in seconds.
        "tiny": KVUtilizationSettings(traces=(("sharegpt", 60), ("alpaca", 60)), block_sizes=(16, 256),
                                      pool_tokens=6144, max_num_seqs=16),
    },
}


def get(experiment: str, setting: str):
    """The settings of `experiment` at `setting` ("cpu", "gpu", "tiny")."""
    if experiment not in SETTINGS:
        raise ValueError(f"experiment {experiment!r} has no settings ({sorted(SETTINGS)})")
    table = SETTINGS[experiment]
    if setting not in table:
        raise ValueError(f"experiment {experiment!r} has no setting {setting!r} ({sorted(table)})")
    return table[setting]

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

    # Mixtral-8x7B's bf16 weights (93 GB) fit only the H200; Qwen3-30B-A3B's (61 GB) an H100 too.
    models: tuple[str, ...] = ("llama3-8b", "mixtral-8x7b", "qwen3-30b-a3b")
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
    # Tensor-parallel planning: these models split over 1..8 of these devices (bf16 weights).
    tp_models: tuple[str, ...] = ("llama3-8b", "llama3-70b", "mixtral-8x7b")
    tp_sizes: tuple[int, ...] = (1, 2, 4, 8)
    tp_gpu: str = "H200 (141 GB)"


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


@dataclasses.dataclass(frozen=True)
class EngineGeometry:
    """The engine every serving experiment builds: model, KV pool and batching limits.

    The pool is given in token slots and keeps that capacity whatever the block size
    (`pool_tokens // block_size` blocks plus the null block).
    """

    model: str = "tiny"                  # "tiny" (embedded, CPU) or "llama3-8b" (random bf16 weights)
    dtype: str = "float32"
    block_size: int = 16
    pool_tokens: int = 2048
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int = 512
    seed: int = 0


# One geometry for the CPU settings and one for the GPU settings, shared by the serving
# experiments so that their figures can be read together (and, on the GPU, so that programs
# compiled by one experiment are found in the persistent compilation cache by the next).
CPU_ENGINE = EngineGeometry()
GPU_ENGINE = EngineGeometry(model="llama3-8b", dtype="bfloat16")
TINY_ENGINE = EngineGeometry(pool_tokens=512, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)


@dataclasses.dataclass(frozen=True)
class ThroughputVsRateSettings:
    """Normalized latency against Poisson request rate: continuous batching with paging
    against the static request-level policy (paper Fig. 12)."""

    engine: EngineGeometry = CPU_ENGINE
    trace: str = "alpaca"
    max_prompt_len: int = 64             # the trace is clipped to fit max_model_len
    max_output_len: int = 192
    rates: tuple[float, ...] = (2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0)   # requests/s
    window_s: float = 3.0                # arrivals span this long at every rate ...
    min_requests: int = 8                # ... or long enough for this many requests
    drain_s: float = 3.0                 # cut a run off this long after its last arrival
    # Warm-up before timing: this many requests of the busiest trace, queued at once.
    warmup_requests: int = 32
    policies: tuple[str, ...] = ("continuous", "static")
    # A rate is sustained while the mean normalized latency stays under a multiple of the
    # continuous engine's latency at the lowest rate (its unloaded latency per token). Past
    # its capacity a server's queue, and so its latency, grows for as long as arrivals
    # last; with windows of seconds the growth is finite, so two multiples are reported.
    latency_threshold_factors: tuple[float, ...] = (5.0, 10.0)
    seed: int = 0
    time_budget_s: float | None = 600.0  # a safety net on a CPU; the gpu settings set their own


@dataclasses.dataclass(frozen=True)
class TraceLoad:
    """One trace of the batched-requests experiment: its clipping and the rates it runs at."""

    trace: str
    max_prompt_len: int
    max_output_len: int
    rates: tuple[float, ...]
    bar_rate: float                      # the rate whose mean batch is drawn as bars (paper Fig. 13)


@dataclasses.dataclass(frozen=True)
class BatchedRequestsSettings:
    """Single-sequence serving of a ShareGPT-like and an Alpaca-like trace: latency against
    rate and the number of requests batched together, continuous against static (paper
    Figs. 12-13: it batches at 2 requests/s of ShareGPT and 30/s of Alpaca for OPT-13B)."""

    engine: EngineGeometry = CPU_ENGINE
    # On a CPU requests are clipped short (ShareGPT-like 128 / 64, Alpaca-like 64 / 64) so that
    # a busy two-core machine serves one in a second or two; the GPU setting keeps 256 / 256
    # and 64 / 192.
    loads: tuple[TraceLoad, ...] = (
        TraceLoad("sharegpt", 128, 64, (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0), 2.0),
        TraceLoad("alpaca", 64, 64, (1.0, 2.0, 4.0, 8.0, 16.0), 8.0))
    window_s: float = 4.0                # arrivals span this long at every rate ...
    min_requests: int = 3                # ... or long enough for this many requests
    drain_s: float = 6.0                 # cut a run off this long after its last arrival
    warmup_requests: int = 16
    policies: tuple[str, ...] = ("continuous", "static")
    latency_threshold_factors: tuple[float, ...] = (5.0, 10.0)
    seed: int = 0
    time_budget_s: float | None = 600.0


@dataclasses.dataclass(frozen=True)
class SamplingVsRateSettings:
    """Parallel sampling (n samples) and beam search (width W) under Poisson load, continuous
    against static (paper Fig. 14, Alpaca)."""

    # max_model_len 256 (the clipped trace fits it): the static policy reserves 256 per sequence.
    engine: EngineGeometry = dataclasses.replace(CPU_ENGINE, max_model_len=256)
    trace: str = "alpaca"
    max_prompt_len: int = 64
    max_output_len: int = 48             # the GPU setting: 192
    parallel_n: tuple[int, ...] = (2, 4, 6)
    beam_widths: tuple[int, ...] = (2, 4, 6)
    temperature: float = 0.8             # parallel samples: random sampling, per-request seeds
    rates: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)
    window_s: float = 3.0
    min_requests: int = 3
    drain_s: float = 5.0
    warmup_requests: int = 8
    policies: tuple[str, ...] = ("continuous", "static")
    latency_threshold_factors: tuple[float, ...] = (5.0, 10.0)
    seed: int = 0
    time_budget_s: float | None = 900.0


@dataclasses.dataclass(frozen=True)
class SharedPrefixSettings:
    """A translation workload whose prompts all start with the same few-shot prefix (paper
    Fig. 16: 1 example, 80 tokens; 5 examples, 341 tokens), with prefix caching on and off."""

    engine: EngineGeometry = CPU_ENGINE
    prefixes: tuple[tuple[str, int], ...] = (("1-shot", 80), ("5-shot", 341))
    max_sentence_len: int = 64           # the request's own part, after the prefix
    max_output_len: int = 24             # the GPU setting: 64
    rates: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 16.0)
    window_s: float = 3.0
    min_requests: int = 4
    drain_s: float = 5.0
    warmup_requests: int = 16
    # "prefix caching": continuous batching, the prefix's blocks computed once and shared;
    # "no prefix caching": the same engine computing and holding it for every request;
    # "static": the request-level baseline (no caching).
    policies: tuple[str, ...] = ("prefix caching", "no prefix caching", "static")
    latency_threshold_factors: tuple[float, ...] = (5.0, 10.0)
    seed: int = 0
    time_budget_s: float | None = 600.0


@dataclasses.dataclass(frozen=True)
class ChatbotSettings:
    """A chatbot: the conversation so far is the prompt, cut to its last tokens (paper
    Fig. 17: long prompts, short answers), continuous against static."""

    engine: EngineGeometry = CPU_ENGINE
    # History kept: half the model length, as the paper keeps the last 1,024 tokens for a
    # 2,048-token model. Answers are clipped shorter on a CPU (24) than on the GPU (128).
    max_prompt_len: int = 256
    max_output_len: int = 24
    mean_prior_turns: float = 2.0
    rates: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
    window_s: float = 4.0
    min_requests: int = 3
    drain_s: float = 6.0
    warmup_requests: int = 12
    policies: tuple[str, ...] = ("continuous", "static")
    latency_threshold_factors: tuple[float, ...] = (5.0, 10.0)
    seed: int = 0
    time_budget_s: float | None = 600.0


@dataclasses.dataclass(frozen=True)
class BlockSizeSettings:
    """Throughput and latency against block size at a fixed pool capacity (paper Fig. 18b)."""

    engine: EngineGeometry = CPU_ENGINE
    # (trace, number of requests); all queued at once.
    traces: tuple[tuple[str, int], ...] = (("sharegpt", 16), ("alpaca", 48))
    max_prompt_len: int = 256
    max_output_len: int = 256
    # Run in this order (the rest is skipped once the time budget runs out).
    block_sizes: tuple[int, ...] = (16, 256, 64, 8, 128, 32)
    seed: int = 0
    time_budget_s: float | None = 600.0  # a safety net on a CPU; the gpu settings set their own


@dataclasses.dataclass(frozen=True)
class SharingSettings:
    """Memory saved by sharing KV blocks among parallel samples and beams (paper Fig. 15),
    and the throughput it buys in a fixed pool."""

    # A pool that binds before the batch-slot limit does, with room for a few requests'
    # groups (a group of samples or beams is preempted together).
    engine: EngineGeometry = dataclasses.replace(CPU_ENGINE, pool_tokens=1024, max_model_len=256)
    trace: str = "alpaca"
    num_requests: int = 16
    max_prompt_len: int = 64
    max_output_len: int = 192
    parallel_n: tuple[int, ...] = (2, 4, 6)
    beam_widths: tuple[int, ...] = (2, 4, 6)
    temperature: float = 0.8             # parallel samples: random sampling, per-sample seeds
    seed: int = 0
    time_budget_s: float | None = 600.0  # a safety net on a CPU; the gpu settings set their own


@dataclasses.dataclass(frozen=True)
class PreemptionSettings:
    """Recomputation against swapping across block sizes, in a pool small enough that
    requests are preempted often (paper Fig. 19)."""

    engine: EngineGeometry = CPU_ENGINE
    trace: str = "sharegpt"
    num_requests: int = 16
    max_prompt_len: int = 192
    max_output_len: int = 192
    block_sizes: tuple[int, ...] = (16, 256, 64, 8, 128, 32)
    modes: tuple[str, ...] = ("recompute", "swap")
    swap_space_gib: float = 1.0
    seed: int = 0
    time_budget_s: float | None = 600.0  # a safety net on a CPU; the gpu settings set their own


@dataclasses.dataclass(frozen=True)
class KernelOverheadSettings:
    """Paged against contiguous decode attention (paper Fig. 18a: 20-26% kernel overhead)."""

    # (batch, context) decode shapes; Llama-3-8B's attention: 32 query / 8 KV heads, d=128.
    shapes: tuple[tuple[int, int], ...] = ((4, 256), (8, 512), (16, 256))
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "float32"
    # "reference" (jnp gather through the block tables, any machine) or "pallas" (the GPU kernel).
    backends: tuple[str, ...] = ("reference",)
    reps: int = 20
    # The kernel benchmark's results (scripts/bench_kernels.py), read when present.
    kernels_json: str = "results/kernels.json"
    seed: int = 0


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
    # Serving experiments: "cpu" runs the embedded tiny model on the CPU (minutes); "gpu"
    # runs Llama-3-8B shapes with random bf16 weights on one NVIDIA H200 (about a minute
    # or two each, compilation included; points are run in priority order and the rest
    # skipped past the time budget); "tiny" is the smoke test of the program (seconds).
    "throughput_vs_rate": {
        "cpu": ThroughputVsRateSettings(),
        "gpu": ThroughputVsRateSettings(engine=GPU_ENGINE, rates=(1.0, 2.0, 4.0, 8.0, 16.0, 32.0),
                                        window_s=2.0, min_requests=6, drain_s=2.0, time_budget_s=130.0),
        "tiny": ThroughputVsRateSettings(engine=TINY_ENGINE, max_prompt_len=16, max_output_len=16,
                                         rates=(8.0, 32.0), window_s=0.25, min_requests=4, drain_s=1.0,
                                         warmup_requests=8, time_budget_s=None),
    },
    # The latency-against-load figures beyond Fig. 12 (experiments/load_sweep.py). Their GPU
    # settings each fit one 10-minute call or resume across calls (--resume_from).
    "batched_requests": {
        "cpu": BatchedRequestsSettings(),
        "gpu": BatchedRequestsSettings(
            engine=GPU_ENGINE, loads=(TraceLoad("sharegpt", 256, 256, (0.5, 1.0, 2.0, 4.0, 8.0), 2.0),
                                      TraceLoad("alpaca", 64, 192, (2.0, 8.0, 16.0, 32.0, 64.0), 32.0)),
            window_s=2.0, min_requests=4, drain_s=3.0, time_budget_s=420.0),
        "tiny": BatchedRequestsSettings(
            engine=TINY_ENGINE,
            loads=(TraceLoad("sharegpt", 24, 12, (4.0,), 4.0), TraceLoad("alpaca", 16, 12, (8.0,), 8.0)),
            window_s=0.25, min_requests=3, drain_s=1.0, warmup_requests=4, time_budget_s=None),
    },
    "sampling_vs_rate": {
        "cpu": SamplingVsRateSettings(),
        "gpu": SamplingVsRateSettings(engine=dataclasses.replace(GPU_ENGINE, max_model_len=256), max_output_len=192,
                                      rates=(1.0, 2.0, 4.0, 8.0, 16.0), window_s=2.0, min_requests=4, drain_s=3.0,
                                      time_budget_s=420.0),
        "tiny": SamplingVsRateSettings(engine=dataclasses.replace(TINY_ENGINE, pool_tokens=512, max_num_seqs=8),
                                       max_prompt_len=16, max_output_len=10, parallel_n=(2,), beam_widths=(2,),
                                       rates=(8.0,), window_s=0.25, min_requests=3, drain_s=1.0,
                                       warmup_requests=2, time_budget_s=None),
    },
    "shared_prefix": {
        "cpu": SharedPrefixSettings(),
        "gpu": SharedPrefixSettings(engine=GPU_ENGINE, max_output_len=64, rates=(4.0, 8.0, 16.0, 32.0, 64.0),
                                    window_s=2.0, min_requests=6, drain_s=2.0, time_budget_s=420.0),
        "tiny": SharedPrefixSettings(engine=dataclasses.replace(TINY_ENGINE, pool_tokens=256,
                                                                max_num_batched_tokens=128),
                                     prefixes=(("1-shot", 40),), max_sentence_len=12, max_output_len=8,
                                     rates=(8.0,), window_s=0.25, min_requests=4, drain_s=1.0,
                                     warmup_requests=4, time_budget_s=None),
    },
    "chatbot": {
        "cpu": ChatbotSettings(),
        "gpu": ChatbotSettings(engine=GPU_ENGINE, max_output_len=128, rates=(0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0),
                               window_s=2.0, min_requests=4, drain_s=3.0, time_budget_s=420.0),
        "tiny": ChatbotSettings(engine=TINY_ENGINE, max_prompt_len=64, max_output_len=8, rates=(4.0,), window_s=0.25,
                                min_requests=3, drain_s=1.0, warmup_requests=3, time_budget_s=None),
    },
    "block_size_ablation": {
        "cpu": BlockSizeSettings(),
        "gpu": BlockSizeSettings(engine=GPU_ENGINE, traces=(("sharegpt", 8), ("alpaca", 16)),
                                 block_sizes=(16, 256, 64, 8, 128, 32), time_budget_s=110.0),
        "tiny": BlockSizeSettings(engine=TINY_ENGINE, traces=(("sharegpt", 3), ("alpaca", 4)),
                                  max_prompt_len=24, max_output_len=16, block_sizes=(16, 64)),
    },
    "sharing_savings": {
        "cpu": SharingSettings(),
        "gpu": SharingSettings(engine=dataclasses.replace(GPU_ENGINE, pool_tokens=1024, max_model_len=256),
                               num_requests=8, time_budget_s=100.0),
        "tiny": SharingSettings(engine=TINY_ENGINE, num_requests=2, max_prompt_len=20, max_output_len=12,
                                parallel_n=(2,), beam_widths=(2,)),
    },
    "preemption": {
        "cpu": PreemptionSettings(),
        "gpu": PreemptionSettings(engine=GPU_ENGINE, num_requests=12, block_sizes=(16, 256, 64, 8, 128, 32),
                                  swap_space_gib=4.0, time_budget_s=90.0),
        "tiny": PreemptionSettings(engine=dataclasses.replace(TINY_ENGINE, pool_tokens=128), num_requests=4,
                                   max_prompt_len=24, max_output_len=40, block_sizes=(16,), swap_space_gib=0.01),
    },
    "kernel_overhead": {
        "cpu": KernelOverheadSettings(),
        "gpu": KernelOverheadSettings(shapes=((32, 1024), (64, 2048), (128, 2048), (16, 8192)),
                                      dtype="bfloat16", backends=("pallas", "reference"), reps=30),
        # Tiny: the Pallas kernel runs in interpret mode off a GPU (a check of that path, not a timing).
        "tiny": KernelOverheadSettings(shapes=((2, 64),), q_heads=4, kv_heads=2, head_dim=32, reps=3,
                                       backends=("reference", "pallas")),
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

"""Static configuration: the model's shape (a hashable jit argument) and the engine's knobs.

`ModelConfig` is frozen and hashable so jitted functions can take it as a static argument:
two configs that compare equal share compiled code. Engine-side configs are plain frozen
dataclasses read by host code only.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from pallas_kernels.arith import cdiv

DTYPES = ("bfloat16", "float32")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
ATTENTION_BACKENDS = ("reference", "pallas")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: Llama-3.1's "llama3" long-context bands, or "linear" (every
    frequency divided by `factor`; Gemma 3's global layers)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    kind: str = "llama3"

    def __post_init__(self) -> None:
        if self.kind not in ("llama3", "linear"):
            raise ValueError(f"RopeScaling.kind must be 'llama3' or 'linear', got {self.kind!r}")


LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN_ACTS = ("silu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only model of any supported family. Frozen + hashable: usable as a
    static jit argument.

    The first block of fields is every family's; the rest are the switches the shared layer
    pieces (`paxkv/model/layers.py`) read, each at its Llama value by default. A family
    module (`paxkv/model/families/`) sets them from its checkpoint's config.json;
    `architecture` names the family (`paxkv/model/registry.py`).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "custom"
    architecture: str = "LlamaForCausalLM"   # the family (checkpoint `architectures`)
    qkv_bias: bool = False                   # biases on q/k/v (Qwen2; Llama's attention_bias)
    o_bias: bool = False                     # bias on o_proj (Llama's attention_bias)
    qk_norm: bool = False                    # RMSNorm of every q and k head before RoPE
    # Sliding-window layers see keys at positions > query - sliding_window (transformers'
    # convention: the window counts the query itself). `layer_types` lists each layer's kind;
    # () means every layer attends to the full context.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"                 # the MLP's gate: "silu" (SwiGLU), "gelu_tanh" (GeGLU)
    rope_local_theta: float | None = None    # RoPE base of sliding layers (None: rope_theta)
    query_pre_attn_scalar: float | None = None   # softmax scale = this ** -0.5 (None: head_dim)
    embedding_multiplier: float = 1.0        # embeddings times this, in the compute dtype
    norm_unit_offset: bool = False           # RMSNorm gains stored as w, applied as 1 + w
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)
    # Mixture of experts: the layers in `moe_layers` replace the MLP by `num_experts` gated
    # MLPs of width `moe_intermediate_size`; each token runs through the `num_experts_per_tok`
    # its router ranks highest, weighted by the router's softmax (renormalised over the chosen
    # ones with `norm_topk_prob`). No experts: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    # How the forward computes, not what: every matmul, norm, log-softmax and attention in
    # the batch-invariant forms of `paxkv/model/batch_invariant.py`, so a token's logits do
    # not depend on what shares its step (`LLM(batch_invariant=True)`).
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                      "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelConfig.{field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise ValueError(f"ModelConfig.layer_types must list {self.num_layers} entries of "
                                 f"{LAYER_TYPES}, got {self.layer_types}")
            if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
                raise ValueError("ModelConfig.sliding_window must be positive when layer_types "
                                 f"has sliding layers, got {self.sliding_window}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"ModelConfig.hidden_act must be one of {HIDDEN_ACTS}, "
                             f"got {self.hidden_act!r}")
        if self.moe_layers:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"ModelConfig.num_experts_per_tok must be in [1, num_experts="
                                 f"{self.num_experts}], got {self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0:
                raise ValueError("ModelConfig.moe_intermediate_size must be positive, got "
                                 f"{self.moe_intermediate_size}")
            if self.batch_invariant:
                raise ValueError("ModelConfig.batch_invariant does not cover mixture-of-experts "
                                 "layers (their grouped matmul depends on how many tokens each "
                                 "expert gets)")
            if not all(0 <= i < self.num_layers for i in self.moe_layers):
                raise ValueError(f"ModelConfig.moe_layers must index layers [0, {self.num_layers}), "
                                 f"got {self.moe_layers}")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends through the sliding window."""
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, None for full attention."""
        return self.sliding_window if self.is_sliding(layer) else None

    @property
    def has_sliding_layers(self) -> bool:
        return "sliding_attention" in self.layer_types

    @property
    def attention_scale(self) -> float:
        """The softmax scale of every layer's q.k."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_rope(self, layer: int) -> tuple[float, RopeScaling | None]:
        """(base, scaling) of `layer`'s RoPE: sliding layers may have their own base and no
        scaling (Gemma 3), the rest share `rope_theta` and `rope_scaling`."""
        if self.rope_local_theta is not None and self.is_sliding(layer):
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s feed-forward block is a mixture of experts."""
        return layer in self.moe_layers

    def kv_bytes_per_token(self, bytes_per_element: float = 2.0) -> float:
        """K and V of one token over all layers (Llama-3-8B bf16: 131072 B)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    def num_params(self, active: bool = False) -> int:
        """Parameters of the model; `active`: those one token reads (its experts only)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 2 * h
        per_layer += (q + 2 * kv) * self.qkv_bias + h * self.o_bias + 2 * self.head_dim * self.qk_norm
        experts = self.num_experts_per_tok if active else self.num_experts
        moe = h * self.num_experts + experts * 3 * h * self.moe_intermediate_size
        ffn = sum(moe if self.is_moe_layer(layer) else 3 * h * i for layer in range(self.num_layers))
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + ffn + h + head


_LLAMA3_8B = ModelConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
    max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=(128001, 128009),
    name="llama3-8b")

PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": _LLAMA3_8B,
    "llama3.1-8b": dataclasses.replace(
        _LLAMA3_8B, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
        max_position_embeddings=131072, name="llama3.1-8b"),
    "llama3-70b": dataclasses.replace(
        _LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
        num_kv_heads=8, name="llama3-70b"),
    # Mixture-of-experts shapes (random weights; `paxkv/model/moe.py`).
    "mixtral-8x7b": ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-5,
        max_position_embeddings=32768, bos_token_id=1, eos_token_ids=(2,), name="mixtral-8x7b",
        architecture="MixtralForCausalLM", num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=14336, moe_layers=tuple(range(32))),
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
        max_position_embeddings=40960, eos_token_ids=(151645,), name="qwen3-30b-a3b",
        architecture="Qwen3MoeForCausalLM", qk_norm=True, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, moe_layers=tuple(range(48))),
    # Random-weight stand-in of the embedded model's shape; the trained one ships in
    # paxkv/assets/tiny and `LLM(model="tiny")` resolves to it when present.
    "tiny-random": ModelConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
        num_kv_heads=2, head_dim=32, rope_theta=10000.0, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,), name="tiny-random"),
}


def get_preset(name: str) -> ModelConfig:
    """A preset's shape (random weights). "tiny", the trained embedded model, is a checkpoint:
    `LLM("tiny")` loads it (`paxkv/assets`)."""
    if name not in PRESETS:
        raise ValueError(f"model {name!r} is not a preset ({sorted(PRESETS)})")
    return PRESETS[name]


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """KV page pool. num_gpu_blocks_override wins; else profile the accelerator's memory.

    `num_gpu_blocks` / `num_cpu_blocks` (vLLM's names) are the pool's size once known: the
    engine sizes the pool and carries the result in a copy of this config
    (`EngineConfig.with_pool`), which the block manager, scheduler and runner then read.
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    swap_space: float = 4.0  # GiB of host memory for swapped-out blocks
    # On CPU there is no device memory to profile: this many blocks unless overridden.
    cpu_default_num_blocks: int = 2048
    watermark: float = 0.01  # fraction of blocks kept free when admitting new prefills
    num_gpu_blocks: int | None = None  # device blocks, null block included; None: not sized yet
    num_cpu_blocks: int = 0            # host swap blocks
    kv_offloading_size: float = 0.0    # GiB of host memory for the host KV tier (0: none)
    num_offload_blocks: int = 0        # its blocks, once sized

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported "
                             f"(one of {KV_CACHE_DTYPES})")
        for field in ("num_gpu_blocks_override", "num_gpu_blocks"):
            value = getattr(self, field)
            if value is not None and value < 2:
                raise ValueError(f"{field} must be >= 2 (block 0 is the null block), got {value}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if not self.kv_offloading_size >= 0:
            raise ValueError(f"kv_offloading_size must be >= 0 GiB, got {self.kv_offloading_size}")
        if self.num_offload_blocks < 0:
            raise ValueError(f"num_offload_blocks must be >= 0, got {self.num_offload_blocks}")


# Batch limits when LLM(...) is given none, vLLM's rule: on an accelerator with room for them
# (JAX may use at least LARGE_DEVICE_BYTES; H100 / H200 class), a 1024-sequence batch and
# 16,384-token steps, else 256 and 8,192. On an H200 (Llama-3-8B, 1000 x 256/256) the large
# limits gave 63.8 requests/s against 59.7 (results/engine_defaults.md): prefill steps and
# 1024-row decode matmuls use the device better, at a higher per-token latency under load.
LARGE_DEVICE_BYTES = 48 * 2**30
LARGE_DEVICE_BATCH_LIMITS = (1024, 16384)
DEFAULT_BATCH_LIMITS = (256, 8192)
# `paxkv serve` keeps vLLM's server value for the step's tokens: shorter steps while prompts
# are prefilled, so streams already decoding see a smaller inter-token gap.
SERVER_MAX_NUM_BATCHED_TOKENS = 8192


def default_batch_limits(max_num_seqs: int | None, max_num_batched_tokens: int | None,
                         platform: str, device_bytes: int | None) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) with each None replaced by the platform's
    default (see LARGE_DEVICE_BATCH_LIMITS); `device_bytes`: the memory JAX may use on one
    device (None when unknown, e.g. on a CPU)."""
    large = platform == "gpu" and device_bytes is not None and device_bytes >= LARGE_DEVICE_BYTES
    seqs, tokens = LARGE_DEVICE_BATCH_LIMITS if large else DEFAULT_BATCH_LIMITS
    return (seqs if max_num_seqs is None else max_num_seqs,
            tokens if max_num_batched_tokens is None else max_num_batched_tokens)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level batching limits and the policy (continuous or the static baseline)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    policy: str = "continuous"  # or "static": iteration- or request-level batching
    preemption_mode: str = "recompute"  # or "swap"
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # or "priority": the waiting queue (engine/request_queue.py)

    def __post_init__(self) -> None:
        if self.policy not in ("continuous", "static"):
            raise ValueError(f"scheduler must be 'continuous' or 'static', got {self.policy!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got "
                             f"{self.scheduling_policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is off: a whole prefill must fit a step")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything one engine is built from; the checks that span several configs live here."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    dtype: str = "bfloat16"         # or "float32", or "auto" (bfloat16 on GPU, float32 elsewhere)
    attention_backend: str = "auto"  # "reference", "pallas", or "auto" (pallas on GPU)
    tensor_parallel_size: int = 1
    seed: int = 0
    num_scheduler_steps: int = 1  # decode steps per host round trip (multi-step decoding)
    async_scheduling: bool = True  # dispatch step t+1 before reading step t's tokens
    max_logprobs: int = 20        # cap on logprobs / prompt_logprobs per request (vLLM's)
    # Speculative decoding (`paxkv/spec_decode/`): `parse_speculative_config`'s result.
    speculative: Any = None

    def __post_init__(self) -> None:
        if self.speculative is not None:
            from paxkv.spec_decode.config import IMPLEMENTED_METHODS, SpeculativeConfig
            if not isinstance(self.speculative, SpeculativeConfig):
                raise ValueError("EngineConfig.speculative must be a SpeculativeConfig "
                                 "(spec_decode.config.parse_speculative_config)")
            if self.speculative.method not in IMPLEMENTED_METHODS:
                raise ValueError(f"speculative_config.method {self.speculative.method!r} is not "
                                 f"implemented yet (implemented: {IMPLEMENTED_METHODS})")
        if self.dtype not in DTYPES + ("auto",):
            raise ValueError(f"dtype must be 'auto', 'bfloat16' or 'float32', got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS + ("auto",):
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS + ('auto',)}, "
                             f"got {self.attention_backend!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {self.num_scheduler_steps}")
        max_len = self.scheduler.max_model_len
        if max_len > self.model.max_position_embeddings:
            raise ValueError(f"max_model_len {max_len} exceeds the model's "
                             f"max_position_embeddings {self.model.max_position_embeddings}")
        check_pool_fits(self.cache, self.scheduler, self.model)

    def with_pool(self, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                  num_offload_blocks: int = 0) -> "EngineConfig":
        """This config once the KV pool is sized (checked: it holds one full-length sequence),
        with its host swap pool and host KV tier."""
        cache = dataclasses.replace(self.cache, num_gpu_blocks=num_gpu_blocks,
                                    num_cpu_blocks=num_cpu_blocks,
                                    num_offload_blocks=num_offload_blocks)
        return dataclasses.replace(self, cache=cache)


def check_pool_fits(cache: CacheConfig, scheduler: SchedulerConfig,
                    model: ModelConfig | None = None) -> None:
    """The scheduler's progress guarantee: a sized pool holds one `max_model_len` sequence
    alone, so the oldest request always fits: its blocks in every KV group of `model`
    (`cache/kv_layout.py`; a sliding group holds its window and one step's chunk), one group
    of every layer when `model` is None. (EngineConfig checks it; a scheduler built by hand,
    as the simulator does, calls it.)"""
    blocks, bs, max_len = cache.num_gpu_blocks, cache.block_size, scheduler.max_model_len
    need = cdiv(max_len, bs) + 1
    if model is not None:
        from paxkv.cache.kv_layout import kv_layout, blocks_held   # (kv_layout imports this)
        need = 1 + sum(blocks_held(w, max_len, bs, scheduler.max_num_batched_tokens)
                       for w in kv_layout(model).windows())
    if blocks is not None and blocks < need:
        raise ValueError(
            f"num_gpu_blocks {blocks} cannot hold one sequence of max_model_len {max_len} "
            f"({need - 1} blocks of {bs} plus the null block): raise "
            "gpu_memory_utilization / num_gpu_blocks_override or lower max_model_len")


# Before the pool is sized, the runner that profiles the largest step gets the smallest pool:
# the null block and one more (its block tables point at the null block).
PROFILE_NUM_BLOCKS = 2


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """How a step attends (frozen, hashable: a static jit argument)."""

    backend: str = "reference"          # "reference" | "pallas"
    fused: bool = False                 # Pallas RoPE + KV-write kernels (one device only)
    # Decode steps of at most this many rows rotate and write inside the decode kernel.
    # Measured on an H200 with Llama-3-8B (results/one_stream.md): one stream 240.3 against
    # 234.0 tok/s, but a full batch of 256 lost 1.8% (65.35 against 66.57 requests/s),
    # likely because each of thousands of attention programs waits on its own rotation.
    rope_decode_max_rows: int = 8
    decode_backend: str = "auto"        # `paged_attention(backend=...)`: auto, triton, mosaic

    def __post_init__(self) -> None:
        if self.backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {self.backend!r}")
        if self.fused and self.backend != "pallas":
            raise ValueError("AttentionPlan.fused needs the pallas backend")

    @classmethod
    def for_backend(cls, backend: str, tensor_parallel: bool = False) -> "AttentionPlan":
        """The default plan of a backend: Pallas fuses its layer kernels on one device."""
        return cls(backend, fused=backend == "pallas" and not tensor_parallel)


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """Everything the runner needs, derived once by `runner_config` (not built by hand).

    Frozen and hashable. Shapes are the buckets every step is padded to: tokens of a
    prefill/mixed step, sequences (rows of the batch), block-table width, sampling rows, and
    block copies (copy-on-write, swap).
    """

    model: ModelConfig
    dtype: str                      # the weights' and activations' dtype, resolved
    kv_cache_dtype: str             # the pages' storage dtype, resolved: a concrete name
    attention_backend: str          # resolved: "reference" or "pallas"
    attention: AttentionPlan        # how every step attends (`paxkv/model/attention.py`)
    block_size: int
    num_blocks: int                 # device blocks, null block included
    num_host_blocks: int            # host swap pool (0: none)
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    fixed_shapes: bool
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    block_buckets: tuple[int, ...]
    row_buckets: tuple[int, ...]
    copy_buckets: tuple[int, ...]
    tensor_parallel_size: int = 1
    num_offload_blocks: int = 0     # the host KV tier (0: none)

    @property
    def max_blocks_per_seq(self) -> int:
        return cdiv(self.max_model_len, self.block_size)


def resolve_dtype(dtype: str, platform: str) -> str:
    """"auto" -> bfloat16 on GPU, float32 elsewhere."""
    if dtype == "auto":
        return "bfloat16" if platform == "gpu" else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto', 'bfloat16' or 'float32', got {dtype!r}")
    return dtype


def runner_config(engine: EngineConfig, platform: str) -> RunnerConfig:
    """Derive the runner's settings from the engine's config and the platform JAX runs on
    ("gpu", "cpu", ...): dtypes and backend resolved, shape buckets, fixed shapes.

    On GPU (`fixed_shapes`) block tables are always `max_model_len` wide and prefill/mixed
    steps always `max_num_seqs` rows, so a whole run compiles a handful of programs (the
    Pallas kernels loop over real lengths, so the padding costs them nothing), and decode
    steps pad to at least 8 rows: on an H200 one 8B decode stream took 4.62 ms per token
    padded to 8 rows against 5.50 ms padded to 64 (results/step_profile.md), while each
    smaller bucket costs one more compiled program.

    Before the pool is sized (`engine.cache.num_gpu_blocks` None) the config is the profile
    run's: `PROFILE_NUM_BLOCKS` blocks and no host pool.
    """
    if not isinstance(platform, str) or not platform:
        raise ValueError(f"platform must name JAX's backend ('gpu', 'cpu', ...), got {platform!r}")
    on_gpu = platform == "gpu"
    cache, sched = engine.cache, engine.scheduler
    dtype = resolve_dtype(engine.dtype, platform)
    kv = cache.kv_cache_dtype
    kv = dtype if kv == "auto" else ("fp8_e4m3" if kv == "fp8" else kv)
    backend = engine.attention_backend
    if backend == "auto":
        backend = "pallas" if on_gpu else "reference"
    sized = cache.num_gpu_blocks is not None
    num_blocks = cache.num_gpu_blocks if sized else PROFILE_NUM_BLOCKS
    num_host_blocks = cache.num_cpu_blocks if sized else 0
    min_seqs, min_tokens = (8, 256) if on_gpu else (4, 16)
    max_blocks = cdiv(sched.max_model_len, cache.block_size)
    return RunnerConfig(
        model=engine.model, dtype=dtype, kv_cache_dtype=kv, attention_backend=backend,
        attention=AttentionPlan.for_backend(backend, engine.tensor_parallel_size > 1),
        block_size=cache.block_size, num_blocks=num_blocks, num_host_blocks=num_host_blocks,
        max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
        max_model_len=sched.max_model_len, fixed_shapes=on_gpu,
        token_buckets=pow2_buckets(min_tokens, max(min_tokens, sched.max_num_batched_tokens)),
        seq_buckets=pow2_buckets(min_seqs, max(min_seqs, sched.max_num_seqs)),
        block_buckets=(fixed_block_buckets(max_blocks, cache.block_size) if on_gpu
                       else pow2_buckets(4, max(4, max_blocks))),
        # A prefill or mixed step samples up to `mixed_step_row_floor` rows, at most the
        # largest sequence bucket, which can pass 4 x max_num_seqs (8 slots for max_num_seqs=1).
        row_buckets=pow2_buckets(4, max(4, min_seqs, sched.max_num_seqs * 4)),
        copy_buckets=pow2_buckets(4, max(4, num_blocks)),
        tensor_parallel_size=engine.tensor_parallel_size,
        num_offload_blocks=cache.num_offload_blocks if sized else 0)


# On fixed shapes a block table is `max_model_len` wide, and the decode kernels size their
# grids from that width (the fused kernel's split count, `rope_decode_max_splits`). Decode
# steps whose sequences all fit this many tokens get tables this wide instead, the width the
# decode kernels were tuned at: with `max_model_len=8192` the full width cost one Llama-3-8B
# stream 3.3% (results/model_seam.md). Prefill and mixed steps keep the full width (one
# program per token bucket, as before).
NARROW_DECODE_TOKENS = 2048


def fixed_block_buckets(max_blocks: int, block_size: int) -> tuple[int, ...]:
    """Block-table widths of fixed shapes: the narrow decode width when `max_model_len` is
    wider, and the full width."""
    narrow = cdiv(NARROW_DECODE_TOKENS, block_size)
    return (narrow, max_blocks) if max_blocks > narrow else (max_blocks,)


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """Powers of two from lo up to (and including) hi, hi itself as the last bucket."""
    out, b = [], max(1, lo)
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)

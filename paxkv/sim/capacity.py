"""How many KV tokens and blocks fit on an accelerator: the arithmetic behind the page pool.

Memory on the accelerator goes, in order, to: the weights, a reserve for the activations
of the largest step (and the compiler's scratch), then whatever is left of the budget
(`gpu_memory_utilization` of the device) to KV pages. The engine sizes its pool from the
device's measured free memory; this planner answers the same question on paper, for any
device and model, so experiments can show where the memory goes.

Worked example (Llama-3-8B, bf16 weights, an RTX 4090's 24,564 MiB, whole device, no
reserve): 8.03e9 params x 2 B = 14.96 GiB of weights, 9.03 GiB left, 128 KiB per token in
bf16: 73,979 tokens (72.2 Ki); an 8-bit KV cache holds twice that.

Under tensor parallelism (`tensor_parallel_size` devices of `gpu_bytes` each) every device
holds 1/N of every split weight (all but the norms) and 1/N of every token's KV (its heads),
so the plan is one device's: its weights, its reserve, its share of the pool; a token slot
of the pool spans all N devices, and `tokens` counts those.
"""
from __future__ import annotations

import dataclasses
import math

from paxkv.config import ModelConfig

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    """Where an accelerator's memory goes, and how many tokens/blocks the KV pool gets.

    `blocks` counts every page of the pool, block 0 included (the null block that padding
    writes to), so pass it as `num_gpu_blocks_override`; sequences can use `blocks - 1`.
    `tokens` is the pure arithmetic `kv_bytes // kv_bytes_per_token` (whole blocks ignored).
    """

    gpu_bytes: int
    budget_bytes: int
    weights_bytes: int
    activation_reserve_bytes: int
    kv_bytes: int
    kv_bytes_per_token: float
    block_size: int
    block_bytes: float
    tokens: int
    blocks: int
    tensor_parallel_size: int = 1   # the figures above are per device; tokens span them all

    @property
    def usable_tokens(self) -> int:
        """Token slots sequences can use in whole blocks (the null block excluded)."""
        return max(0, self.blocks - 1) * self.block_size

    def max_sequences(self, seq_len: int) -> int:
        """How many sequences of `seq_len` tokens fit at once if each holds its own blocks."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        return max(0, self.blocks - 1) // math.ceil(seq_len / self.block_size)


def plan_capacity(gpu_bytes: int, cfg: ModelConfig, weight_dtype_bytes: float,
                  kv_dtype_bytes: float, block_size: int, gpu_memory_utilization: float = 1.0,
                  activation_reserve_bytes: int = 0, *, num_params: int | None = None,
                  kv_scale_bytes_per_token: float = 0.0,
                  tensor_parallel_size: int = 1) -> CapacityPlan:
    """Plan the KV pool of `cfg` on a device of `gpu_bytes` (one of `tensor_parallel_size`).

    `num_params` overrides `cfg.num_params()` (for non-Llama shapes, e.g. the paper's OPT).
    `kv_scale_bytes_per_token` adds the per-token scales a quantized pool stores.
    A budget too small for the weights gives an empty plan (0 tokens, 0 blocks), not an error:
    "does not fit" is an answer the experiments report.
    """
    if gpu_bytes <= 0:
        raise ValueError(f"gpu_bytes must be positive, got {gpu_bytes}")
    if weight_dtype_bytes <= 0:
        raise ValueError(f"weight_dtype_bytes must be positive, got {weight_dtype_bytes}")
    if kv_dtype_bytes <= 0:
        raise ValueError(f"kv_dtype_bytes must be positive, got {kv_dtype_bytes}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if activation_reserve_bytes < 0:
        raise ValueError(f"activation_reserve_bytes must be >= 0, got {activation_reserve_bytes}")
    if num_params is not None and num_params <= 0:
        raise ValueError(f"num_params must be positive, got {num_params}")
    if kv_scale_bytes_per_token < 0:
        raise ValueError(f"kv_scale_bytes_per_token must be >= 0, got {kv_scale_bytes_per_token}")
    tp = tensor_parallel_size
    if not isinstance(tp, int) or tp < 1 or cfg.num_kv_heads % tp:
        raise ValueError(f"tensor_parallel_size must be a positive divisor of num_kv_heads "
                         f"({cfg.num_kv_heads}), got {tp!r}")
    params = cfg.num_params() if num_params is None else num_params
    if tp > 1:   # norms are replicated, every other weight is split
        norms = (2 * cfg.num_layers + 1) * cfg.hidden_size if num_params is None else 0
        params = (params - norms) / tp + norms
    weights = int(math.ceil(params * weight_dtype_bytes))
    budget = int(gpu_bytes * gpu_memory_utilization)
    kv = max(0, budget - weights - activation_reserve_bytes)
    per_token = (cfg.kv_bytes_per_token(kv_dtype_bytes) + kv_scale_bytes_per_token) / tp
    block = block_size * per_token
    return CapacityPlan(gpu_bytes=int(gpu_bytes), budget_bytes=budget, weights_bytes=weights,
                        activation_reserve_bytes=int(activation_reserve_bytes), kv_bytes=kv,
                        kv_bytes_per_token=per_token, block_size=block_size, block_bytes=block,
                        tokens=int(kv // per_token), blocks=int(kv // block),
                        tensor_parallel_size=tp)

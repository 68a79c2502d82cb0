"""How many KV blocks the accelerator can hold: vLLM's profile of the largest step.

The weights are on the device already; the largest step's scratch memory comes from XLA's
own analysis of that compiled program (not the allocator's peak, which is the peak of the
whole process: a second engine in one process would see the first one's pool in it); the
pool gets what is left of the budget.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import jax

from paxkv.config import CacheConfig, ModelConfig
from paxkv.engine.step_io import SampleRow, WorkItem

logger = logging.getLogger("paxkv")


def profile_activation_bytes(cfg: ModelConfig, params: Any, *, backend: str, block_size: int,
                             kv_dtype: Any, max_num_seqs: int, max_num_batched_tokens: int,
                             max_model_len: int, mesh: Any = None) -> int:
    """Device bytes the largest step needs beyond weights and pool.

    Compiles one prefill step of `max_num_batched_tokens` tokens over a two-block pool and
    returns its scratch plus non-aliased outputs, from XLA's memory analysis. 0 where the
    backend gives no analysis. Under tensor parallelism (`mesh`) the figure is one
    device's: XLA partitions the program and analyses the per-device one.
    """
    from paxkv.runner.runner import Runner
    runner = Runner(cfg, params, num_blocks=2, block_size=block_size, kv_dtype=kv_dtype,
                    backend=backend, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                    fixed_shapes=True, mesh=mesh)
    tokens = min(max_num_batched_tokens, max_model_len - 1)
    item = WorkItem([0] * tokens, 0, [0] * math.ceil(tokens / block_size))
    try:
        return runner.step_scratch_bytes([item], [SampleRow(0)])
    finally:
        runner.release(params=False)


def device_memory_stats() -> dict[str, int]:
    """The allocator's figures for this process's first device (under tensor parallelism
    every device holds the same share); empty where it keeps none (CPU)."""
    return jax.local_devices()[0].memory_stats() or {}


def num_kv_blocks(cache: CacheConfig, params: Any, bytes_per_block: float,
                  profile: dict[str, Any]) -> int:
    """Override, else profile the accelerator once (weights + the largest step's
    activations, as vLLM does) and give the KV pool the rest, else the CPU default."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    stats = device_memory_stats()
    if not stats.get("bytes_limit"):
        return cache.cpu_default_num_blocks
    activations = profile_activation_bytes(params=params, **profile)
    stats = device_memory_stats()
    return blocks_for_budget(stats["bytes_limit"], stats.get("bytes_in_use", 0),
                             activations, cache.gpu_memory_utilization, bytes_per_block)


def blocks_for_budget(limit: int, in_use: int, activations: int, utilization: float,
                      bytes_per_block: float) -> int:
    """Blocks that fit in `utilization` of `limit` after what is in use and the step's
    activations; 5% of the budget stays free for XLA's scratch space and fragmentation."""
    free = limit * utilization * 0.95 - in_use - activations
    logger.info("KV pool sizing: limit %.1f GiB, in use %.1f GiB, activations %.2f GiB",
                limit / 2**30, in_use / 2**30, activations / 2**30)
    return max(2, int(free // bytes_per_block))

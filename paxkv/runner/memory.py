"""How many KV blocks the accelerator can hold: vLLM's profile of the largest step.

The weights are on the device already; the largest step's scratch memory comes from XLA's
own analysis of that compiled program (not the allocator's peak, which is the peak of the
whole process: a second engine in one process would see the first one's pool in it); the
pool gets what is left of the budget.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import jax

from paxkv.config import CacheConfig, EngineConfig, RunnerConfig
from paxkv.engine.step_io import SampleRow, WorkItem

logger = logging.getLogger("paxkv")


def profile_activation_bytes(config: RunnerConfig, params: Any, mesh: Any = None) -> int:
    """Device bytes the largest step needs beyond weights and pool.

    Compiles one prefill step of `max_num_batched_tokens` tokens, every shape at its largest
    bucket, over the config's pool (before sizing: `PROFILE_NUM_BLOCKS` blocks) and returns
    its scratch plus non-aliased outputs, from XLA's memory analysis. 0 where the backend
    gives no analysis. Under tensor parallelism (`mesh`) the figure is one device's: XLA
    partitions the program and analyses the per-device one.
    """
    from paxkv.runner.runner import Runner
    largest = dataclasses.replace(config, fixed_shapes=True, block_buckets=config.block_buckets[-1:])
    runner = Runner(params, largest, mesh)
    tokens = min(config.max_num_batched_tokens, config.max_model_len - 1)
    item = WorkItem([0] * tokens, 0, [0] * math.ceil(tokens / config.block_size))
    try:
        return runner.step_scratch_bytes([item], [SampleRow(0)])
    finally:
        runner.release(params=False)


def block_bytes_per_device(config: RunnerConfig) -> int:
    """One block's device bytes (pages plus, for 8-bit pools, their scales: what the pool
    allocates); under tensor parallelism each device holds 1 / tensor_parallel_size of it
    (its KV heads), so pool sizing and swap space count one device's share."""
    from paxkv.cache.kv_pool import block_bytes
    from paxkv.cache.quant import storage_dtype
    whole = block_bytes(config.model, config.block_size, storage_dtype(config.kv_cache_dtype))
    return whole // config.tensor_parallel_size


def num_swap_blocks(engine: EngineConfig, bytes_per_block: int) -> int:
    """Host blocks `swap_space` GiB holds; none unless preemption swaps."""
    if engine.scheduler.preemption_mode != "swap":
        return 0
    return int(engine.cache.swap_space * 2**30 // bytes_per_block)


def device_memory_stats() -> dict[str, int]:
    """The allocator's figures for this process's first device (under tensor parallelism
    every device holds the same share); empty where it keeps none (CPU)."""
    return jax.local_devices()[0].memory_stats() or {}


def num_kv_blocks(cache: CacheConfig, params: Any, profile: RunnerConfig, mesh: Any = None) -> int:
    """Override, else profile the accelerator once (weights + the largest step's
    activations, as vLLM does) and give the KV pool the rest, else the CPU default.
    `profile` is the runner config before sizing (`runner_config` of the unsized engine)."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    stats = device_memory_stats()
    if not stats.get("bytes_limit"):
        return cache.cpu_default_num_blocks
    activations = profile_activation_bytes(profile, params, mesh)
    stats = device_memory_stats()
    return blocks_for_budget(stats["bytes_limit"], stats.get("bytes_in_use", 0), activations,
                             cache.gpu_memory_utilization, block_bytes_per_device(profile))


def blocks_for_budget(limit: int, in_use: int, activations: int, utilization: float,
                      bytes_per_block: float) -> int:
    """Blocks that fit in `utilization` of `limit` after what is in use and the step's
    activations; 5% of the budget stays free for XLA's scratch space and fragmentation."""
    free = limit * utilization * 0.95 - in_use - activations
    logger.info("KV pool sizing: limit %.1f GiB, in use %.1f GiB, activations %.2f GiB",
                limit / 2**30, in_use / 2**30, activations / 2**30)
    return max(2, int(free // bytes_per_block))

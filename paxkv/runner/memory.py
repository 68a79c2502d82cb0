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
from paxkv.cache.kv_layout import kv_layout
from paxkv.engine.step_io import SampleRow, WorkItem

logger = logging.getLogger("paxkv")


def profile_activation_bytes(config: RunnerConfig, params: Any, mesh: Any = None) -> int:
    """Device bytes the largest step needs beyond weights and pool.

    Compiles one prefill step of `max_num_batched_tokens` tokens that samples `max_num_seqs`
    rows at a temperature through a top-p filter (vLLM's dummy sampler run, on the sampler's
    largest path: its per-row sorts' temporaries grow with the rows, 4.9 GiB at 1,024 Llama-3
    rows on a GPU, far more than a greedy step's), every shape
    at its largest bucket, over the config's pool (before sizing: `PROFILE_NUM_BLOCKS`
    blocks) and returns its scratch plus non-aliased outputs, from XLA's memory analysis. 0
    where the backend gives no analysis. Under tensor parallelism (`mesh`) the figure is one
    device's: XLA partitions the program and analyses the per-device one.
    """
    from paxkv.runner.runner import Runner
    largest = dataclasses.replace(config, fixed_shapes=True, block_buckets=config.block_buckets[-1:])
    runner = Runner(params, largest, mesh)
    tokens = min(config.max_num_batched_tokens, config.max_model_len - 1)
    table = [0] * math.ceil(tokens / config.block_size)
    item = WorkItem([0] * tokens, 0, table, None,
                    [table] * (kv_layout(config.model).num_groups - 1))
    try:
        rows = [SampleRow(0, temperature=1.0, top_p=0.9, seed=i) for i in range(config.max_num_seqs)]
        return runner.step_scratch_bytes([item], rows)
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


# XLA autotunes a program's matmul fusions when it first compiles it, on operand buffers of
# its own (with redzones) from the same allocator, while the KV pool is already live, and it
# needs each in one piece: on an 80 GB H100 (Llama-3-8B, defaults, no compilation cache) the
# first decode step's autotuning failed to find the 1,018 MiB of the LM head's weight, with
# 9.3 GiB free in pieces of at most 0.84 GiB (results/h100_memory.md). The pool leaves this
# many times the largest weight array (one device's share) free for it.
AUTOTUNE_RESERVE_WEIGHTS = 2


def largest_weight_bytes(params: Any) -> int:
    """Bytes of the largest weight array one device holds (its shard under tensor parallelism)."""
    largest = 0
    for leaf in jax.tree_util.tree_leaves(params):
        shards = getattr(leaf, "addressable_shards", None)
        if shards:
            largest = max(largest, max(int(s.data.nbytes) for s in shards))
        else:
            largest = max(largest, int(getattr(leaf, "nbytes", 0)))
    return largest


def num_kv_blocks(cache: CacheConfig, params: Any, profile: RunnerConfig, mesh: Any = None,
                  extra_block_bytes: int = 0) -> int:
    """Override, else profile the accelerator once (weights + the largest step's
    activations, as vLLM does) and give the KV pool the rest, else the CPU default.
    `profile` is the runner config before sizing (`runner_config` of the unsized engine);
    `extra_block_bytes`: what each block also costs elsewhere (a draft model's pages)."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    stats = device_memory_stats()
    if not stats.get("bytes_limit"):
        return cache.cpu_default_num_blocks
    activations = profile_activation_bytes(profile, params, mesh)
    stats = device_memory_stats()
    return blocks_for_budget(stats["bytes_limit"], stats.get("bytes_in_use", 0), activations,
                             cache.gpu_memory_utilization,
                             block_bytes_per_device(profile) + extra_block_bytes,
                             reserve=AUTOTUNE_RESERVE_WEIGHTS * largest_weight_bytes(params))


def blocks_for_budget(limit: int, in_use: int, activations: int, utilization: float,
                      bytes_per_block: float, reserve: int = 0) -> int:
    """Blocks that fit in `utilization` of `limit` after what is in use, the step's
    activations and `reserve` (room for XLA's autotuning, `AUTOTUNE_RESERVE_WEIGHTS`); 5% of
    the budget stays free for XLA's scratch space and fragmentation."""
    free = limit * utilization * 0.95 - in_use - activations - reserve
    logger.info("KV pool sizing: limit %.1f GiB, in use %.1f GiB, activations %.2f GiB, "
                "autotuning reserve %.2f GiB", limit / 2**30, in_use / 2**30,
                activations / 2**30, reserve / 2**30)
    return max(2, int(free // bytes_per_block))

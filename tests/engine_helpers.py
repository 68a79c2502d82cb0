"""Checks shared by the engine tests."""
from __future__ import annotations

import functools

from paxkv.cache.block_manager import BlockManager
from paxkv.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig, SchedulerConfig, runner_config


def make_block_manager(num_blocks: int, block_size: int, num_host_blocks: int = 0, *,
                       enable_prefix_caching: bool = True, watermark: float = 0.01,
                       windows: tuple[int | None, ...] = (None,),
                       num_offload_blocks: int = 0) -> BlockManager:
    """A block manager over a sized pool, for the host tests that build one by hand
    (`windows`: its KV groups' sliding windows; `num_offload_blocks`: its host KV tier)."""
    return BlockManager(CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                                    watermark=watermark, num_gpu_blocks=num_blocks,
                                    num_cpu_blocks=num_host_blocks,
                                    num_offload_blocks=num_offload_blocks), windows)


def assert_no_leaks(llm) -> None:
    """Every block back in the pool, every reference count zero, invariants intact."""
    bm = llm.llm_engine.block_manager
    assert bm.num_used_blocks == 0
    assert all(bm.ref_count(b) == 0 for b in range(1, llm.llm_engine.metrics.num_blocks))
    bm.check_invariants()


def make_runner_config(model: ModelConfig, *, block_size: int, num_blocks: int | None,
                       max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                       kv_cache_dtype: str = "auto", num_host_blocks: int = 0) -> RunnerConfig:
    """The builder's settings for a runner a test drives by hand: float32, the reference
    backend, CPU shapes; `num_blocks` None is the profile run's (pool not sized yet)."""
    engine = EngineConfig(model, CacheConfig(block_size=block_size, kv_cache_dtype=kv_cache_dtype),
                          SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                          max_num_batched_tokens=max_num_batched_tokens),
                          dtype="float32", attention_backend="reference")
    if num_blocks is not None:
        engine = engine.with_pool(num_blocks, num_host_blocks)
    return runner_config(engine, platform="cpu")


@functools.lru_cache(maxsize=None)
def shared_tiny_llm():
    """One engine on the embedded model shared by the sampling tests: compiled programs are
    cached by shape, so tests that share the settings share the compilations too."""
    from paxkv import LLM
    return LLM("tiny", dtype="float32", num_gpu_blocks_override=256, max_model_len=256,
               max_num_seqs=16, max_num_batched_tokens=128)


@functools.lru_cache(maxsize=None)
def shared_tiny_hf():
    """The embedded model in transformers (float32), the reference for the sampling tests."""
    import torch
    from transformers import LlamaForCausalLM

    from paxkv.assets import tiny_model_dir
    return LlamaForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32).eval()

"""Checks shared by the engine tests."""
from __future__ import annotations

import functools


def assert_no_leaks(llm) -> None:
    """Every block back in the pool, every reference count zero, invariants intact."""
    bm = llm.llm_engine.block_manager
    assert bm.num_used_blocks == 0
    assert all(bm.ref_count(b) == 0 for b in range(1, llm.llm_engine.metrics.num_blocks))
    bm.check_invariants()


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

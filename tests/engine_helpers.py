"""Checks shared by the engine tests."""
from __future__ import annotations


def assert_no_leaks(llm) -> None:
    """Every block back in the pool, every reference count zero, invariants intact."""
    bm = llm.llm_engine.block_manager
    assert bm.num_used_blocks == 0
    assert all(bm.ref_count(b) == 0 for b in range(1, llm.llm_engine.metrics.num_blocks))
    bm.check_invariants()

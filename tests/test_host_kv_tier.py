"""The host KV tier (`LLM(kv_offloading_size=GiB)`): cached blocks the device pool evicts are
copied to host memory, and a later prefix hit copies them back instead of computing them.

Whole workloads run under `kv_check`'s model of the pool's (and the tier's) contents, which
checks every read; the engine's outputs with the tier equal those without it.
"""
from __future__ import annotations

import random

import pytest

from engine_helpers import assert_no_leaks, make_block_manager
from paxkv.cache.host_tier import HostKVTier
from paxkv.config import SchedulerConfig
from paxkv.engine.scheduler import Scheduler
from paxkv.engine.sequence import Sequence
from paxkv.testing.kv_check import CheckRequest, run_checked


def test_tier_keeps_an_lru_and_pins():
    tier = HostKVTier(2)
    assert tier.store("a") == 0 and tier.store("b") == 1 and tier.store("a") is None
    assert tier.lookup("a") == 0          # "b" is now the least recently used
    assert tier.store("c") == 1 and "b" not in tier and tier.num_evictions == 1
    tier.pin(tier.lookup("a"))
    tier.pin(tier.lookup("c"))
    assert tier.store("d") is None        # every slot pinned: nothing evicted
    tier.unpin_all()
    assert tier.store("d") in (0, 1) and len(tier) == 2
    assert tier.reset() == 2 and not len(tier)


def test_evicted_prefix_comes_back_from_the_tier():
    bm = make_block_manager(9, 4, watermark=0.0, num_offload_blocks=16)
    a = Sequence(0, "a", list(range(3, 27)), None, 0.0)         # 24 tokens: 6 blocks
    bm.allocate(a, 24)
    a.num_computed_tokens = 24
    bm.mark_computed(a)
    bm.free(a)
    b = Sequence(1, "b", list(range(100, 132)), None, 1.0)      # takes all 8 blocks
    bm.allocate(b, 32)
    offloads, loads = bm.take_tier_copies()
    assert len(offloads) == 6 and not loads                     # a's blocks went to the tier
    bm.free(b)
    again = Sequence(2, "a", list(range(3, 27)) + [5], None, 2.0)
    assert bm.num_cached_prefix_tokens(again) == 24
    assert bm.allocate(again, 25) == 24
    _, loads = bm.take_tier_copies()
    assert sorted(slot for slot, _ in loads) == sorted(s for _, s in offloads)
    bm.check_invariants()


def make_sched(num_blocks: int, tier: int, **cfg) -> Scheduler:
    params = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96)
    params.update(cfg)
    bm = make_block_manager(num_blocks, 4, 8, watermark=0.0, num_offload_blocks=tier)
    return Scheduler(SchedulerConfig(**params), bm.cache, bm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_workloads_with_a_tier_read_their_own_kv(mode):
    """Prompts sharing long prefixes, arriving over time, in a pool too small to keep them
    cached: the tier serves hits, every read is checked, outputs are the tier-less run's."""
    rng = random.Random(5)
    stems = [[rng.randrange(50) for _ in range(40)] for _ in range(3)]
    reqs = [CheckRequest(stems[i % 3] + [rng.randrange(50) for _ in range(rng.randint(1, 9))],
                         rng.randint(1, 12), n=rng.choice([1, 1, 2]), arrival_step=4 * i)
            for i in range(18)]
    plain = make_sched(40, 0, preemption_mode=mode)
    ref = run_checked(plain, reqs)
    sched = make_sched(40, 64, preemption_mode=mode)
    res = run_checked(sched, reqs)
    assert res.outputs == ref.outputs
    tier = sched.block_manager.host_tier
    assert tier.num_stored > 0 and tier.num_loaded > 0
    assert sched.block_manager.prefix_cache_hits > plain.block_manager.prefix_cache_hits
    sched.check_no_leaks()


def test_engine_reports_cached_tokens_from_the_tier():
    """A small device pool: a prompt, then others that evict its blocks, then the prompt
    again: with the tier its prefix comes back (reported as cached) and the tokens are the
    first run's; without it nothing is cached."""
    from paxkv import LLM, SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    rng = random.Random(3)
    first = [rng.randrange(3, 4096) for _ in range(120)]
    others = [[rng.randrange(3, 4096) for _ in range(120)] for _ in range(4)]
    results = {}
    for tier in (0.0, 0.01):
        llm = LLM("tiny", dtype="float32", num_gpu_blocks_override=24, max_model_len=160,
                  max_num_seqs=2, max_num_batched_tokens=128, kv_offloading_size=tier)
        a = llm.generate([first], sp, use_tqdm=False)[0]
        for o in others:
            llm.generate([o], sp, use_tqdm=False)
        b = llm.generate([first], sp, use_tqdm=False)[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        results[tier] = b.num_cached_tokens
        assert_no_leaks(llm)
    assert results[0.0] == 0 and results[0.01] == 112   # 7 whole blocks of 16

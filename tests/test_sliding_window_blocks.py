"""Sliding-window KV groups on the host side: a sliding group gives back the blocks its window
has passed, so a long sequence holds O(window) of them; its prefix hits need only the blocks
the window covers; several groups (sliding and global layers) share one pool.

Whole runs go through `kv_check.run_checked`, whose content model checks that every chunk
reads, in every group, exactly the K/V of its own prefix where that group's window reaches,
under preemption by recomputation and by swapping, forks, prefix hits and aborts.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from engine_helpers import assert_no_leaks, make_block_manager
from paxkv.cache.block_pool import NULL_BLOCK
from paxkv.cache.kv_layout import blocks_held, kv_layout
from paxkv.config import ModelConfig, SchedulerConfig
from paxkv.engine.scheduler import Scheduler
from paxkv.engine.sequence import Sequence
from paxkv.testing.kv_check import CheckRequest, run_checked

BS = 4


def make_sched(windows, num_blocks=64, num_host_blocks=0, caching=True, **cfg) -> Scheduler:
    params = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=96)
    params.update(cfg)
    bm = make_block_manager(num_blocks, BS, num_host_blocks, enable_prefix_caching=caching,
                            watermark=0.0, windows=windows)
    return Scheduler(SchedulerConfig(**params), bm.cache, bm)


def requests(rng: random.Random, n: int) -> list[CheckRequest]:
    """Prompts that share prefixes (every third repeats an earlier one's start), some forked."""
    out = []
    for i in range(n):
        prompt = [rng.randrange(50) for _ in range(rng.randint(3, 60))]
        if i >= 3 and i % 3 == 0:
            prompt = out[i - 3].prompt_token_ids[:40] + prompt[:10]
        out.append(CheckRequest(prompt, rng.randint(1, 30), n=rng.choice([1, 1, 2]),
                                arrival_step=rng.randint(0, 20)))
    return out


LAYOUTS = {"mistral": (9,), "gemma": (None, 9, 9), "two_windows": (13, None, 5)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_windowed_runs_read_their_own_kv_and_leak_nothing(layout, mode):
    windows = LAYOUTS[layout]
    reqs = requests(random.Random(3), 20)
    ref = run_checked(make_sched((None,), num_blocks=2000, max_num_seqs=64), reqs).outputs
    for num_blocks in (60, 200):
        sched = make_sched(windows, num_blocks=num_blocks, num_host_blocks=40,
                           preemption_mode=mode)
        res = run_checked(sched, reqs, abort={"r5": 6})
        assert {k: v for k, v in res.outputs.items() if k != "r5"} == \
            {k: v for k, v in ref.items() if k != "r5"}
        sched.check_no_leaks()


def test_a_window_keeps_a_long_sequence_in_o_window_blocks():
    """Host side: one 400-token sequence, window 9, blocks of 4, 16-token chunks."""
    full = make_sched((None,), num_blocks=200, max_model_len=512)
    sliding = make_sched((9,), num_blocks=200, max_model_len=512)
    held = {}
    for name, sched in (("full", full), ("sliding", sliding)):
        seqs = {"max": 0}

        def observe(s, out, before, seqs=seqs):
            seqs["max"] = max(seqs["max"], s.block_manager.num_used_blocks)
        run_checked(sched, [CheckRequest(list(range(50)) * 8, 30)], observe=observe)
        held[name] = seqs["max"]
    assert held["full"] == -(-430 // BS)
    assert held["sliding"] <= blocks_held(9, 430, BS, 16) == 7


def test_prefix_hit_needs_only_the_window():
    bm = make_block_manager(64, 8, windows=(24,))
    a = Sequence(0, "a", list(range(100)), None, 0.0)
    bm.allocate(a, 100)
    a.num_computed_tokens = 100
    bm.mark_computed(a)
    bm.free(a)
    b = Sequence(1, "b", list(range(100)) + [7, 7, 7, 7, 7], None, 1.0)
    assert bm.num_cached_prefix_tokens(b) == 96      # a's 12 whole blocks
    assert bm.allocate(b, 105) == 96
    lo = (96 - 24 + 1) // 8                           # the first block the window covers
    assert b.block_table[:lo] == [NULL_BLOCK] * lo and NULL_BLOCK not in b.block_table[lo:]
    bm.check_invariants()
    bm.free(b)
    assert bm.num_used_blocks == 0


def test_two_groups_share_one_pool():
    """A global group holds every block, a sliding one its window, from one pool of ids."""
    bm = make_block_manager(100, 4, windows=(None, 8))
    s = Sequence(0, "s", list(range(60)), None, 0.0)
    bm.allocate(s, 16)
    for start in range(16, 60, 4):
        s.num_computed_tokens = start
        assert bm.allocate_slots([(s, 4)]) == []
    s.num_computed_tokens = 60
    assert len(s.block_table) == len(s.group_tables[0]) == 15
    live = [b for b in s.group_tables[0] if b != NULL_BLOCK]
    # The last chunk's first query (56) sees positions 49..56: blocks 12 to 14 stay.
    assert NULL_BLOCK not in s.block_table and live == s.group_tables[0][12:]
    assert not set(live) & set(s.block_table)
    assert bm.num_used_blocks == 15 + 3
    bm.check_invariants()
    bm.free(s)
    assert bm.num_used_blocks == 0


def test_gemma_layout_groups():
    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=26,
                      num_heads=1, num_kv_heads=1, head_dim=8, sliding_window=512,
                      layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else
                                        "sliding_attention" for i in range(26)))
    layout = kv_layout(cfg)
    assert layout.slots == 4 and layout.num_groups == 7            # 4 global, 22 sliding
    assert layout.windows() == (None,) + (512,) * 6
    assert sorted(l for g in layout.groups for l in g.layers) == list(range(26))
    assert layout.group_of(5) == 0 and layout.slot_of(23) == 3


@pytest.mark.slow
def test_engine_holds_o_window_blocks_for_a_4k_mistral_sequence():
    """The engine on a Mistral-shaped model (every layer sliding, window 512): a 4,096-token
    prompt and 64 more tokens hold at most the blocks the window and one 512-token chunk
    span, against the 260 full attention holds; the tokens equal the dense reference's."""
    from paxkv import LLM, SamplingParams
    from paxkv.model.dense import greedy_generate
    cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=8192,
                      architecture="MistralForCausalLM", sliding_window=512,
                      layer_types=("sliding_attention",) * 2, name="mistral-tiny")
    llm = LLM(cfg, dtype="float32", block_size=16, max_model_len=4608, max_num_seqs=4,
              max_num_batched_tokens=512, num_gpu_blocks_override=300, seed=1)
    prompt = np.random.default_rng(0).integers(3, 512, 4096).tolist()
    engine = llm.llm_engine
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=64,
                                                      ignore_eos=True))
    held, out = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        held.append(engine.block_manager.num_used_blocks)
    assert max(held) <= blocks_held(512, 4160, 16, 512) == 65
    assert held[-2] <= blocks_held(512, 4160, 16, 1) == 33         # decoding: the window alone
    assert -(-4160 // 16) == 260
    assert_no_leaks(llm)
    ref = greedy_generate(engine.runner.params, cfg, prompt, 64)
    assert list(out.outputs[0].token_ids) == ref

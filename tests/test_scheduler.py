"""Scheduler: token budget, chunked prefill, preemption, abort, static baseline, no leaks.

Every multi-step test runs against `KVContentModel`, which checks that each chunk reads
exactly the K/V of its own prefix: a scheduling or block bookkeeping error shows up as a
wrong read, not just as a wrong counter.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from paxkv.cache.block_manager import BlockManager
from paxkv.config import CacheConfig, SchedulerConfig
from paxkv.engine.scheduler import Scheduler, SchedulerOutput
from paxkv.engine.sequence import Sequence, SequenceStatus
from paxkv.testing.kv_check import CheckRequest, KVContentModel, run_checked

from engine_helpers import make_block_manager

BS = 4


def make_sched(num_blocks: int = 64, num_host_blocks: int = 0, caching: bool = True,
               watermark: float = 0.0, **cfg) -> Scheduler:
    params = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    params.update(cfg)
    bm = make_block_manager(num_blocks, BS, num_host_blocks, enable_prefix_caching=caching,
                            watermark=watermark)
    return Scheduler(SchedulerConfig(**params), bm.cache, bm)


def seq(seq_id: int, n_tokens: int, arrival: float | None = None, first: int = 0) -> Sequence:
    tokens = [(first + seq_id * 7 + i) % 50 for i in range(n_tokens)]
    return Sequence(seq_id, f"r{seq_id}", tokens, None, float(seq_id if arrival is None else arrival))


class Driver:
    """A minimal engine: schedule, run on the content model, append fake tokens."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        bm = sched.block_manager
        self.model = KVContentModel(bm.num_blocks, bm.block_size, bm.num_host_blocks)

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.model.apply_copies(out)
        for c in out.chunks:
            self.model.run_chunk(c)
        self.sched.on_step_done(out)
        for c in out.chunks:
            if c.needs_sample and c.seq.status is SequenceStatus.RUNNING:
                c.seq.append_token((c.seq.num_tokens * 31 + c.seq.seq_id) % 50)
        for s in self.sched.running_seqs + self.sched.swapped_seqs:
            self.model.check_sequence(s)
        self.sched.block_manager.check_invariants()
        return out


def random_requests(rng: random.Random, k: int, max_prompt: int = 30, max_out: int = 20,
                    max_n: int = 3, spread: int = 15) -> list[CheckRequest]:
    shared = [rng.randrange(50) for _ in range(max_prompt)]
    reqs = []
    for _ in range(k):
        prompt = shared[:rng.randrange(0, max_prompt)] + [rng.randrange(50) for _ in
                                                           range(rng.randrange(1, 12))]
        reqs.append(CheckRequest(prompt[:max_prompt], rng.randrange(1, max_out),
                               n=rng.randrange(1, max_n + 1), arrival_step=rng.randrange(spread)))
    return reqs


# ---------------------------------------------------------------- validation
def test_config_validation():
    bm = make_block_manager(8, BS)
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(SchedulerConfig(max_model_len=16), CacheConfig(block_size=8), bm)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_model_len=16, max_num_batched_tokens=8, enable_chunked_prefill=False)
    # The pool holding one max_model_len sequence spans two configs: EngineConfig checks it
    # (tests/test_config.py).


def test_add_seq_validation():
    sched = make_sched(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_seq(seq(0, 17))
    sched.add_seq(seq(1, 4))
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add_seq(seq(1, 4))
    used = seq(2, 4)
    used.num_computed_tokens = 2
    with pytest.raises(ValueError, match="must be new"):
        sched.add_seq(used)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Sequence(3, "r3", [], None, 0.0)
    assert sched.num_waiting == 1


def test_schedule_requires_on_step_done():
    sched = make_sched()
    sched.add_seq(seq(0, 5))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="on_step_done"):
        sched.schedule()
    sched.on_step_done(out)
    assert sched.schedule().chunks == []  # no sampled token appended yet: nothing to do


# ---------------------------------------------------------------- budget, chunks
def test_chunked_prefill_splits_prompt_to_budget():
    sched = make_sched(max_num_batched_tokens=32, max_model_len=128, num_blocks=64)
    s = seq(0, 100)
    sched.add_seq(s)
    d = Driver(sched)
    got = []
    for _ in range(4):
        out = d.step()
        assert len(out.chunks) == 1
        c = out.chunks[0]
        got.append((c.start, c.num_tokens, c.needs_sample, c.is_prefill))
        assert out.num_prefill_tokens == c.num_tokens and out.num_decode_tokens == 0
    assert got == [(0, 32, False, True), (32, 32, False, True), (64, 32, False, True),
                   (96, 4, True, True)]
    out = d.step()
    c = out.chunks[0]
    assert (c.start, c.num_tokens, c.needs_sample, c.is_prefill) == (100, 1, True, False)
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 0


def test_decodes_first_then_prefill_chunk_gets_the_rest():
    sched = make_sched(max_num_batched_tokens=16, max_model_len=64)
    d = Driver(sched)
    for i in range(2):
        sched.add_seq(seq(i, 4))
    d.step()  # both prompts (8 tokens)
    sched.add_seq(seq(2, 40))
    out = d.step()
    kinds = [(c.seq.seq_id, c.num_tokens, c.is_prefill) for c in out.chunks]
    assert kinds == [(0, 1, False), (1, 1, False), (2, 14, True)]
    assert out.num_batched_tokens == 16
    # A running partial prefill continues only with what the decodes leave over.
    out = d.step()
    assert [(c.seq.seq_id, c.num_tokens) for c in out.chunks] == [(0, 1), (1, 1), (2, 14)]


def test_decodes_beyond_the_budget_wait_oldest_first():
    sched = make_sched(max_num_batched_tokens=2)
    d = Driver(sched)
    for i in range(3):
        sched.add_seq(seq(i, 1))
    d.step()
    d.step()
    assert sched.num_running == 2
    d.step()  # the third prompt's single token was admitted once a slot of budget freed
    out = d.step()
    assert [c.seq.seq_id for c in out.chunks] == [0, 1] and out.num_batched_tokens == 2


def test_chunking_off_admits_whole_prompts_only():
    sched = make_sched(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    d = Driver(sched)
    sched.add_seq(seq(0, 40))
    sched.add_seq(seq(1, 40))
    out = d.step()
    assert [(c.seq.seq_id, c.num_tokens) for c in out.chunks] == [(0, 40)]
    assert sched.num_waiting == 1
    out = d.step()
    assert [(c.seq.seq_id, c.num_tokens) for c in out.chunks] == [(0, 1), (1, 40)]


def test_max_num_seqs_limits_admission():
    sched = make_sched(max_num_seqs=3)
    d = Driver(sched)
    for i in range(5):
        sched.add_seq(seq(i, 3))
    out = d.step()
    assert len(out.chunks) == 3 and sched.num_running == 3 and sched.num_waiting == 2


def test_fanout_reserves_batch_slots():
    sched = make_sched(max_num_seqs=4)
    a = Sequence(0, "a", [1, 2, 3], None, 0.0, fanout=3)
    b = Sequence(1, "b", [4, 5, 6], None, 1.0, fanout=2)
    sched.add_seq(a)
    sched.add_seq(b)
    out = sched.schedule()
    assert [c.seq.seq_id for c in out.chunks] == [0]  # b's 2 slots do not fit next to a's 3


def test_running_sequence_without_new_tokens_is_held():
    sched = make_sched()
    d = Driver(sched)
    s = seq(0, 6)
    sched.add_seq(s)
    out = sched.schedule()
    for c in out.chunks:
        d.model.run_chunk(c)
    sched.on_step_done(out)  # the engine appends no token: the sequence waits in place
    assert sched.schedule().chunks == [] and sched.num_running == 1
    s.append_token(3)
    assert [c.num_tokens for c in d.step().chunks] == [1]


def test_prefix_cache_hit_skips_cached_tokens():
    sched = make_sched()
    d = Driver(sched)
    a = seq(0, 18)
    sched.add_seq(a)
    d.step()
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    b = Sequence(1, "b", a.token_ids[:16] + [9, 9, 9], None, 1.0)
    sched.add_seq(b)
    out = d.step()
    assert out.num_prefix_cached_tokens == 16
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(16, 3)]
    assert sched.block_manager.prefix_cache_hits == 16


# ---------------------------------------------------------------- preemption
def _fill_pool(mode: str, num_host_blocks: int, caching: bool = True):
    # 8 usable blocks; three 8-token prompts take 6; their first decodes need 3 more.
    sched = make_sched(num_blocks=9, num_host_blocks=num_host_blocks, preemption_mode=mode,
                       max_model_len=32, caching=caching)
    d = Driver(sched)
    seqs = [seq(i, 8) for i in range(3)]
    for s in seqs:
        sched.add_seq(s)
    d.step()
    return sched, d, seqs


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_by_recompute_takes_newest_back_to_front_of_waiting(caching):
    sched, d, seqs = _fill_pool("recompute", 0, caching)
    sched.add_seq(seq(3, 4))
    out = d.step()
    assert out.preempted == [seqs[2]]
    victim = seqs[2]
    assert victim.status is SequenceStatus.WAITING and victim.num_computed_tokens == 0
    assert victim.block_table == [] and victim.num_output_tokens == 1  # keeps its output
    assert sched.waiting_seqs[0] is victim  # ahead of the request that arrived later
    assert [c.seq.seq_id for c in out.chunks] == [0, 1]  # no admission after a preemption
    assert sched.num_preemptions == sched.num_recompute_preemptions == 1
    # Recomputing prefills prompt + outputs (its freed full blocks are still in the prefix
    # cache when caching is on), then the sequence decodes on.
    while victim.status is not SequenceStatus.RUNNING:
        for s in sched.running_seqs:
            if s.num_output_tokens >= 2:
                sched.finish(s, SequenceStatus.FINISHED_LENGTH)
        out = d.step()
    c = next(c for c in out.chunks if c.seq is victim)
    if caching:
        assert (c.start, c.num_tokens, c.needs_sample) == (8, 1, True)
        assert out.num_prefix_cached_tokens == 8
    else:
        assert (c.start, c.num_tokens, c.needs_sample) == (0, 9, True)


def test_preemption_by_swap_and_swap_in():
    sched, d, seqs = _fill_pool("swap", 16)
    victim = seqs[2]
    blocks = list(victim.block_table)
    out = d.step()
    assert out.preempted == [victim] and victim.status is SequenceStatus.SWAPPED
    assert [dev for dev, _ in out.blocks_to_swap_out] == blocks
    assert victim.num_computed_tokens == 8  # nothing to recompute
    assert sched.num_swapped == 1 and sched.num_swap_preemptions == 1
    sched.add_seq(seq(3, 4))
    for s in list(sched.running_seqs):
        sched.finish(s, SequenceStatus.FINISHED_LENGTH)
    out = d.step()
    assert len(out.blocks_to_swap_in) == len(blocks)
    # The swapped request goes before the new one; it continues with its decode.
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in out.chunks] == [(2, 8, 1), (3, 0, 4)]
    assert victim.status is SequenceStatus.RUNNING


def test_swap_falls_back_to_recompute_when_host_pool_is_full():
    sched, d, seqs = _fill_pool("swap", 1)  # one host block cannot hold two
    out = d.step()
    assert out.preempted == [seqs[2]] and out.blocks_to_swap_out == []
    assert seqs[2].status is SequenceStatus.WAITING and sched.num_recompute_preemptions == 1


def test_no_new_admission_while_requests_are_swapped_out():
    sched, d, seqs = _fill_pool("swap", 16)
    d.step()  # preempts seq 2 by swap
    sched.add_seq(seq(3, 1))
    out = d.step()  # seqs 0 and 1 still hold the pool: 2 cannot swap in, 3 must wait
    assert sched.num_swapped == 1 and [c.seq.seq_id for c in out.chunks] == [0, 1]


def test_forked_group_is_preempted_and_swapped_together():
    # 6 usable blocks: the old request's prompt takes 3, the group's shared prompt 3.
    sched = make_sched(num_blocks=7, num_host_blocks=32, preemption_mode="swap", max_model_len=24)
    d = Driver(sched)
    old = seq(0, 12)
    parent = Sequence(1, "group", list(range(10)), None, 1.0, fanout=3)
    sched.add_seq(old)
    sched.add_seq(parent)
    out = sched.schedule()
    for c in out.chunks:
        d.model.run_chunk(c)
    sched.on_step_done(out)
    old.append_token(1)
    kids = [sched.fork(parent, 10 + k) for k in range(2)]
    group = [parent] + kids
    for s in group:
        s.append_token(40 + s.seq_id)
    assert sched.block_manager.num_available_blocks == 0
    # The old request's decode needs a block: the newest request goes, all three together.
    out = d.step()
    assert out.preempted == group
    assert len(out.blocks_to_swap_out) == 3  # the shared blocks move once
    assert all(s.status is SequenceStatus.SWAPPED for s in group)
    assert [c.seq.seq_id for c in out.chunks] == [0]
    sched.finish(old, SequenceStatus.FINISHED_STOPPED)
    out = d.step()
    assert sorted(c.seq.seq_id for c in out.chunks) == [1, 10, 11]
    assert len(out.blocks_to_swap_in) == 3
    assert len(out.blocks_to_copy) == 2  # two of the three writers copy the shared tail
    assert len({s.block_table[2] for s in group}) == 3


def test_group_too_big_for_the_pool_sheds_members_instead_of_livelocking():
    # max_model_len 16 fits the pool (7 blocks) but four forks of it do not.
    reqs = [CheckRequest(list(range(6)), max_tokens=10, n=4)]
    sched = make_sched(num_blocks=8, max_model_len=16)
    res = run_checked(sched, reqs, max_steps=500)
    assert res.num_preemptions > 0
    assert [len(o) for o in res.outputs["r0"]] == [10] * 4
    sched.check_no_leaks()


# ---------------------------------------------------------------- abort
def test_abort_frees_blocks_at_once_wherever_the_sequence_is():
    sched, d, seqs = _fill_pool("swap", 16)
    bm = sched.block_manager
    d.step()  # seq 2 swapped out
    sched.add_seq(seq(3, 5))
    assert bm.num_used_host_blocks == 2
    aborted = sched.abort_request("r2")
    assert aborted == [seqs[2]] and seqs[2].status is SequenceStatus.FINISHED_ABORTED
    assert seqs[2].finish_reason == "abort"
    assert bm.num_used_host_blocks == 0 and sched.num_swapped == 0
    out = sched.schedule()
    computed = seqs[0].num_computed_tokens
    used = bm.num_used_blocks
    held = len(set(seqs[0].block_table))
    assert sched.abort_request("r0") == [seqs[0]]  # running, with a pending chunk
    assert bm.num_used_blocks == used - held
    assert sched.abort_request("r3")[0].status is SequenceStatus.FINISHED_ABORTED  # waiting
    assert sched.abort_request("nope") == []
    sched.on_step_done(out)  # skips the aborted sequence
    assert seqs[0].num_computed_tokens == computed
    sched.abort_request("r1")
    sched.check_no_leaks()
    assert bm.num_free_blocks + bm.num_cached_evictable_blocks == bm.num_blocks - 1


def test_abort_during_random_run_leaks_nothing():
    rng = random.Random(3)
    reqs = random_requests(rng, 20)
    sched = make_sched(num_blocks=20, num_host_blocks=10, preemption_mode="swap")
    res = run_checked(sched, reqs, abort={f"r{i}": rng.randrange(20) for i in range(0, 20, 3)})
    assert res.steps > 0
    sched.check_no_leaks()


# ---------------------------------------------------------------- static baseline
def test_static_policy_admits_request_level_batches():
    max_len = 32
    sched = make_sched(policy="static", max_num_seqs=3, max_model_len=max_len, num_blocks=64)
    reqs = [CheckRequest([i, i + 1, i + 2, 5], max_tokens=2 + 3 * i) for i in range(7)]
    batches: list[set[int]] = []

    def observe(s: Scheduler, out: SchedulerOutput, running_before: list[Sequence]) -> None:
        new = {c.seq.seq_id for c in out.chunks if c.start == 0}
        if new:
            assert not running_before, "admitted while a batch was still running"
            batches.append(new)
            for c in out.chunks:
                assert len(c.seq.block_table) * BS >= max_len  # reserved up front
        assert s.num_running <= 3

    res = run_checked(sched, reqs, observe=observe)
    assert [len(b) for b in batches] == [3, 3, 1]
    # Continuous batching serves the same workload in fewer steps.
    cont = make_sched(max_num_seqs=3, max_model_len=max_len, num_blocks=64)
    res_cont = run_checked(cont, reqs)
    assert res_cont.steps < res.steps
    assert res_cont.outputs == res.outputs


def test_static_policy_reservation_limits_batch_to_pool():
    # 8 blocks of reservation each (32 tokens), 20 usable blocks: only 2 fit at once.
    sched = make_sched(policy="static", max_num_seqs=8, max_model_len=32, num_blocks=21)
    for i in range(5):
        sched.add_seq(seq(i, 3))
    out = sched.schedule()
    assert len(out.chunks) == 2 and sched.num_running == 2
    assert sched.block_manager.num_used_blocks == 16


# ---------------------------------------------------------------- whole runs
CONFIGS = [
    dict(policy=p, preemption_mode=m, caching=c, enable_chunked_prefill=ch)
    for p in ("continuous", "static") for m in ("recompute", "swap")
    for c in (True, False) for ch in (True, False)
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_every_policy_gives_the_same_outputs_and_leaks_nothing(cfg):
    rng = random.Random(7)
    reqs = random_requests(rng, 25)
    ref = run_checked(make_sched(num_blocks=400, max_num_seqs=64), reqs).outputs
    for num_blocks in (17, 40):  # 17: constant preemption; 40: some
        sched = make_sched(num_blocks=num_blocks, num_host_blocks=12, max_num_seqs=8,
                           max_num_batched_tokens=64, **cfg)
        decode_checks = []

        def observe(s: Scheduler, out: SchedulerOutput, running_before: list[Sequence]) -> None:
            assert out.num_batched_tokens <= 64
            assert out.num_batched_tokens == sum(c.num_tokens for c in out.chunks)
            assert s.num_running <= 8
            scheduled = {c.seq.seq_id for c in out.chunks}
            preempted = {p.seq_id for p in out.preempted}
            decodes = [r for r in running_before if r.num_uncomputed_tokens == 1]
            if len(decodes) <= 64:  # decodes come first: none is skipped for a prefill
                missing = [r for r in decodes if r.seq_id not in scheduled | preempted]
                assert not missing
            decode_checks.append(len(decodes))
            for p in out.preempted:  # the newest go first
                for r in s.running_seqs:
                    assert s.priority(r) < s.priority(p)

        res = run_checked(sched, reqs, observe=observe)
        assert res.outputs == ref
        sched.check_no_leaks()
        assert sched.block_manager.num_free_blocks + \
            sched.block_manager.num_cached_evictable_blocks == num_blocks - 1
        if num_blocks == 17 and cfg["policy"] == "continuous":
            assert res.num_preemptions > 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(9, 40),
       mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(),
       chunked=st.booleans(), policy=st.sampled_from(["continuous", "static"]),
       budget=st.sampled_from([5, 12, 32, 48]), host=st.integers(0, 10))
def test_random_workloads_finish_without_leaks(seed, num_blocks, mode, caching, chunked, policy,
                                               budget, host):
    if not chunked:
        budget = max(budget, 32)  # a whole max_model_len prefill must fit one step
    rng = random.Random(seed)
    reqs = random_requests(rng, rng.randrange(1, 12), max_prompt=24, max_out=10)
    sched = make_sched(num_blocks=num_blocks, num_host_blocks=host, caching=caching,
                       preemption_mode=mode, enable_chunked_prefill=chunked, policy=policy,
                       max_num_batched_tokens=budget, max_model_len=32, max_num_seqs=6,
                       watermark=0.05)
    res = run_checked(sched, reqs, max_steps=3000)
    sched.check_no_leaks()
    for i, r in enumerate(reqs):
        assert [len(o) for o in res.outputs[f"r{i}"]] == [min(r.max_tokens, 32 - len(
            r.prompt_token_ids))] * r.n


class _PublicOnly:
    """The block manager with its private names hidden: the scheduler uses its public API."""

    def __init__(self, bm: BlockManager) -> None:
        self._bm = bm

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(f"the scheduler reached for BlockManager.{name}")
        return getattr(self._bm, name)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_scheduler_uses_only_public_block_manager_calls(mode):
    rng = random.Random(3)
    reqs = random_requests(rng, 20)
    ref = run_checked(make_sched(num_blocks=400, max_num_seqs=64), reqs).outputs
    bm = make_block_manager(17, BS, 12, enable_prefix_caching=True, watermark=0.0)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                          preemption_mode=mode)
    sched = Scheduler(cfg, bm.cache, _PublicOnly(bm))
    res = run_checked(sched, reqs)
    assert res.outputs == ref and res.num_preemptions > 0
    if mode == "swap":
        assert bm.num_blocks_swapped_in > 0
    assert bm.num_cow_copies > 0 and bm.prefix_cache_hits > 0
    sched.check_no_leaks()

"""Block manager: allocation, ref counts, copy-on-write, prefix cache, swap (host only)."""
from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from paxkv.cache.block_manager import BlockManager
from paxkv.config import CacheConfig
from paxkv.engine.scheduler import ScheduledChunk
from paxkv.engine.sequence import Sequence, SequenceStatus
from paxkv.testing.kv_check import KVContentModel
from engine_helpers import make_block_manager

BS = 4


def manager_and_model(num_blocks: int, num_host_blocks: int = 0,
                      **kw) -> tuple[BlockManager, KVContentModel]:
    """A block manager over `num_blocks` blocks of BS tokens (and `num_host_blocks` of host
    swap space) with the content model of the same pools, which checks what it reads."""
    bm = make_block_manager(num_blocks, BS, num_host_blocks, **kw)
    return bm, KVContentModel(num_blocks, BS, num_host_blocks)


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", tokens, None, float(seq_id))


def compute(bm: BlockManager, model: KVContentModel, seq: Sequence, n: int) -> None:
    """What one engine step does for a sequence: room, copies, write, advance, register."""
    copies = bm.append_slots(seq, n)
    model.apply_copies(_copies(copies))
    model.run_chunk(ScheduledChunk(seq, seq.num_computed_tokens, n,
                                   seq.num_computed_tokens + n == seq.num_tokens))
    seq.num_computed_tokens += n
    bm.mark_computed(seq)


def admit(bm: BlockManager, model: KVContentModel, seq: Sequence, n: int | None = None) -> int:
    """Allocate a new sequence (prefix reuse), then compute `n` (default: all) tokens."""
    cached = bm.allocate(seq, seq.num_tokens if n is None else bm.num_cached_prefix_tokens(seq) + n)
    seq.num_computed_tokens = cached
    todo = seq.num_tokens - cached if n is None else n
    model.run_chunk(ScheduledChunk(seq, cached, todo, cached + todo == seq.num_tokens))
    seq.num_computed_tokens += todo
    bm.mark_computed(seq)
    return cached


def snapshot(bm: BlockManager, seqs: list[Sequence]) -> tuple:
    """Everything `allocate_slots` could change: both pools whole, tables, counters."""
    pools = [copy.deepcopy(vars(p)) for p in (bm.device_pool, bm.host_pool)]
    tables = [(s.seq_id, list(s.block_table), s.num_registered_blocks) for s in seqs]
    return pools, tables, bm.num_cow_copies, bm.num_available_blocks, bm.num_used_blocks


def fork_one(data: st.DataObject, bm: BlockManager, live: list[Sequence], seq_id: int) -> None:
    """A property-test step: fork a drawn live sequence; the child joins `live`."""
    parent = data.draw(st.sampled_from(live), label="parent")
    child = parent.fork(seq_id)
    bm.fork(parent, child)
    live.append(child)


class _copies:
    def __init__(self, copies, swap_out=(), swap_in=()):
        self.blocks_to_copy = list(copies)
        self.blocks_to_swap_out = list(swap_out)
        self.blocks_to_swap_in = list(swap_in)
        self.blocks_to_offload = []
        self.blocks_to_load = []


def test_constructor_validation():
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        make_block_manager(1, BS)
    with pytest.raises(ValueError, match="block_size"):
        make_block_manager(8, 0)
    with pytest.raises(ValueError, match="watermark"):
        make_block_manager(8, BS, watermark=1.0)
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        make_block_manager(8, BS, num_host_blocks=-1)
    with pytest.raises(ValueError, match="num_gpu_blocks is not set"):
        BlockManager(CacheConfig(block_size=BS))   # the pool not sized yet
    bm = make_block_manager(9, BS, 3, enable_prefix_caching=False, watermark=0.25)
    assert (bm.num_blocks, bm.block_size, bm.num_host_blocks, bm.enable_prefix_caching,
            bm.watermark_blocks) == (9, BS, 3, False, 2)


def test_allocate_never_hands_out_null_block_and_exhausts_cleanly():
    bm = make_block_manager(6, BS, enable_prefix_caching=False, watermark=0.0)
    seq = make_seq(0, list(range(20)))  # 5 blocks: the whole pool but block 0
    assert bm.can_allocate(seq, 20)
    assert bm.allocate(seq, 20) == 0
    assert sorted(seq.block_table) == [1, 2, 3, 4, 5]
    assert bm.num_free_blocks == 0 and bm.num_used_blocks == 5
    other = make_seq(1, [1])
    assert not bm.can_allocate(other, 1)
    with pytest.raises(RuntimeError):
        bm.allocate(other, 1)
    bm.check_invariants()
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 5
    bm.check_invariants()


def test_allocate_on_demand_and_watermark():
    bm = make_block_manager(101, BS, enable_prefix_caching=False, watermark=0.1)
    assert bm.watermark_blocks == 10
    big = make_seq(0, list(range(4 * 91)))  # 91 blocks would leave 9 < 10 free
    assert not bm.can_allocate(big, big.num_tokens)
    assert bm.can_allocate(big, big.num_tokens, use_watermark=False)
    seq = make_seq(1, list(range(10)))
    bm.allocate(seq, 5)
    assert len(seq.block_table) == 2  # blocks on demand: ceil(5 / 4)
    bm.allocate(seq, 9)
    assert len(seq.block_table) == 3
    bm.check_invariants()


@pytest.mark.parametrize("prompt_len", [10, 8])  # ends mid-block / exactly on a boundary
def test_copy_on_write_after_fork(prompt_len):
    bm, model = manager_and_model(16, enable_prefix_caching=False)
    parent = make_seq(0, list(range(100, 100 + prompt_len)))
    admit(bm, model, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert all(bm.ref_count(b) == 2 for b in parent.block_table)
    shared = list(parent.block_table)
    parent.append_token(7)
    child.append_token(8)
    copies = bm.append_slots(parent, 1)
    if prompt_len % BS:
        last = shared[-1]
        assert len(copies) == 1 and copies[0][0] == last
        assert parent.block_table[-1] == copies[0][1] != last
        assert bm.ref_count(last) == 1  # only the child still holds it
    else:
        assert copies == []  # the new token opens a fresh, unshared block
        assert len(parent.block_table) == len(shared) + 1
    model.apply_copies(_copies(copies))
    model.run_chunk(ScheduledChunk(parent, prompt_len, 1, True))
    parent.num_computed_tokens += 1
    # The child writes in place now that it is the last holder of the partial block.
    child_copies = bm.append_slots(child, 1)
    assert child_copies == []
    model.run_chunk(ScheduledChunk(child, prompt_len, 1, True))
    child.num_computed_tokens += 1
    full = prompt_len // BS
    assert parent.block_table[:full] == child.block_table[:full] == shared[:full]
    assert all(bm.ref_count(b) == 2 for b in shared[:full])  # full blocks stay shared
    for s in (parent, child):
        model.check_sequence(s)
    bm.check_invariants()
    bm.free(parent)
    bm.free(child)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_copy_on_write_for_multi_block_chunk_into_shared_tail():
    # A chunk spanning a shared partial block and beyond: one copy, then fresh blocks.
    bm, model = manager_and_model(16, enable_prefix_caching=False)
    parent = make_seq(0, list(range(6)))
    admit(bm, model, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    for t in range(7):
        child.append_token(50 + t)
    assert bm.blocks_needed([(child, 7)]) == 3  # CoW of block 1 + blocks 2 and 3
    copies = bm.append_slots(child, 7)
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert len(child.block_table) == 4
    model.apply_copies(_copies(copies))
    model.run_chunk(ScheduledChunk(child, 6, 7, True))
    child.num_computed_tokens = 13
    model.check_sequence(parent)
    model.check_sequence(child)
    bm.check_invariants()


def test_blocks_needed_is_exact_for_a_group_sharing_a_tail():
    # Three sequences share a partial block: the first two writers copy, the last writes
    # in place, so the group needs exactly two blocks (the scheduler preempts on this).
    bm, model = manager_and_model(16, enable_prefix_caching=False)
    parent = make_seq(0, list(range(6)))
    admit(bm, model, parent)
    group = [parent]
    for i in (1, 2):
        kid = parent.fork(i)
        bm.fork(parent, kid)
        group.append(kid)
    for s in group:
        s.append_token(30 + s.seq_id)
    plan = [(s, 1) for s in group]
    assert bm.blocks_needed(plan) == 2
    before = bm.num_available_blocks
    for s in group:
        model.apply_copies(_copies(bm.append_slots(s, 1)))
        model.run_chunk(ScheduledChunk(s, 6, 1, True))
        s.num_computed_tokens = 7
    assert before - bm.num_available_blocks == 2
    for s in group:
        model.check_sequence(s)


def test_prefix_cache_reuse_and_cap():
    bm, model = manager_and_model(32)
    a = make_seq(0, list(range(10)))
    assert admit(bm, model, a) == 0
    assert a.num_registered_blocks == 2  # the two full blocks; the partial one is not cached
    b = make_seq(1, list(range(9)) + [99, 98])  # shares 2 full blocks + 1 token
    assert bm.num_cached_prefix_tokens(b) == 8
    assert admit(bm, model, b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.ref_count(a.block_table[0]) == 2
    # An identical prompt that is exactly two blocks reuses only one: the last token must
    # be computed to produce logits, so the whole last block is recomputed.
    c = make_seq(2, list(range(8)))
    assert admit(bm, model, c) == 4
    assert c.block_table[0] == a.block_table[0] and c.block_table[1] != a.block_table[1]
    assert bm.prefix_cache_queries == 10 + 11 + 8
    assert bm.prefix_cache_hits == 8 + 4
    for s in (a, b, c):
        model.check_sequence(s)
    bm.check_invariants()
    # Freed registered blocks stay cached (evictable) and serve a later request.
    for s in (a, b, c):
        bm.free(s)
    assert bm.num_used_blocks == 0 and bm.num_cached_evictable_blocks >= 2
    d = make_seq(3, list(range(10)))
    assert admit(bm, model, d) == 8
    model.check_sequence(d)
    bm.check_invariants()


def test_reset_prefix_cache_keeps_blocks_in_use():
    bm, model = manager_and_model(32)
    a = make_seq(0, list(range(9)))
    b = make_seq(1, list(range(50, 59)))
    admit(bm, model, a)
    admit(bm, model, b)
    bm.free(a)
    assert bm.reset_prefix_cache() == 2
    assert bm.num_cached_evictable_blocks == 0
    assert bm.num_cached_prefix_tokens(make_seq(2, list(range(9)))) == 0
    assert bm.num_cached_prefix_tokens(make_seq(3, list(range(50, 59)))) == 8  # b still holds it
    bm.check_invariants()


def test_prefix_cache_off_never_reuses():
    bm, model = manager_and_model(32, enable_prefix_caching=False)
    a = make_seq(0, list(range(10)))
    admit(bm, model, a)
    b = make_seq(1, list(range(10)))
    assert admit(bm, model, b) == 0
    assert not set(a.block_table) & set(b.block_table)
    bm.free(a)
    assert bm.num_cached_evictable_blocks == 0 and bm.prefix_cache_queries == 0


def test_lru_eviction_order():
    bm, model = manager_and_model(7, watermark=0.0)  # 6 usable blocks
    a = make_seq(0, list(range(0, 9)))     # 2 full blocks + 1 partial
    b = make_seq(1, list(range(50, 59)))
    admit(bm, model, a)
    admit(bm, model, b)
    a_blocks = list(a.block_table)
    bm.free(a)  # a's full blocks become evictable first (least recently used)
    bm.free(b)
    assert bm.num_cached_evictable_blocks == 4 and bm.num_free_blocks == 2
    # Needs 3 blocks: the 2 free ones, then evicts the LRU cached block: a's tail block.
    c = make_seq(2, list(range(100, 112)))
    admit(bm, model, c)
    assert a_blocks[1] in c.block_table and a_blocks[0] not in c.block_table
    assert bm.num_evictions == 1
    # a's first block is still cached, its second is gone; b's prefix is intact.
    a2 = make_seq(3, list(range(0, 9)))
    assert bm.num_cached_prefix_tokens(a2) == 4
    b2 = make_seq(4, list(range(50, 59)))
    assert bm.num_cached_prefix_tokens(b2) == 8
    # A hit moves the block out of the evictable set, so it counts against availability.
    assert bm.blocks_to_allocate(b2, 9) == 3  # 2 evictable hits + 1 fresh
    bm.check_invariants()


def test_swap_out_in_moves_shared_blocks_once():
    bm, model = manager_and_model(32, 8, enable_prefix_caching=False)
    parent = make_seq(0, list(range(10)))
    admit(bm, model, parent)
    kids = []
    for i in (1, 2):
        kid = parent.fork(i)
        bm.fork(parent, kid)
        kids.append(kid)
    group = [parent] + kids
    for k, s in enumerate(group):
        s.append_token(60 + k)
        compute(bm, model, s, 1)
    distinct = {b for s in group for b in s.block_table}
    assert len(distinct) == 2 + 3  # 2 shared full blocks, one private tail each
    assert bm.can_swap_out(group)
    out_pairs = bm.swap_out(group)
    assert len(out_pairs) == len(distinct)
    assert {d for d, _ in out_pairs} == distinct
    model.apply_copies(_copies([], swap_out=out_pairs))
    assert bm.num_used_blocks == 0 and bm.num_used_host_blocks == 5
    for s in group:
        s.status = SequenceStatus.SWAPPED
        model.check_sequence(s)
        assert bm.is_on_host(s)
    bm.check_invariants()
    # Clobber the device pool: swap-in must restore everything from the host copies.
    model.device = [[None] * BS for _ in range(32)]
    assert bm.can_swap_in(group)
    in_pairs = bm.swap_in(group)
    assert len(in_pairs) == len(distinct)
    model.apply_copies(_copies([], swap_in=in_pairs))
    assert parent.block_table[:2] == kids[0].block_table[:2] == kids[1].block_table[:2]
    assert bm.ref_count(parent.block_table[0]) == 3
    for s in group:
        s.status = SequenceStatus.RUNNING
        model.check_sequence(s)
    assert bm.num_used_host_blocks == 0
    bm.check_invariants()


def test_swap_out_refused_when_host_pool_too_small():
    bm, model = manager_and_model(32, 2)
    seq = make_seq(0, list(range(12)))
    admit(bm, model, seq)
    assert not bm.can_swap_out(seq)
    with pytest.raises(RuntimeError):
        bm.swap_out(seq)
    bm.check_invariants()


def test_swapped_sequence_frees_host_blocks():
    bm, model = manager_and_model(32, 8)
    seq = make_seq(0, list(range(12)))
    admit(bm, model, seq)
    bm.swap_out(seq)
    assert bm.num_used_host_blocks == 3
    bm.free(seq)
    assert bm.num_used_host_blocks == 0 and bm.num_used_blocks == 0
    bm.check_invariants()


def test_logical_vs_physical_blocks():
    bm, model = manager_and_model(32, enable_prefix_caching=False)
    parent = make_seq(0, list(range(10)))
    admit(bm, model, parent)
    for i in (1, 2, 3):
        bm.fork(parent, parent.fork(i))
    assert bm.logical_blocks_in_use() == 4 * 3
    assert bm.num_used_blocks == 3
    assert bm.num_tokens_in_use() == 40


def forked_group(bm: BlockManager, model: KVContentModel, prompt_len: int, k: int) -> list[Sequence]:
    """A computed prompt and k - 1 forks, each with one new token to compute."""
    parent = make_seq(0, list(range(100, 100 + prompt_len)))
    admit(bm, model, parent)
    group = [parent]
    for i in range(1, k):
        kid = parent.fork(i)
        bm.fork(parent, kid)
        group.append(kid)
    for s in group:
        s.append_token(30 + s.seq_id)
    return group


def test_allocate_slots_commits_a_group_plan_like_appending_in_order():
    # Three sequences share a partial block: the first two writers copy, the last writes in
    # place. One call does what three append_slots calls in plan order do.
    twins = []
    for _ in range(2):
        bm, model = manager_and_model(16, enable_prefix_caching=False)
        twins.append((bm, model, forked_group(bm, model, 6, 3)))
    (bm, model, group), (ref_bm, _, ref_group) = twins
    need = bm.blocks_needed([(s, 1) for s in group])
    before = bm.num_available_blocks
    copies = bm.allocate_slots([(s, 1) for s in group])
    expected = [c for s in ref_group for c in ref_bm.append_slots(s, 1)]
    assert copies == expected and len(copies) == 2
    assert [s.block_table for s in group] == [s.block_table for s in ref_group]
    assert before - bm.num_available_blocks == need == 2
    model.apply_copies(_copies(copies))
    for s in group:
        model.run_chunk(ScheduledChunk(s, 6, 1, True))
        s.num_computed_tokens = 7
        model.check_sequence(s)
    bm.check_invariants()


def test_allocate_slots_is_all_or_nothing():
    # Two independent sequences each open a new block; only one block is left.
    bm, model = manager_and_model(7, enable_prefix_caching=False, watermark=0.0)
    a, b = make_seq(0, list(range(8))), make_seq(1, list(range(10, 16)))
    admit(bm, model, a)
    admit(bm, model, b)
    filler = make_seq(2, [1])
    admit(bm, model, filler)
    a.append_token(1)
    b.append_token(2)
    b.append_token(3)
    b.append_token(4)  # b: 6 computed + 3 new tokens = 9 tokens, one block more
    assert bm.num_available_blocks == 1 and bm.blocks_needed([(a, 1), (b, 3)]) == 2
    before = snapshot(bm, [a, b, filler])
    assert bm.allocate_slots([(a, 1), (b, 3)]) is None
    assert snapshot(bm, [a, b, filler]) == before  # a did not get its block either
    bm.check_invariants()
    bm.free(filler)
    copies = bm.allocate_slots([(a, 1), (b, 3)])
    assert copies == [] and bm.num_available_blocks == 0
    assert len(a.block_table) == 3 and len(b.block_table) == 3
    bm.check_invariants()


@pytest.mark.parametrize("prompt_len", [6, 8])  # a shared partial block / a fresh block
def test_allocate_slots_one_decode_without_room_changes_nothing(prompt_len):
    bm, model = manager_and_model(1 + -(-prompt_len // BS), enable_prefix_caching=False, watermark=0.0)
    group = forked_group(bm, model, prompt_len, 2)
    assert bm.num_available_blocks == 0 and bm.blocks_needed([(group[0], 1)]) == 1
    before = snapshot(bm, group)
    assert bm.allocate_slots([(group[0], 1)]) is None
    assert snapshot(bm, group) == before
    with pytest.raises(RuntimeError, match="cannot append"):
        bm.append_slots(group[0], 1)
    assert snapshot(bm, group) == before
    bm.check_invariants()


def test_allocate_slots_validation():
    bm, model = manager_and_model(8)
    held = make_seq(0, list(range(5)))
    admit(bm, model, held)
    stranger = make_seq(1, [1, 2])
    with pytest.raises(ValueError, match="no device blocks"):
        bm.allocate_slots([(held, 1), (stranger, 1)])
    with pytest.raises(ValueError, match=">= 1"):
        bm.allocate_slots([(held, 0)])
    assert bm.allocate_slots([]) == []
    assert bm.allocate_slots(iter([(held, 1)])) == []  # any iterable plan
    bm.check_invariants()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), caching=st.booleans(), num_blocks=st.integers(3, 16))
def test_allocate_slots_fits_exactly_when_blocks_needed_fits(data, caching, num_blocks):
    """Random forked groups and plans: None exactly when `blocks_needed` exceeds what is
    available, and then nothing changed; otherwise exactly that many blocks are taken and
    every sequence still reads its own K/V."""
    bm, model = manager_and_model(num_blocks, enable_prefix_caching=caching, watermark=0.0)
    live: list[Sequence] = []
    next_id = 0
    for _ in range(data.draw(st.integers(1, 25), label="num_ops")):
        op = data.draw(st.sampled_from(("admit", "fork", "free", "plan", "plan")), label="op")
        if op == "admit":
            n = data.draw(st.integers(1, 9), label="len")
            seq = make_seq(next_id, [(next_id + i) % 3 for i in range(n)])
            next_id += 1
            if bm.can_allocate(seq, seq.num_tokens, use_watermark=False):
                admit(bm, model, seq)
                live.append(seq)
        elif op == "fork" and live:
            fork_one(data, bm, live, next_id)
            next_id += 1
        elif op == "free" and live:
            bm.free(live.pop(data.draw(st.integers(0, len(live) - 1), label="i")))
        elif op == "plan" and live:
            members = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=4,
                                         unique_by=lambda s: s.seq_id), label="members")
            plan = []
            for s in members:
                for _ in range(data.draw(st.integers(0, 5), label="new")):
                    s.append_token(data.draw(st.integers(0, 2), label="tok"))
                if s.num_uncomputed_tokens:
                    plan.append((s, data.draw(st.integers(1, s.num_uncomputed_tokens), label="n")))
            need = bm.blocks_needed(plan)
            before = snapshot(bm, live)
            copies = bm.allocate_slots(plan)
            if copies is None:
                assert need > bm.num_available_blocks
                assert snapshot(bm, live) == before
            else:
                assert before[3] - bm.num_available_blocks == need
                model.apply_copies(_copies(copies))
                for s, n in plan:
                    model.run_chunk(ScheduledChunk(s, s.num_computed_tokens, n,
                                                   s.num_computed_tokens + n == s.num_tokens))
                    s.num_computed_tokens += n
                    bm.mark_computed(s)
        bm.check_invariants()
        for s in live:
            model.check_sequence(s)
    for s in live:
        bm.free(s)
    bm.check_invariants()
    assert bm.num_used_blocks == 0


# ---------------------------------------------------------------- property test
OPS = ("admit", "step", "fork", "free", "swap_out", "swap_in")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), caching=st.booleans(), num_blocks=st.integers(4, 24),
       num_host=st.integers(0, 12), watermark=st.sampled_from([0.0, 0.1]))
def test_random_operations_keep_invariants_and_contents(data, caching, num_blocks, num_host,
                                                        watermark):
    bm, model = manager_and_model(num_blocks, num_host, enable_prefix_caching=caching, watermark=watermark)
    live: list[Sequence] = []      # on device
    swapped: list[list[Sequence]] = []
    next_id = 0
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [5] * 12]
    for _ in range(data.draw(st.integers(1, 40), label="num_ops")):
        op = data.draw(st.sampled_from(OPS), label="op")
        if op == "admit":
            base = data.draw(st.sampled_from(prefixes), label="prefix")
            cut = data.draw(st.integers(1, len(base)), label="cut")
            tail = data.draw(st.lists(st.integers(0, 9), max_size=6), label="tail")
            seq = Sequence(next_id, f"r{next_id}", base[:cut] + tail, None, 0.0)
            next_id += 1
            cached = bm.num_cached_prefix_tokens(seq)
            assert cached < seq.num_tokens and cached % BS == 0
            n = data.draw(st.integers(1, seq.num_tokens - cached), label="chunk")
            if bm.can_allocate(seq, cached + n):
                before = bm.num_available_blocks
                assert admit(bm, model, seq, n) == cached
                assert before - bm.num_available_blocks <= -(-(cached + n) // BS)
                live.append(seq)
        elif op == "step" and live:
            seq = data.draw(st.sampled_from(live), label="seq")
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(data.draw(st.integers(0, 9), label="tok"))
            n = data.draw(st.integers(1, seq.num_tokens - seq.num_computed_tokens), label="n")
            need = bm.blocks_needed([(seq, n)])
            if bm.can_append(seq, n):
                before = bm.num_available_blocks
                compute(bm, model, seq, n)
                assert before - bm.num_available_blocks == need
            else:
                assert need > bm.num_available_blocks
                with pytest.raises(RuntimeError):
                    bm.append_slots(seq, n)
        elif op == "fork" and live:
            fork_one(data, bm, live, next_id)
            next_id += 1
        elif op == "free" and (live or swapped):
            if swapped and (not live or data.draw(st.booleans(), label="free_swapped")):
                group = swapped.pop(data.draw(st.integers(0, len(swapped) - 1), label="g"))
                for s in group:
                    bm.free(s)
            else:
                seq = live.pop(data.draw(st.integers(0, len(live) - 1), label="i"))
                bm.free(seq)
        elif op == "swap_out" and live:
            k = data.draw(st.integers(1, min(3, len(live))), label="k")
            group = live[-k:]
            if bm.can_swap_out(group):
                del live[-k:]
                model.apply_copies(_copies([], swap_out=bm.swap_out(group)))
                for s in group:
                    s.status = SequenceStatus.SWAPPED
                swapped.append(group)
        elif op == "swap_in" and swapped:
            group = swapped[0]
            if bm.can_swap_in(group, use_watermark=False):
                swapped.pop(0)
                model.apply_copies(_copies([], swap_in=bm.swap_in(group)))
                for s in group:
                    s.status = SequenceStatus.RUNNING
                live.extend(group)
        bm.check_invariants()
        for s in live + [s for g in swapped for s in g]:
            model.check_sequence(s)
    for s in live + [s for g in swapped for s in g]:
        bm.free(s)
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and bm.num_used_host_blocks == 0
    assert bm.num_free_blocks + bm.num_cached_evictable_blocks == num_blocks - 1

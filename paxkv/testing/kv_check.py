"""Check the scheduler and block manager against a model of what the KV pool holds.

`KVContentModel` stands in for the device (and host) pool: every slot records which token
prefix its K/V would encode (a chained hash of token_ids[:p + 1], since a transformer's K/V
at position p depend on the whole prefix). Executing a `SchedulerOutput` on it (swaps,
copies, then the chunks' writes) and checking every read catches any bookkeeping error that
would make the real model attend to wrong or stale K/V: a missed copy-on-write, a cached
block reused for the wrong prefix, a block freed while still in use, a bad swap map.

`run_checked()` drives a whole workload with fake sampled tokens and checks the contents and
the block manager's invariants after every step; the fake tokens depend only on the request
and its fork index, so every policy and pool size must produce the same outputs. (For
memory-policy studies at scale, without the content checks, see `paxkv.sim.simulate`.)
"""
from __future__ import annotations

import dataclasses
import random
from typing import Callable

from paxkv.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from paxkv.engine.sequence import Sequence, SequenceStatus


def prefix_ids(token_ids: list[int]) -> list[int]:
    """Identity of each position's K/V: a chained hash of the prefix ending there."""
    out = []
    h = 0
    for t in token_ids:
        h = hash((h, t))
        out.append(h)
    return out


class KVContentModel:
    """What each device / host block slot holds; raises AssertionError on a wrong read.

    `windows`: each KV group's sliding window (None: full attention), as the block manager
    has them; a chunk reads each group's table only where that group's window reaches.
    """

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 windows: tuple[int | None, ...] = (None,)) -> None:
        self.block_size = block_size
        self.windows = tuple(windows)
        self.device: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.host: list[list[int | None]] = [[None] * block_size for _ in range(num_host_blocks)]
        self.tier: dict[int, list[int | None]] = {}    # the host KV tier's slots

    def apply_copies(self, out: SchedulerOutput) -> None:
        """Offloads to the host KV tier, swap-out, swap-in, copy-on-write, then loads from the
        tier: the order the device runs them in."""
        for d, slot in out.blocks_to_offload:
            self.tier[slot] = list(self.device[d])
        for d, h in out.blocks_to_swap_out:
            self.host[h] = list(self.device[d])
        for h, d in out.blocks_to_swap_in:
            self.device[d] = list(self.host[h])
        for src, dst in out.blocks_to_copy:
            if src == dst:
                raise AssertionError(f"copy-on-write from block {src} onto itself")
            self.device[dst] = list(self.device[src])
        for slot, d in out.blocks_to_load:
            self.device[d] = list(self.tier[slot])

    def run_chunk(self, chunk: ScheduledChunk, ids: list[int] | None = None) -> None:
        """Check the context the chunk attends to, then write its new tokens."""
        seq, bs = chunk.seq, self.block_size
        end = chunk.start + chunk.num_tokens
        if chunk.start != seq.num_computed_tokens:
            raise AssertionError(f"chunk of seq {seq.seq_id} starts at {chunk.start}, "
                                 f"computed {seq.num_computed_tokens}")
        if end > seq.num_tokens or chunk.num_tokens < 1:
            raise AssertionError(f"chunk of seq {seq.seq_id} [{chunk.start}, {end}) is out of range")
        if chunk.needs_sample != (end == seq.num_tokens):
            raise AssertionError(f"chunk of seq {seq.seq_id}: needs_sample is wrong")
        ids = prefix_ids(seq.token_ids) if ids is None else ids
        for g, (window, table) in enumerate(self._tables(seq)):
            if len(table) * bs < end:
                raise AssertionError(f"seq {seq.seq_id} group {g}: table covers "
                                     f"{len(table) * bs} < {end}")
            for p in range(self._first_read(window, chunk.start), chunk.start):
                got = self.device[table[p // bs]][p % bs]
                if got != ids[p]:
                    raise AssertionError(f"seq {seq.seq_id} group {g} reads wrong K/V at "
                                         f"position {p} (block {table[p // bs]})")
            for p in range(chunk.start, end):
                block = table[p // bs]
                if block == 0:
                    raise AssertionError(f"seq {seq.seq_id} group {g} writes into the null block")
                self.device[block][p % bs] = ids[p]

    def _tables(self, seq: Sequence) -> list[tuple[int | None, list[int]]]:
        tables = [seq.block_table, *seq.group_tables]
        if len(tables) != len(self.windows):
            raise AssertionError(f"seq {seq.seq_id} holds {len(tables)} tables for "
                                 f"{len(self.windows)} KV groups")
        return list(zip(self.windows, tables))

    def _first_read(self, window: int | None, start: int) -> int:
        """The first position a query at `start` (or later) reads through `window`."""
        return 0 if window is None else max(0, start - window + 1)

    def check_sequence(self, seq: Sequence) -> None:
        """Every computed position a device-resident sequence can still read holds its own
        K/V (in a sliding group, those its window still covers)."""
        bs = self.block_size
        ids = prefix_ids(seq.token_ids)
        pool = self.host if seq.status is SequenceStatus.SWAPPED else self.device
        for g, (window, table) in enumerate(self._tables(seq)):
            for p in range(self._first_read(window, seq.num_computed_tokens),
                           seq.num_computed_tokens):
                if pool[table[p // bs]][p % bs] != ids[p]:
                    raise AssertionError(f"seq {seq.seq_id} ({seq.status.name}) group {g} lost "
                                         f"its K/V at position {p}")


@dataclasses.dataclass
class CheckRequest:
    prompt_token_ids: list[int]
    max_tokens: int           # outputs per sequence before it finishes (length)
    n: int = 1                # sequences forked after the prompt's prefill
    arrival_step: int = 0     # the step at which it is added


@dataclasses.dataclass
class CheckResult:
    steps: int
    outputs: dict[str, list[list[int]]]        # request id -> output tokens of each sequence
    max_running: int
    num_preemptions: int
    num_batched_tokens: list[int]
    used_blocks: list[int]                      # physical blocks in use after each schedule
    logical_blocks: list[int]                   # blocks the same sequences need unshared


def fake_token(branch: tuple[int, int], seq: Sequence, vocab: int) -> int:
    """A deterministic "sample" of (request, branch) given the tokens so far.

    Independent of seq ids and of scheduling, so every policy must produce the same outputs.
    """
    return hash((branch, len(seq.token_ids), seq.token_ids[-1])) % vocab


def run_checked(scheduler: Scheduler, requests: list[CheckRequest], vocab: int = 50,
             max_steps: int = 100_000, check: bool = True, abort: dict[str, int] | None = None,
             seed: int = 0,
             observe: Callable[[Scheduler, SchedulerOutput, list[Sequence]], None] | None = None,
             ) -> CheckResult:
    """Serve `requests` to completion with fake tokens, checking the KV contents each step.

    `abort` maps request id ("r<index>") -> step at which the request is aborted.
    `observe(scheduler, output, running_before)` is called after every `schedule()` with
    the sequences that were running before it.
    """
    bm = scheduler.block_manager
    model = (KVContentModel(bm.num_blocks, bm.block_size, bm.num_host_blocks, bm.windows)
             if check else None)
    rng = random.Random(seed)
    abort = dict(abort or {})
    pending = sorted(range(len(requests)), key=lambda i: requests[i].arrival_step)
    targets: dict[int, int] = {}
    branch: dict[int, tuple[int, int]] = {}  # seq id -> (request index, fork index)
    all_seqs: dict[str, list[Sequence]] = {}
    next_id = 0
    result = CheckResult(0, {}, 0, 0, [], [], [])
    step = 0
    while pending or scheduler.has_unfinished():
        if step >= max_steps:
            raise AssertionError(f"simulation did not finish in {max_steps} steps")
        while pending and requests[pending[0]].arrival_step <= step:
            i = pending.pop(0)
            r = requests[i]
            seq = Sequence(next_id, f"r{i}", r.prompt_token_ids, None, float(r.arrival_step),
                           fanout=r.n)
            next_id += 1
            targets[seq.seq_id] = r.max_tokens
            branch[seq.seq_id] = (i, 0)
            all_seqs[seq.request_id] = [seq]
            scheduler.add_seq(seq)
        for rid, at in list(abort.items()):
            if at <= step and rid in all_seqs:
                scheduler.abort_request(rid)
                del abort[rid]
        running_before = scheduler.running_seqs if observe else []
        out = scheduler.schedule()
        if observe:
            observe(scheduler, out, running_before)
        result.used_blocks.append(bm.num_used_blocks)
        result.logical_blocks.append(bm.logical_blocks_in_use())
        result.num_batched_tokens.append(out.num_batched_tokens)
        result.max_running = max(result.max_running, scheduler.num_running)
        if check:
            model.apply_copies(out)
            for c in out.chunks:
                model.run_chunk(c)
        scheduler.on_step_done(out)
        for c in out.chunks:
            seq = c.seq
            if not c.needs_sample or seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.num_output_tokens == 0 and seq.fanout > 1:
                for k in range(1, seq.fanout):
                    child = scheduler.fork(seq, next_id)
                    next_id += 1
                    targets[child.seq_id] = targets[seq.seq_id]
                    branch[child.seq_id] = (branch[seq.seq_id][0], k)
                    all_seqs[seq.request_id].append(child)
                    child.append_token(fake_token(branch[child.seq_id], child, vocab), -rng.random())
                    _maybe_finish(scheduler, child, targets)
            seq.append_token(fake_token(branch[seq.seq_id], seq, vocab), -rng.random())
            _maybe_finish(scheduler, seq, targets)
        if check:
            for s in scheduler.running_seqs + scheduler.swapped_seqs:
                model.check_sequence(s)
            bm.check_invariants()
        step += 1
    result.steps = step
    result.num_preemptions = scheduler.num_preemptions
    result.outputs = {rid: [s.output_token_ids for s in seqs] for rid, seqs in all_seqs.items()}
    return result


def _maybe_finish(scheduler: Scheduler, seq: Sequence, targets: dict[int, int]) -> None:
    if seq.num_output_tokens >= targets[seq.seq_id]:
        scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
    elif seq.num_tokens >= scheduler.cfg.max_model_len:
        scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)

"""Which tokens of which sequences the next engine step computes.

Two policies:

- "continuous" (iteration-level batching, the PagedAttention paper's engine). Every step:
  1. running sequences in arrival order: decodes (one token each) are served first out of
     the token budget, partially prefilled sequences continue with chunks of what is left;
     blocks are allocated on demand and, when the pool runs dry, the newest running request
     is preempted (recompute: blocks freed, back to the front of the waiting queue; or swap:
     blocks copied to the host pool, falling back to recompute when the host pool is full);
  2. swapped requests are swapped back in, oldest first (only if nothing was preempted);
  3. waiting sequences are admitted first-come-first-served (only if nothing is swapped out
     and nothing was preempted), reusing cached prefix blocks, with the prompt cut to the
     remaining budget (chunked prefill) or admitted only whole (chunking off).
- "static" (request-level batching, the baseline the paper compares against): a batch of up
  to `max_num_seqs` requests is admitted together, each reserving blocks for
  `max_model_len` tokens up front; nothing else is admitted until all of them finished.

The sequences of one request (forks for n > 1 or beams) are kept together: they are
preempted, swapped out and swapped in as one group (a block they share moves to the host
once). Only a group that cannot fit the pool even alone loses members one at a time.

Progress is guaranteed: the oldest request always gets its blocks (newer ones are preempted
for it), and with nothing running the admission watermark and the batch-slot limit are
waived, so the head of the queue always fits (`max_model_len` must fit the pool: checked by
`EngineConfig`).

The engine's loop: `out = schedule()`; run `out` on the device (swap-out copies, then swap-in
copies, then copy-on-write copies, then the forward pass; the copies whenever present, even
in a step with no chunks); `on_step_done(out)`; append the sampled token of every chunk with
`needs_sample`; `finish()` the sequences that stopped. A running sequence with no uncomputed
token (the engine appended none) is simply not scheduled until it has one.
"""
from __future__ import annotations

import bisect
import dataclasses

from paxkv.cache.block_manager import BlockManager
from paxkv.config import CacheConfig, SchedulerConfig
from paxkv.engine.request_queue import create_request_queue
from paxkv.engine.sequence import Sequence, SequenceStatus

_RUNNING = SequenceStatus.RUNNING


@dataclasses.dataclass(slots=True)
class ScheduledChunk:
    """Compute `seq.token_ids[start:start + num_tokens]` this step.

    `start == seq.num_computed_tokens` when scheduled. `needs_sample` iff the chunk reaches
    the last known token, so its logits give the sequence's next token. `is_prefill` is
    False only for a one-token decode of the last sampled token.
    """

    seq: Sequence
    start: int
    num_tokens: int
    needs_sample: bool
    is_prefill: bool = True


@dataclasses.dataclass
class SchedulerOutput:
    """One step's work. The device runs, in this order: `blocks_to_offload` (device -> the
    host KV tier, before evicted blocks are reused), `blocks_to_swap_out` (device -> host),
    `blocks_to_swap_in` (host -> device), `blocks_to_copy` (device copy-on-write,
    src -> dst), `blocks_to_load` (host KV tier -> device), then the forward over `chunks`."""

    chunks: list[ScheduledChunk] = dataclasses.field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_offload: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    blocks_to_load: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    preempted: list[Sequence] = dataclasses.field(default_factory=list)
    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefix_cached_tokens: int = 0  # tokens of sequences admitted now, served from cache

    @property
    def num_seqs(self) -> int:
        return len(self.chunks)

    @property
    def is_empty(self) -> bool:
        return not (self.chunks or self.blocks_to_copy or self.blocks_to_swap_out
                    or self.blocks_to_swap_in or self.blocks_to_offload or self.blocks_to_load)


@dataclasses.dataclass
class _Request:
    order: int                                  # admission order; ties of arrival_time
    seqs: dict[int, Sequence] = dataclasses.field(default_factory=dict)  # unfinished ones


class Scheduler:
    """Continuous (iteration-level) or static (request-level) batching over a BlockManager."""

    def __init__(self, cfg: SchedulerConfig, cache: CacheConfig, block_manager: BlockManager) -> None:
        """`block_manager` is built from `cache`; the checks across the two configs (the pool
        holds one `max_model_len` sequence) are `EngineConfig`'s."""
        if block_manager.block_size != cache.block_size:
            raise ValueError(f"block_size ({cache.block_size}) differs from the block manager's "
                             f"({block_manager.block_size}): build both from one CacheConfig")
        self.cfg = cfg
        self.block_manager = block_manager
        self.block_size = cache.block_size

        # The scheduling policy (FCFS or priority) is the queue: it orders admission, and
        # its key orders the running batch and the choice of what to preempt.
        self._waiting = create_request_queue(cfg.scheduling_policy)
        self._running: dict[int, Sequence] = {}  # in priority order when _running_sorted
        self._running_sorted = True
        self._swapped: list[list[Sequence]] = []  # groups, oldest first
        self._requests: dict[str, _Request] = {}
        self._priority: dict[int, tuple] = {}     # seq_id -> the queue's key (smaller: older)
        self._next_order = 0
        self._pending: SchedulerOutput | None = None

        self.num_steps = 0
        self.num_preemptions = 0           # sequences preempted, both modes
        self.num_recompute_preemptions = 0
        self.num_swap_preemptions = 0

    # ------------------------------------------------------------------ queues
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_swapped(self) -> int:
        return sum(len(g) for g in self._swapped)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._swapped)

    @property
    def waiting_seqs(self) -> list[Sequence]:
        return list(self._waiting)

    @property
    def running_seqs(self) -> list[Sequence]:
        self._sort_running()
        return list(self._running.values())

    @property
    def swapped_seqs(self) -> list[Sequence]:
        return [s for g in self._swapped for s in g]

    def priority(self, seq: Sequence) -> tuple:
        """Sort key, smaller = served first and preempted last (the scheduling policy's:
        `request_queue.RequestQueue.key`)."""
        return self._priority[seq.seq_id]

    def get_request_seqs(self, request_id: str) -> list[Sequence]:
        """Unfinished sequences of a request (waiting, running or swapped)."""
        req = self._requests.get(request_id)
        return list(req.seqs.values()) if req else []

    def _track(self, seq: Sequence) -> None:
        req = self._requests.get(seq.request_id)
        if req is None:
            req = self._requests[seq.request_id] = _Request(self._next_order)
            self._next_order += 1
        req.seqs[seq.seq_id] = seq
        self._priority[seq.seq_id] = self._waiting.key(seq, req.order)

    def _untrack(self, seq: Sequence) -> None:
        self._priority.pop(seq.seq_id, None)
        req = self._requests.get(seq.request_id)
        if req is not None:
            req.seqs.pop(seq.seq_id, None)
            if not req.seqs:
                del self._requests[seq.request_id]

    def _add_running(self, seq: Sequence) -> None:
        seq.status = _RUNNING
        if self._running and self._running_sorted:
            last = self._priority[next(reversed(self._running))]
            if self._priority[seq.seq_id] < last:
                self._running_sorted = False
        self._running[seq.seq_id] = seq

    def _sort_running(self) -> None:
        if not self._running_sorted:
            prio = self._priority
            self._running = dict(sorted(self._running.items(), key=lambda kv: prio[kv[0]]))
            self._running_sorted = True

    def _add_swapped(self, group: list[Sequence]) -> None:
        keys = [self._priority[g[0].seq_id] for g in self._swapped]
        self._swapped.insert(bisect.bisect(keys, self._priority[group[0].seq_id]), group)

    def _remove_from_queues(self, seq: Sequence) -> None:
        if self._running.pop(seq.seq_id, None) is not None:
            return
        if seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq)
            return
        for i, group in enumerate(self._swapped):
            for j, s in enumerate(group):
                if s is seq:
                    del group[j]
                    if not group:
                        del self._swapped[i]
                    return

    # ------------------------------------------------------------------ requests
    def add_seq(self, seq: Sequence) -> None:
        """Queue a new sequence (status WAITING, no blocks, nothing computed)."""
        if seq.seq_id in self._priority:
            raise ValueError(f"seq_id {seq.seq_id} is already scheduled")
        if (seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table
                or seq.group_tables):
            raise ValueError(f"sequence {seq.seq_id} must be new (WAITING, nothing computed, "
                             f"no blocks), got {seq!r}")
        if seq.num_tokens > self.cfg.max_model_len:
            raise ValueError(f"prompt_token_ids has {seq.num_tokens} tokens, more than "
                             f"max_model_len ({self.cfg.max_model_len})")
        bm = self.block_manager
        need = bm.blocks_per_sequence(seq.num_tokens, self.cfg.max_num_batched_tokens)
        if need > bm.num_blocks - 1 - bm.watermark_blocks:
            raise ValueError(f"prompt_token_ids ({seq.num_tokens} tokens) cannot fit the KV pool "
                             f"({bm.num_blocks - 1} blocks of {self.block_size}, "
                             f"{bm.watermark_blocks} kept free)")
        self._track(seq)
        self._waiting.add(seq, self._priority[seq.seq_id])

    def abort_request(self, request_id: str) -> list[Sequence]:
        """Abort every unfinished sequence of the request, freeing its blocks at once."""
        seqs = self.get_request_seqs(request_id)
        for seq in seqs:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seqs

    def finish(self, seq: Sequence, status: SequenceStatus, reason: object = None) -> None:
        """Retire a sequence (stopped, length, aborted): frees its blocks at once.

        `reason`, when given, is stored as `seq.stop_reason` (the stop string or token id);
        `seq.finish_reason` becomes "stop" / "length" / "abort". Finishing an already
        finished sequence is a no-op.
        """
        if not isinstance(status, SequenceStatus) or not status.is_finished():
            raise ValueError(f"status must be a finished SequenceStatus, got {status!r}")
        if seq.status.is_finished():
            return
        self._remove_from_queues(seq)
        self.block_manager.free(seq)
        seq.status = status
        seq.finish_reason = status.finish_reason
        if reason is not None:
            seq.stop_reason = reason
        self._untrack(seq)

    def fork(self, parent: Sequence, new_seq_id: int) -> Sequence:
        """A running child sharing the parent's blocks copy-on-write (n > 1, beams)."""
        if self._pending is not None:
            raise RuntimeError("call on_step_done() for the last step before forking")
        if parent.status is not _RUNNING:
            raise ValueError(f"only a running sequence can fork, got {parent!r}")
        if new_seq_id in self._priority:
            raise ValueError(f"seq_id {new_seq_id} is already scheduled")
        child = parent.fork(new_seq_id)
        self.block_manager.fork(parent, child)
        self._track(child)
        self._add_running(child)
        return child

    # ------------------------------------------------------------------ one step
    def _seat_cost(self, seq: Sequence) -> int:
        """Batch slots a sequence holds: its fanout until it has forked, then one."""
        return seq.fanout if seq.num_output_tokens == 0 else 1

    def _chunk_len(self, remaining: int, budget: int) -> int:
        if remaining <= budget:
            return remaining
        return budget if self.cfg.enable_chunked_prefill else 0

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks (see the module docstring for the order and the rules).

        Must be followed by `on_step_done(output)` before the next `schedule()` or `fork()`.
        """
        if self._pending is not None:
            raise RuntimeError("call on_step_done() for the last step before scheduling the next")
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        used, seats = self._schedule_running(out, budget)
        if not out.preempted:
            used, seats = self._schedule_swapped(out, budget - used, seats, used)
            if not self._swapped:
                if self.cfg.policy == "static":
                    if not self._running:
                        self._admit_static_batch(out, budget - used)
                else:
                    self._admit_waiting(out, budget - used, seats)
        prefill = 0
        total = 0
        for c in out.chunks:
            total += c.num_tokens
            if c.is_prefill:
                prefill += c.num_tokens
        out.num_batched_tokens = total
        out.num_prefill_tokens = prefill
        out.num_decode_tokens = total - prefill
        out.blocks_to_offload, out.blocks_to_load = self.block_manager.take_tier_copies()
        self.num_steps += 1
        self._pending = out if out.chunks else None
        return out

    def _emit(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        end = start + n
        num_tokens = len(seq.token_ids)
        out.chunks.append(ScheduledChunk(
            seq, start, n, end == num_tokens,
            start < seq.num_prompt_tokens or start < num_tokens - 1))

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, int]:
        """Running groups in priority order; preempts from the newest end when blocks run out.

        Victims are always groups not yet scheduled this step (or the current group itself),
        so nothing scheduled has to be undone. This is the per-step hot path (every running
        sequence, every step): a few list operations per sequence, no per-token work.
        """
        if not self._running:
            return 0, 0
        self._sort_running()
        seqs = list(self._running.values())
        bm = self.block_manager
        seat_cost = self._seat_cost
        num_decodes = 0
        seats = 0
        for s in seqs:
            num_tokens = len(s.token_ids)
            if num_tokens - s.num_computed_tokens == 1:
                num_decodes += 1
            seats += s.fanout if num_tokens == s.num_prompt_tokens else 1
        # Decodes come first: reserve their tokens, prefill chunks get the rest.
        decode_left = min(num_decodes, budget)
        prefill_left = budget - decode_left
        decodes_all_reserved = num_decodes <= budget
        chunks = out.chunks
        copies = out.blocks_to_copy
        allocate_slots = bm.allocate_slots
        used = 0
        end = len(seqs)
        i = 0
        while i < end:
            s = seqs[i]
            rid = s.request_id
            j = i + 1
            while j < end and seqs[j].request_id == rid:
                j += 1
            if j == i + 1:  # a lone sequence: the common case
                remaining = len(s.token_ids) - s.num_computed_tokens
                if remaining == 1:
                    if not decode_left:
                        i = j
                        continue
                    decode_left -= 1
                    plan = ((s, 1),)
                elif remaining > 1:
                    n = self._chunk_len(remaining, prefill_left)
                    if not n:
                        i = j
                        continue
                    prefill_left -= n
                    plan = ((s, n),)
                else:
                    i = j
                    continue
            else:
                plan = []
                for k in range(i, j):
                    m = seqs[k]
                    remaining = len(m.token_ids) - m.num_computed_tokens
                    if remaining == 1:
                        if decode_left:
                            decode_left -= 1
                            plan.append((m, 1))
                    elif remaining > 1:
                        n = self._chunk_len(remaining, prefill_left)
                        if n:
                            prefill_left -= n
                            plan.append((m, n))
                if not plan:
                    i = j
                    continue
            cow = allocate_slots(plan)
            if cow is None:
                while cow is None and end > j:
                    v = end - 1
                    vrid = seqs[v].request_id
                    while v - 1 >= j and seqs[v - 1].request_id == vrid:
                        v -= 1
                    victims = seqs[v:end]
                    end = v
                    for m in victims:
                        seats -= seat_cost(m)
                    if decodes_all_reserved:  # their reserved decode tokens go to prefills
                        freed = sum(1 for m in victims
                                    if len(m.token_ids) - m.num_computed_tokens == 1)
                        decode_left -= freed
                        prefill_left += freed
                    self._preempt(victims, out)
                    cow = allocate_slots(plan)  # victims may have shared blocks with us
                if cow is None:
                    # Nothing newer is left: shed this group's newest members one at a time
                    # (a group that cannot fit whole must not be preempted whole, again and
                    # again).
                    members = seqs[i:j]
                    while cow is None:
                        victim = members.pop()
                        seats -= seat_cost(victim)
                        plan = [(m, n) for m, n in plan if m is not victim]
                        self._preempt([victim], out)
                        cow = allocate_slots(plan)
                    end = i + len(members)
                    if not plan:
                        break
            if cow:
                copies.extend(cow)
            for m, n in plan:
                start = m.num_computed_tokens
                num_tokens = len(m.token_ids)
                chunks.append(ScheduledChunk(
                    m, start, n, start + n == num_tokens,
                    start < m.num_prompt_tokens or start < num_tokens - 1))
                used += n
            i = j
        return used, seats

    def _preempt(self, group: list[Sequence], out: SchedulerOutput) -> None:
        bm = self.block_manager
        for s in group:
            del self._running[s.seq_id]
            s.num_preemptions += 1
        if self.cfg.preemption_mode == "swap" and bm.can_swap_out(group):
            out.blocks_to_swap_out.extend(bm.swap_out(group))
            for s in group:
                s.status = SequenceStatus.SWAPPED
            self._add_swapped(list(group))
            self.num_swap_preemptions += len(group)
        else:
            for s in group:
                bm.free(s)
                s.num_computed_tokens = 0
                s.status = SequenceStatus.WAITING
            self._waiting.prepend(group, [self._priority[s.seq_id] for s in group])
            self.num_recompute_preemptions += len(group)
        out.preempted.extend(group)
        self.num_preemptions += len(group)

    def _plan_tokens(self, group: list[Sequence], budget: int) -> list[tuple[Sequence, int]]:
        """Chunks for the members out of `budget`; those it does not cover wait a step."""
        plan = []
        for s in group:
            remaining = len(s.token_ids) - s.num_computed_tokens
            n = self._chunk_len(remaining, budget) if remaining else 0
            if n > 0:
                budget -= n
                plan.append((s, n))
        return plan

    def _schedule_swapped(self, out: SchedulerOutput, budget: int, seats: int,
                          used: int) -> tuple[int, int]:
        """Swap groups back in, oldest first, keeping the watermark free.

        With nothing running the watermark and the batch-slot limit are waived, and a group
        too big for the whole pool (forks that outgrew it) is turned into recompute
        preemptions, so the engine always makes progress.
        """
        bm = self.block_manager
        while self._swapped:
            group = self._swapped[0]
            idle = not self._running
            cost = sum(self._seat_cost(s) for s in group)
            if seats + cost > self.cfg.max_num_seqs and not idle:
                break
            plan = self._plan_tokens(group, budget)
            if not plan and any(s.num_uncomputed_tokens for s in group):
                break  # no token budget left this step
            need = bm.swap_in_blocks_needed(group, plan)
            if need > bm.num_available_blocks - (0 if idle else bm.watermark_blocks):
                if idle and need > bm.num_available_blocks:
                    self._swapped.pop(0)
                    for s in group:
                        bm.free(s)
                        s.num_computed_tokens = 0
                        s.status = SequenceStatus.WAITING
                    self._waiting.prepend(group, [self._priority[s.seq_id] for s in group])
                    continue
                break
            out.blocks_to_swap_in.extend(bm.swap_in(group))
            self._swapped.pop(0)
            for s in group:
                self._add_running(s)
            cow = bm.allocate_slots(plan)
            if cow is None:  # swap_in_blocks_needed counted these blocks
                raise RuntimeError(f"no room for the planned chunks of swapped-in request "
                                   f"{group[0].request_id}: block accounting is off")
            out.blocks_to_copy.extend(cow)
            for s, n in plan:
                self._emit(out, s, n)
                budget -= n
                used += n
            seats += cost
        return used, seats

    def _admit_waiting(self, out: SchedulerOutput, budget: int, seats: int) -> None:
        """Continuous policy: admit waiting sequences in the queue's order while budget, slots
        and blocks last.

        The watermark (blocks kept free for running sequences to grow into) and the slot
        limit are waived when nothing is running, so the head of the queue always fits.
        """
        bm = self.block_manager
        while self._waiting and budget > 0:
            seq = self._waiting.peek()
            idle = not self._running
            cost = self._seat_cost(seq)
            if seats + cost > self.cfg.max_num_seqs and not idle:
                break
            cached = bm.num_cached_prefix_tokens(seq)
            n = self._chunk_len(len(seq.token_ids) - cached, budget)
            if n <= 0 or not bm.can_allocate(seq, cached + n, use_watermark=not idle):
                break
            self._waiting.pop()
            self._start(seq, cached + n, out)
            self._emit(out, seq, n)
            budget -= n
            seats += cost

    def _start(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> None:
        cached = self.block_manager.allocate(seq, num_tokens)
        seq.num_computed_tokens = cached
        out.num_prefix_cached_tokens += cached
        self._add_running(seq)

    def _admit_static_batch(self, out: SchedulerOutput, budget: int) -> None:
        """Static policy: with nothing running, admit a batch, each reserving max_model_len.

        A request that will fork reserves max_model_len for each of its `fanout` sequences
        (the children's blocks are taken copy-on-write as they write).
        """
        bm = self.block_manager
        max_len = self.cfg.max_model_len
        per_seq = bm.blocks_per_sequence(max_len, self.cfg.max_num_batched_tokens)
        reserved_for_forks = 0
        seats = 0
        while self._waiting:
            seq = self._waiting.peek()
            cost = self._seat_cost(seq)
            if seats + cost > self.cfg.max_num_seqs and seats:
                break
            need = bm.blocks_to_allocate(seq, max_len)
            extra = (cost - 1) * per_seq
            available = bm.num_available_blocks - reserved_for_forks
            if need + extra > available:
                # The first member is admitted with whatever fork reservation fits, so a
                # request whose forks can never all fit still runs (children then take
                # blocks as they write, and may preempt).
                if seats or need > available:
                    break
                extra = available - need
            self._waiting.pop()
            self._start(seq, max_len, out)
            reserved_for_forks += extra
            seats += cost
            n = self._chunk_len(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if n > 0:
                self._emit(out, seq, n)
                budget -= n

    # ------------------------------------------------------------------ after the step
    def on_step_done(self, output: SchedulerOutput) -> None:
        """The step ran: advance computed tokens and register newly full blocks for reuse.

        Sequences finished or aborted since `schedule()` are skipped.
        """
        if output is not self._pending and output.chunks:
            raise ValueError("on_step_done() got an output that is not the last scheduled one")
        self._pending = None
        bm = self.block_manager
        caching = bm.enable_prefix_caching
        bs = self.block_size
        for c in output.chunks:
            s = c.seq
            if s.status is not _RUNNING:
                continue
            if s.num_computed_tokens != c.start:
                raise RuntimeError(f"sequence {s.seq_id} moved since it was scheduled")
            computed = c.start + c.num_tokens
            s.num_computed_tokens = computed
            if caching and computed // bs > s.num_registered_blocks:  # a block just filled
                bm.mark_computed(s)

    def on_extra_decode_step(self, seqs: list[Sequence]) -> None:
        """Multi-step decoding: one more decode token was computed for each running seq.

        The engine ran several decode steps in one device call after one `schedule()`; the
        first is accounted by `on_step_done`, each further one by this (blocks were reserved
        with `BlockManager.append_slots(seq, k)` before the call).
        """
        bm = self.block_manager
        caching = bm.enable_prefix_caching
        bs = self.block_size
        for s in seqs:
            if s.status is not _RUNNING:
                continue
            s.num_computed_tokens += 1
            if caching and s.num_computed_tokens // bs > s.num_registered_blocks:
                bm.mark_computed(s)

    def check_no_leaks(self) -> None:
        """With nothing unfinished, every block is free or evictable (used by tests)."""
        bm = self.block_manager
        if self.has_unfinished():
            raise AssertionError("sequences are still unfinished")
        if bm.num_used_blocks or bm.num_used_host_blocks:
            raise AssertionError(f"{bm.num_used_blocks} device / {bm.num_used_host_blocks} host "
                                 "blocks still referenced with nothing unfinished")
        bm.check_invariants()

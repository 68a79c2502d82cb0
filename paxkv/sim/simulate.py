"""A simulated engine: the real scheduler and block manager, driven without a model (host only).

Scheduling and memory decisions depend only on token counts, never on token values, so the
engine's host side can run a whole trace with dummy tokens: each step, every chunk that
reaches its sequence's end "samples" a dummy token, and a sequence finishes when it has its
trace's output length. What comes out is exactly what the engine would do on an accelerator
(batch sizes, blocks held, preemptions, steps to drain the trace), minus the time per step.

Memory policies compared (the PagedAttention paper's Fig. 2 and its baselines):

- "paged": continuous batching over the paged block manager at a block size: vLLM.
- "reserve-max" / "reserve-pow2" / "reserve-oracle": continuous batching where every request
  reserves, when admitted, all the KV slots it may ever need: `max_model_len`, the next power
  of two of its final length, or exactly its final length (prompt + actual output). These are
  the paper's three Orca variants. Reservations are token-granular and need not be
  contiguous, so external fragmentation is not modelled: a bound kinder to the baseline than
  a real contiguous allocator.
- "static": the engine's static policy, request-level batching: a batch is admitted
  together, each reserving `max_model_len`, and nothing joins until all of it finished.

Memory accounting, measured after each step's K/V writes (before finished sequences free
their blocks): every slot a running sequence holds is either storing a token's K/V, held for
a token it will store later ("reserved"), or will never be written ("wasted": the tail of the
last block, or a reservation beyond the final length). Utilization is stored / held,
time-weighted over steps: the ratio of the sums over steps. It is given over all steps and
over the loaded steps (some request still waiting): the tail of a finite trace, when the
server drains, is not the steady state of a saturated server.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import numpy as np

from paxkv.cache.block_manager import BlockManager
from paxkv.config import CacheConfig, SchedulerConfig, check_pool_fits
from paxkv.engine.scheduler import Scheduler
from paxkv.engine.sequence import Sequence, SequenceStatus
from paxkv.sim.workloads import Request

POLICIES = ("paged", "reserve-max", "reserve-pow2", "reserve-oracle", "static")
_DUMMY_TOKEN = 1
_VOCAB = 32000


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


class ReservingBlockManager(BlockManager):
    """A block manager with one-token blocks where a new sequence takes its whole reservation.

    `reservations[seq_id]` is how many slots the sequence takes on admission (at least what
    the scheduler asks for); once held, the scheduler's appends fall inside the reservation.
    """

    def __init__(self, num_slots: int, reservations: dict[int, int], watermark: float = 0.01) -> None:
        super().__init__(CacheConfig(block_size=1, enable_prefix_caching=False, watermark=watermark,
                                     num_gpu_blocks=num_slots + 1))
        self.reservations = reservations

    def _reserve(self, seq: Sequence, num_tokens: int) -> int:
        if self.is_on_device(seq):
            return num_tokens
        return max(num_tokens, self.reservations[seq.seq_id])

    def _blocks_to_allocate(self, seq: Sequence, num_tokens: int) -> int:
        return super()._blocks_to_allocate(seq, self._reserve(seq, num_tokens))

    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        return super().allocate(seq, self._reserve(seq, num_tokens))


@dataclasses.dataclass
class MemoryTotals:
    """Sums over a set of steps of what the KV pool held (slot-steps, token-steps)."""

    steps: int = 0
    stored: int = 0        # tokens whose K/V are in the pool
    held: int = 0          # slots held by running sequences
    reserved: int = 0      # ... held for tokens not written yet
    wasted: int = 0        # ... that will never be written
    seqs: int = 0          # sequences scheduled
    tokens: int = 0        # tokens computed (prefill + decode + recompute)
    step_utilization: float = 0.0  # sum over steps of stored / held

    def add(self, stored: int, held: int, future: int, seqs: int, tokens: int) -> None:
        self.steps += 1
        self.stored += stored
        self.held += held
        self.reserved += future
        self.wasted += held - stored - future
        self.seqs += seqs
        self.tokens += tokens
        if held:
            self.step_utilization += stored / held

    def summary(self, pool_tokens: int, prefix: str = "") -> dict[str, float]:
        h, n = self.held, self.steps
        return {
            prefix + "steps": n,
            # Time-weighted share of held KV slots that store token states.
            prefix + "utilization": self.stored / h if h else 0.0,
            prefix + "mean_step_utilization": self.step_utilization / n if n else 0.0,
            prefix + "reserved_share": self.reserved / h if h else 0.0,
            prefix + "wasted_share": self.wasted / h if h else 0.0,
            # Share of the whole pool storing token states (free memory counts as lost).
            prefix + "pool_share_stored": self.stored / (n * pool_tokens) if n else 0.0,
            prefix + "mean_batch_size": self.seqs / n if n else 0.0,
        }


@dataclasses.dataclass
class SimResult:
    """Totals of one simulated run: over all steps, and over the loaded steps only (those
    after which some request still waited: the server was saturated, not draining)."""

    policy: str
    block_size: int
    pool_tokens: int
    num_requests: int
    num_finished: int
    output_tokens: int
    preemptions: int
    all: MemoryTotals
    loaded: MemoryTotals
    series: dict[str, list[float]] | None = None

    @property
    def steps(self) -> int:
        return self.all.steps

    @property
    def utilization(self) -> float:
        """Time-weighted share of held KV slots that store token states, all steps."""
        return self.all.stored / self.all.held if self.all.held else 0.0

    @property
    def loaded_utilization(self) -> float:
        return self.loaded.stored / self.loaded.held if self.loaded.held else 0.0

    def summary(self) -> dict[str, float]:
        return {
            "policy": self.policy, "block_size": self.block_size, "pool_tokens": self.pool_tokens,
            "num_requests": self.num_requests, "num_finished": self.num_finished,
            "output_tokens": self.output_tokens, "preemptions": self.preemptions,
            "output_tokens_per_step": self.output_tokens / self.steps if self.steps else 0.0,
            "batch_tokens": self.all.tokens,
            **self.all.summary(self.pool_tokens),
            **self.loaded.summary(self.pool_tokens, "loaded_"),
        }


def _reservation(policy: str, req: Request, max_model_len: int) -> int:
    final = req.prompt_len + req.output_len
    if policy == "reserve-max":
        return max_model_len
    if policy == "reserve-pow2":
        return min(max_model_len, next_pow2(final))
    return min(max_model_len, final)  # oracle


def simulate(requests: Iterable[Request], *, policy: str = "paged", block_size: int = 16,
             pool_tokens: int, max_model_len: int = 2048, max_num_seqs: int = 256,
             max_num_batched_tokens: int = 8192, preemption_mode: str = "recompute",
             enable_chunked_prefill: bool = True, watermark: float = 0.01,
             seconds_per_step: float = 0.0, seed: int = 0, record_series: bool = False,
             max_steps: int | None = None, progress: bool = False) -> SimResult:
    """Run the trace through the host engine with dummy tokens; return memory and batch totals.

    `pool_tokens` is the KV pool's size in token slots (the pool gets `pool_tokens //
    block_size` usable blocks plus the null block). Requests join when the simulated clock
    (`seconds_per_step` per step; 0 = offline, everything queued at once, as arrivals are
    then only an order) reaches their arrival time; an idle engine jumps to the next arrival.
    """
    requests = list(requests)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if pool_tokens < 1:
        raise ValueError(f"pool_tokens must be >= 1, got {pool_tokens}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if seconds_per_step < 0:
        raise ValueError(f"seconds_per_step must be >= 0, got {seconds_per_step}")
    for i, r in enumerate(requests):
        if r.prompt_len < 1 or r.output_len < 1:
            raise ValueError(f"requests[{i}]: prompt_len and output_len must be >= 1, got {r}")
        if r.prompt_len + r.output_len > max_model_len:
            raise ValueError(f"requests[{i}]: prompt_len + output_len = {r.prompt_len + r.output_len} "
                             f"exceeds max_model_len {max_model_len}")

    reservations: dict[int, int] = {}
    if policy.startswith("reserve-"):
        bs = 1
        bm: BlockManager = ReservingBlockManager(pool_tokens, reservations, watermark=watermark)
    else:
        bs = block_size
        bm = BlockManager(CacheConfig(block_size=bs, enable_prefix_caching=False, watermark=watermark,
                                      num_gpu_blocks=pool_tokens // bs + 1))
    sched_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, policy="static" if policy == "static" else "continuous",
        preemption_mode=preemption_mode, enable_chunked_prefill=enable_chunked_prefill)
    check_pool_fits(bm.cache, sched_config)
    sched = Scheduler(sched_config, bm.cache, bm)

    rng = np.random.default_rng(seed)
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_time, i))
    target: dict[int, int] = {}     # seq_id -> output length
    final_kv: dict[int, int] = {}   # seq_id -> tokens whose K/V it will ever store
    next_req = 0
    clock = 0.0
    steps = output_tokens = finished = 0
    totals, loaded = MemoryTotals(), MemoryTotals()
    series: dict[str, list[float]] | None = (
        {"stored": [], "held": [], "batch": [], "running": []} if record_series else None)

    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(requests), desc=f"simulate {policy} bs={block_size}", leave=False)

    while next_req < len(order) or sched.has_unfinished():
        if max_steps is not None and steps >= max_steps:
            break
        if not sched.has_unfinished() and requests[order[next_req]].arrival_time > clock:
            clock = requests[order[next_req]].arrival_time  # idle: jump to the next arrival
        while next_req < len(order) and requests[order[next_req]].arrival_time <= clock:
            i = order[next_req]
            r = requests[i]
            prompt = rng.integers(2, _VOCAB, size=r.prompt_len).tolist()
            seq = Sequence(i, f"r{i}", prompt, None, r.arrival_time)
            target[i] = r.output_len
            final_kv[i] = r.prompt_len + r.output_len - 1  # the last sampled token is never fed back
            if policy.startswith("reserve-"):
                reservations[i] = _reservation(policy, r, max_model_len)
            sched.add_seq(seq)
            next_req += 1
        out = sched.schedule()
        clock += seconds_per_step
        if not out.chunks:
            raise RuntimeError(f"the scheduler made no progress at step {steps} "
                               f"({sched.num_waiting} waiting, {sched.num_running} running)")
        sched.on_step_done(out)
        steps += 1
        # Memory after this step's writes.
        stored = held = future = 0
        for s in sched.running_seqs:
            c = s.num_computed_tokens
            h = len(s.block_table) * bs
            usable = min(h, final_kv[s.seq_id])
            stored += c
            held += h
            future += usable - c
        totals.add(stored, held, future, len(out.chunks), out.num_batched_tokens)
        if sched.num_waiting:
            loaded.add(stored, held, future, len(out.chunks), out.num_batched_tokens)
        if series is not None:
            series["stored"].append(stored)
            series["held"].append(held)
            series["batch"].append(len(out.chunks))
            series["running"].append(sched.num_running)
        # "Sample" and stop.
        for c in out.chunks:
            if not c.needs_sample:
                continue
            s = c.seq
            if s.status is not SequenceStatus.RUNNING:
                continue
            s.append_token(_DUMMY_TOKEN)
            output_tokens += 1
            if s.num_output_tokens >= target[s.seq_id] or s.num_tokens >= max_model_len:
                sched.finish(s, SequenceStatus.FINISHED_LENGTH)
                finished += 1
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    return SimResult(
        policy=policy, block_size=bs, pool_tokens=(bm.num_blocks - 1) * bs,
        num_requests=len(requests), num_finished=finished, output_tokens=output_tokens,
        preemptions=sched.num_preemptions, all=totals, loaded=loaded, series=series)

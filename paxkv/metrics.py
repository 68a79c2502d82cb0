"""Per-step engine statistics and their summary (host only).

Every engine step appends one `StepStats`; `summary()` folds them into the figures the
experiments report: throughput, batch size, KV usage, preemptions, prefix-cache hit rate,
sharing savings, compilations, and the share of step time the host spends.
"""
from __future__ import annotations

import dataclasses
import statistics


@dataclasses.dataclass
class StepStats:
    step: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_seqs_scheduled: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preemptions: int          # preemptions made while scheduling this step
    blocks_used: int
    blocks_free: int
    blocks_logical: int           # blocks the live sequences would hold without sharing
    host_s: float                 # step wall minus the wait for device results
    device_s: float
    compile_s: float
    wall_s: float
    python_s: float = 0.0         # engine Python: scheduling, packing, token bookkeeping


@dataclasses.dataclass
class Metrics:
    steps: list[StepStats] = dataclasses.field(default_factory=list)
    num_blocks: int = 0
    prefix_cache_queries: int = 0     # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0        # of which found cached
    num_requests_finished: int = 0
    num_output_tokens: int = 0
    # Speculative decoding, under vLLM's names: verify rows that had drafts, draft tokens
    # proposed, and of them kept.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0

    def record(self, s: StepStats) -> None:
        self.steps.append(s)

    def reset(self) -> None:
        self.steps.clear()
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.num_requests_finished = self.num_output_tokens = 0
        self.spec_decode_num_drafts = self.spec_decode_num_draft_tokens = 0
        self.spec_decode_num_accepted_tokens = 0

    def summary(self) -> dict[str, float]:
        steps = [s for s in self.steps if s.num_seqs_scheduled]
        run = [s for s in steps if not s.compile_s]
        host = sum(s.host_s for s in run)
        wall = sum(s.wall_s for s in run)
        out: dict[str, float] = {
            "steps": len(steps),
            "prefill_tokens": sum(s.num_prefill_tokens for s in steps),
            "decode_tokens": sum(s.num_decode_tokens for s in steps),
            "output_tokens": self.num_output_tokens,
            "requests_finished": self.num_requests_finished,
            "preemptions": sum(s.num_preemptions for s in self.steps),
            "mean_batch": statistics.fmean(s.num_seqs_scheduled for s in steps) if steps else 0.0,
            "max_blocks_used": max((s.blocks_used for s in self.steps), default=0),
            "mean_kv_usage": statistics.fmean(s.blocks_used / max(1, self.num_blocks - 1)
                                              for s in steps) if steps else 0.0,
            "compile_s": sum(s.compile_s for s in self.steps),
            "wall_s": sum(s.wall_s for s in self.steps),
            "host_share": host / wall if wall else 0.0,
            # The engine's own Python (schedule, pack, append/stop) against step wall time; the
            # rest of the host share is JAX dispatch and transfers.
            "python_share": sum(s.python_s for s in run) / wall if wall else 0.0,
            "prefix_cache_hit_rate": (self.prefix_cache_hits / self.prefix_cache_queries
                                      if self.prefix_cache_queries else 0.0),
            "spec_decode_acceptance_rate": (
                self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens
                if self.spec_decode_num_draft_tokens else 0.0),
            # tokens a verify row emits: its kept drafts and the one after them (vLLM's)
            "spec_decode_mean_acceptance_length": (
                1.0 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts
                if self.spec_decode_num_drafts else 0.0),
        }
        logical = sum(s.blocks_logical for s in steps)
        physical = sum(s.blocks_used for s in steps)
        out["sharing_saving"] = 1.0 - physical / logical if logical else 0.0
        return out

    def format_summary(self) -> str:
        s = self.summary()
        return (f"{int(s['requests_finished'])} requests, {int(s['output_tokens'])} output tokens in "
                f"{int(s['steps'])} steps; mean batch {s['mean_batch']:.1f}; peak KV blocks "
                f"{int(s['max_blocks_used'])}/{self.num_blocks - 1} (mean usage "
                f"{100 * s['mean_kv_usage']:.1f}%); preemptions {int(s['preemptions'])}; "
                f"prefix-cache hit rate {100 * s['prefix_cache_hit_rate']:.1f}%; host share "
                f"{100 * s['host_share']:.1f}%; compile {s['compile_s']:.1f}s")

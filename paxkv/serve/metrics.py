"""Prometheus metrics of the server, under vLLM's names with a `paxkv:` prefix.

Each server owns a private CollectorRegistry (several servers in one process, as in tests,
never collide). Gauges are set from the engine's `EngineState` after every step (sent by
the engine process, or read by the in-process engine thread); counters and histograms are
updated where the event happens. The `*_seconds_total` counters split the server's wall time
(engine step, output processing / detokenization, engine idle, event-loop busy; with an
engine process the first and third are that process's own time) so a benchmark can state
where the time went.
"""
from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from paxkv.serve.ipc import EngineState

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        gauge = functools.partial(Gauge, registry=self.registry)
        counter = functools.partial(Counter, registry=self.registry)
        histogram = functools.partial(Histogram, registry=self.registry)
        self.num_requests_running = gauge("paxkv:num_requests_running",
                                          "Requests with sequences in the running batch")
        self.num_requests_waiting = gauge("paxkv:num_requests_waiting", "Requests waiting to be scheduled")
        self.num_requests_swapped = gauge("paxkv:num_requests_swapped",
                                          "Sequences swapped out to host memory")
        self.kv_cache_usage_perc = gauge("paxkv:kv_cache_usage_perc", "Share of KV blocks in use (1 = full)")
        self.num_preemptions = counter("paxkv:num_preemptions", "Sequences preempted (recompute or swap)")
        self.prefix_cache_queries = counter("paxkv:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("paxkv:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prompt_tokens = counter("paxkv:prompt_tokens", "Prompt tokens admitted")
        self.generation_tokens = counter("paxkv:generation_tokens", "Tokens generated")
        self.requests_finished = counter("paxkv:request_success", "Requests finished")
        self.requests_aborted = counter("paxkv:request_aborted", "Requests aborted (client gone or shutdown)")
        self.requests_rejected = counter("paxkv:request_rejected",
                                         "Requests refused with 503 (waiting queue full)")
        self.ttft = histogram("paxkv:time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY_BUCKETS)
        self.tpot = histogram("paxkv:time_per_output_token_seconds",
                              "Mean time between output tokens of a request", buckets=_TPOT_BUCKETS)
        self.e2e = histogram("paxkv:e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS)
        self.engine_step_seconds = counter("paxkv:engine_step_seconds", "Wall time inside engine.step()")
        self.output_processing_seconds = counter(
            "paxkv:output_processing_seconds",
            "Time turning step outputs into updates (engine-side rows, detokenization included)")
        self.engine_idle_seconds = counter("paxkv:engine_idle_seconds", "Engine loop waiting for requests")
        self.frontend_busy_seconds = counter(
            "paxkv:frontend_busy_seconds",
            "Event-loop time not spent waiting for sockets (HTTP parsing, handlers, JSON, SSE)")
        self.num_compilations = gauge("paxkv:num_compilations",
                                      "Step programs compiled so far (steady state adds none)")
        self.compile_seconds = gauge("paxkv:compile_seconds", "Time spent compiling step programs")
        self.spec_decode_num_drafts = counter(
            "paxkv:spec_decode_num_drafts", "Speculative verify rows that had drafts")
        self.spec_decode_num_draft_tokens = counter(
            "paxkv:spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.spec_decode_num_accepted_tokens = counter(
            "paxkv:spec_decode_num_accepted_tokens", "Draft tokens kept by the verify step")
        self._spec_seen = [0, 0, 0]
        self._preemptions_seen = 0
        self._queries_seen = 0
        self._hits_seen = 0

    def observe_step(self, state: EngineState, step_s: float, process_s: float) -> None:
        """After one engine step: gauges, counters, and where the step's time went."""
        self.observe_state(state)
        self.engine_step_seconds.inc(step_s)
        self.output_processing_seconds.inc(process_s)

    def observe_state(self, state: EngineState) -> None:
        """Gauges and cumulative counters from the engine (also after aborts, with no step)."""
        self.num_requests_waiting.set(state.num_waiting)
        self.num_requests_swapped.set(state.num_swapped)
        self.num_requests_running.set(state.num_running)
        self.kv_cache_usage_perc.set(state.kv_cache_usage)
        self._advance(self.num_preemptions, "_preemptions_seen", state.num_preemptions)
        self._advance(self.prefix_cache_queries, "_queries_seen", state.prefix_cache_queries)
        self._advance(self.prefix_cache_hits, "_hits_seen", state.prefix_cache_hits)
        self.num_compilations.set(state.num_compilations)
        self.compile_seconds.set(state.compile_s)
        totals = (state.spec_decode_num_drafts, state.spec_decode_num_draft_tokens,
                  state.spec_decode_num_accepted_tokens)
        for i, (c, total) in enumerate(zip((self.spec_decode_num_drafts,
                                            self.spec_decode_num_draft_tokens,
                                            self.spec_decode_num_accepted_tokens), totals)):
            if total > self._spec_seen[i]:
                c.inc(total - self._spec_seen[i])
            self._spec_seen[i] = total

    def _advance(self, counter: Counter, attr: str, total: int) -> None:
        seen = getattr(self, attr)
        if total > seen:
            counter.inc(total - seen)
        setattr(self, attr, total)

    def observe_finished(self, arrival: float, first_token: float | None, finish: float,
                         num_tokens: int) -> None:
        self.requests_finished.inc()
        self.e2e.observe(finish - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if num_tokens > 1:
                self.tpot.observe((finish - first_token) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)

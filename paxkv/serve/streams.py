"""From engine outputs to what the HTTP side sends, in two halves that may live in two processes.

Engine half (`OutputRows`): each step's `RequestOutput`s become compact rows of plain tuples,
only what changed: a streamed request's new token ids (and logprobs), a non-streamed one's
whole output once it finishes, and for every changed request its token count. Rows pickle
small (no text, no numpy), so the engine process sends one message per step however many
requests it holds.

Frontend half (`RequestStream`): one per request, turns its rows into `Update`s: text deltas
from an incremental detokenizer (engine/detokenizer.py), finish reasons, and the request's
latency metrics on the frontend's own clock.

Stop strings need text, and they stay where `LLM.generate` checks them: in the engine's
output processor, which decodes the output and ends the request at the token that completes
a stop string. A row carries the stop-truncated text of a sample that a stop string ended
(`stop_text`); nothing else about text crosses. While a request with stop strings streams,
its deltas hold back `len(longest stop string) - 1` characters, so streamed text is always
a prefix of the final (stop-truncated) text: streamed == non-streamed == `LLM.generate`.

Host-only: no JAX.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Callable

from paxkv.engine.detokenizer import StreamedText
from paxkv.outputs import RequestOutput
from paxkv.sampling_params import SamplingParams

logger = logging.getLogger("paxkv.serve")

# (index, new token ids, their logprobs or None, finish_reason, stop_reason, stop_text)
SampleRow = tuple[int, list[int], "list[dict[int, float]] | None", "str | None", "int | str | None",
                  "str | None"]
# (request key, finished, prompt tokens, output tokens of all samples so far, samples,
#  prompt logprobs: with the final row of a request that asked for them, else None)
Row = tuple[int, bool, int, int, tuple[SampleRow, ...], "list[dict[int, float] | None] | None"]


@dataclasses.dataclass
class SampleDelta:
    """What one engine step added to one sample (choice) of a request."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class Update:
    """One request's news from one engine step, as the HTTP side consumes it."""

    deltas: list[SampleDelta]
    finished: bool
    num_prompt_tokens: int
    num_output_tokens: int          # all samples, so far
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None   # with the final update

    def merged(self, later: "Update") -> "Update":
        """This update followed by `later`, as one (a consumer that fell behind catches up
        in one response chunk instead of one per engine step, as vLLM V1's collector does)."""
        if later.error is not None:
            return later
        deltas = {d.index: d for d in self.deltas}
        for d in later.deltas:
            a = deltas.get(d.index)
            if a is None:
                deltas[d.index] = d
                continue
            lps = None if a.logprobs is None and d.logprobs is None else \
                (a.logprobs or []) + (d.logprobs or [])
            deltas[d.index] = SampleDelta(d.index, a.text + d.text, a.token_ids + d.token_ids, lps,
                                          d.finish_reason, d.stop_reason)
        return Update(list(deltas.values()), later.finished, later.num_prompt_tokens,
                      later.num_output_tokens, prompt_logprobs=later.prompt_logprobs)


class EngineError(RuntimeError):
    """The engine failed while running a request (a server-side fault, HTTP 500)."""


# ---- engine half ------------------------------------------------------------------------------
def step_engine(engine: Any, fail_all: Callable[[str], None],
                log: logging.Logger) -> tuple[list[RequestOutput], float] | None:
    """One `engine.step()` as a server makes it (engine process and engine thread alike):
    (outputs, seconds). An engine bug is logged and fails what is in flight (`fail_all`), and
    the server keeps serving: None. The engine's per-step history is dropped: it is for
    offline summaries, and a server runs for days."""
    t0 = time.perf_counter()
    try:
        outs = engine.step()
    except Exception as e:   # noqa: BLE001 - an engine bug: fail what is in flight
        log.exception("engine step failed")
        fail_all(f"engine step failed: {e}")
        return None
    step_s = time.perf_counter() - t0
    engine.metrics.steps.clear()
    return outs, step_s


@dataclasses.dataclass
class _Sent:
    key: int
    stream: bool
    delta: bool                     # the engine gives DELTA outputs: all of them is news
    tokens: dict[int, int] = dataclasses.field(default_factory=dict)   # sample index -> sent
    total: int = 0                  # DELTA: output tokens of all samples so far


class OutputRows:
    """Engine side: which requests a frontend listens to, and what it has been sent."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def track(self, request_id: str, key: int, stream: bool, delta: bool = False) -> None:
        """Listen to a request; `delta`: its SamplingParams ask for DELTA outputs (what a
        stream should: the engine then builds O(new tokens) per step, not O(output))."""
        if delta and not stream:
            raise ValueError("DELTA outputs are for streamed requests (a non-streamed one is "
                             "sent whole at its end)")
        self._sent[request_id] = _Sent(key, stream, delta)

    def forget(self, request_id: str) -> bool:
        """Stop tracking (an abort); False if the request was not tracked (already done)."""
        return self._sent.pop(request_id, None) is not None

    def abort_all(self, engine: Any) -> list[int]:
        """Abort every tracked request in `engine` (after a failed step; best effort) and
        stop tracking them; returns their keys."""
        keys = []
        for rid, sent in self._sent.items():
            try:
                engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - the engine is already in trouble
                logger.exception("abort after failure")
            keys.append(sent.key)
        self._sent.clear()
        return keys

    def rows(self, outs: list[RequestOutput]) -> list[Row]:
        """One row per tracked request the step changed; untracked ones (aborted) are skipped."""
        rows = []
        for out in outs:
            sent = self._sent.get(out.request_id)
            if sent is None:
                continue
            if sent.delta:
                sent.total += sum(len(c.token_ids) for c in out.outputs)
                total = sent.total
            else:
                total = sum(len(c.token_ids) for c in out.outputs)
            if out.finished:
                del self._sent[out.request_id]
            samples = []
            if out.finished or sent.stream:
                for c in out.outputs:
                    if sent.delta:   # all news; a sample may end before its request does
                        ids, lps = c.token_ids, c.logprobs
                        if not ids and c.finish_reason is None:
                            continue
                    else:
                        start = sent.tokens.get(c.index, 0) if sent.stream else 0
                        if not out.finished and len(c.token_ids) <= start:
                            continue
                        sent.tokens[c.index] = len(c.token_ids)
                        ids = c.token_ids[start:]
                        lps = c.logprobs[start:] if c.logprobs is not None else None
                    if out.finished or (sent.delta and c.finish_reason is not None):
                        stop_text = c.text if isinstance(c.stop_reason, str) else None
                        samples.append((c.index, ids, lps, c.finish_reason, c.stop_reason, stop_text))
                    else:
                        samples.append((c.index, ids, lps, None, None, None))
            prompt_logprobs = out.prompt_logprobs if out.finished else None
            rows.append((sent.key, out.finished, len(out.prompt_token_ids), total, tuple(samples),
                         prompt_logprobs))
        return rows


# ---- frontend half ------------------------------------------------------------------------------
class RequestStream:
    """Frontend side of one request: rows in, `Update`s out (see the module docstring)."""

    def __init__(self, params: SamplingParams, stream: bool, tokenizer: Any | None,
                 sink: asyncio.Queue, arrival: float, num_prompt_tokens: int) -> None:
        self.stream = stream
        self.tokenizer = tokenizer
        self.sink = sink
        self.arrival = arrival
        self.num_prompt_tokens = num_prompt_tokens
        self.stop = params.stop
        self.texts: dict[int, StreamedText] = {}
        self.first_token_time: float | None = None
        self.num_output_tokens = 0
        self.max_sample_tokens: dict[int, int] = {}

    def apply(self, row: Row, now: float, metrics: Any) -> Update | None:
        """The update to deliver for `row` (None: nothing the HTTP side needs yet); counts
        generated tokens and, at the end, the request's latencies into `metrics`."""
        _, finished, num_prompt, total, samples, prompt_logprobs = row
        new_tokens = total - self.num_output_tokens
        self.num_output_tokens = total
        started = False
        if new_tokens > 0:
            metrics.generation_tokens.inc(new_tokens)
            if self.first_token_time is None:
                self.first_token_time = now
                started = True
        deltas = [self._delta(s, finished) for s in samples]
        if finished:
            metrics.observe_finished(self.arrival, self.first_token_time, now,
                                     max(self.max_sample_tokens.values(), default=0))
        elif self.stream:
            deltas = [d for d in deltas if d.token_ids or d.text or d.finish_reason]
        elif not started:
            return None
        return Update(deltas, finished, num_prompt, total, prompt_logprobs=prompt_logprobs)

    def _delta(self, s: SampleRow, final: bool) -> SampleDelta:
        index, ids, lps, finish_reason, stop_reason, stop_text = s
        self.max_sample_tokens[index] = self.max_sample_tokens.get(index, 0) + len(ids)
        final = final or finish_reason is not None   # this sample ended (maybe before the others)
        text = self._text(index, ids, final, stop_text) if self.tokenizer is not None else ""
        return SampleDelta(index, text, list(ids), lps, finish_reason, stop_reason)

    def _text(self, index: int, new_ids: list[int], final: bool, stop_text: str | None) -> str:
        if not self.stream:   # one full decode at the end, as LLM.generate does
            return stop_text if stop_text is not None else self.tokenizer.decode(new_ids)
        text = self.texts.get(index)
        if text is None:
            text = self.texts[index] = StreamedText(self.tokenizer, self.stop)
        return text.finish(new_ids, stop_text) if final else text.push(new_ids)

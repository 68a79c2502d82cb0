"""The one engine loop behind the server: a thread that owns the LLMEngine.

Every engine call happens on this thread. HTTP handlers (on the asyncio event loop) only
put commands in a thread-safe inbox (`submit`, `abort`); the loop drains the inbox between
steps, so an abort frees its blocks before the next step is scheduled. After each step the
loop turns the engine's outputs into per-request `Update`s (new token ids, text deltas from
an incremental detokenizer, finish reasons) and hands them to the event loop in one
`call_soon_threadsafe` per step, however many requests changed.

Text deltas hold back `len(longest stop string) - 1` characters while a request with stop
strings runs, so streamed text is always a prefix of the final (stop-truncated) text: the
streamed text equals the non-streamed text, which equals `LLM.generate`'s.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator

from paxkv.engine.detokenizer import IncrementalDetokenizer
from paxkv.outputs import CompletionOutput, RequestOutput
from paxkv.sampling_params import SamplingParams
from paxkv.serve.metrics import ServerMetrics

logger = logging.getLogger("paxkv.serve")


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


class EngineError(RuntimeError):
    """The engine failed while running a request (a server-side fault, HTTP 500)."""


@dataclasses.dataclass
class _Tracked:
    """Engine-thread state of one submitted request."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    sink: asyncio.Queue
    arrival: float
    holdback: int
    detoks: dict[int, IncrementalDetokenizer] = dataclasses.field(default_factory=dict)
    sent_tokens: dict[int, int] = dataclasses.field(default_factory=dict)
    sent_text: dict[int, str] = dataclasses.field(default_factory=dict)
    first_token_time: float | None = None
    num_output_tokens: int = 0


class EngineLoop:
    """Runs `engine.step()` whenever there is work; see the module docstring."""

    def __init__(self, llm: Any, metrics: ServerMetrics) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.tokenizer = llm.get_tokenizer()
        self.metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.fatal: BaseException | None = None

    # ---- called from the event loop --------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="paxkv-engine", daemon=True)
        self._thread.start()

    def check(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The engine's own request checks (ValueError naming the field); returns prompt ids."""
        return self.engine.check_request(prompt, params)[1]

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       stream: bool) -> AsyncIterator[Update]:
        """Submit one request and yield its updates; leaving early (a client gone) aborts it."""
        if not self.alive:   # nothing would ever answer
            raise EngineError(f"the engine loop is not running ({self.fatal!r})")
        sink: asyncio.Queue = asyncio.Queue()
        self._inbox.put(("add", request_id, prompt_ids, params, stream, sink, time.monotonic()))
        finished = False
        try:
            while not finished:
                update = await sink.get()
                if update.error is not None:
                    finished = True
                    raise EngineError(update.error)
                finished = update.finished
                yield update
        finally:
            if not finished:
                self._inbox.put(("abort", request_id))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left and join the thread (the server is shutting down)."""
        self._stopping = True
        self._inbox.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.fatal is None

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                busy = engine.has_unfinished_requests()
                if not self._drain(block=not busy):
                    break
                if not engine.has_unfinished_requests():
                    self.metrics.observe_state(engine)   # after aborts: nothing left to step
                    continue
                t0 = time.perf_counter()
                try:
                    outs = engine.step()
                except Exception as e:   # an engine bug: fail what is in flight, keep serving
                    logger.exception("engine step failed")
                    self._fail_all(f"engine step failed: {e}")
                    continue
                t1 = time.perf_counter()
                batch = self._process(outs)
                t2 = time.perf_counter()
                if batch:
                    self._loop.call_soon_threadsafe(_deliver, batch)
                self.metrics.observe_step(engine, step_s=t1 - t0, process_s=t2 - t1)
        except BaseException as e:  # noqa: BLE001 - report, never die silently
            self.fatal = e
            logger.exception("engine loop died")
            self._fail_all(f"engine loop died: {e}")
        finally:
            for rid in list(self._tracked):
                self._abort(rid)

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; False once asked to stop."""
        engine = self.engine
        while True:
            try:
                if block:   # short waits keep the idle counter current for scrapers
                    t0 = time.perf_counter()
                    try:
                        cmd = self._inbox.get(timeout=0.05)
                    finally:
                        self.metrics.engine_idle_seconds.inc(time.perf_counter() - t0)
                    block = False
                else:
                    cmd = self._inbox.get_nowait()
            except queue.Empty:
                if block:
                    continue
                return True
            kind = cmd[0]
            if kind == "stop":
                return False
            if kind == "abort":
                self._abort(cmd[1])
                continue
            _, rid, ids, params, stream, sink, arrival = cmd
            try:
                engine.add_request(rid, ids, params)
            except ValueError as e:   # checked on the HTTP side already; a race, not a crash
                self._loop.call_soon_threadsafe(_deliver, [(sink, Update([], True, len(ids), 0, str(e)))])
                continue
            holdback = max((len(s) for s in params.stop), default=1) - 1 if stream else 0
            self._tracked[rid] = _Tracked(rid, ids, params, stream, sink, arrival, holdback)
            self.metrics.prompt_tokens.inc(len(ids))

    def _abort(self, rid: str) -> None:
        t = self._tracked.pop(rid, None)
        if t is not None:
            self.engine.abort_request(rid)
            self.metrics.requests_aborted.inc()

    def _fail_all(self, message: str) -> None:
        batch = []
        for rid, t in list(self._tracked.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - the engine is already in trouble
                logger.exception("abort after failure")
            batch.append((t.sink, Update([], True, len(t.prompt_ids), t.num_output_tokens, message)))
        self._tracked.clear()
        if batch and self._loop is not None:
            self._loop.call_soon_threadsafe(_deliver, batch)

    def _process(self, outs: list[RequestOutput]) -> list[tuple[asyncio.Queue, Update]]:
        now = time.monotonic()
        batch = []
        for out in outs:
            t = self._tracked.get(out.request_id)
            if t is None:
                continue   # aborted by its client: nobody is listening
            total = sum(len(c.token_ids) for c in out.outputs)
            new_tokens = total - t.num_output_tokens
            t.num_output_tokens = total
            started = False
            if new_tokens > 0:
                self.metrics.generation_tokens.inc(new_tokens)
                if t.first_token_time is None:
                    t.first_token_time = now
                    started = True
            if out.finished:
                del self._tracked[out.request_id]
                self.metrics.observe_finished(t.arrival, t.first_token_time, now,
                                              max((len(c.token_ids) for c in out.outputs), default=0))
                deltas = [self._delta(t, c, final=True) for c in out.outputs]
            elif t.stream:
                deltas = [d for d in (self._delta(t, c, final=False) for c in out.outputs)
                          if d.token_ids or d.text]
            elif started:   # tells the frontend it no longer waits (admission bound)
                deltas = []
            else:
                continue
            batch.append((t.sink, Update(deltas, out.finished, len(out.prompt_token_ids), total,
                                         prompt_logprobs=out.prompt_logprobs if out.finished else None)))
        return batch

    def _delta(self, t: _Tracked, c: CompletionOutput, final: bool) -> SampleDelta:
        i = c.index
        start = t.sent_tokens.get(i, 0) if t.stream else 0
        new_ids = c.token_ids[start:]
        t.sent_tokens[i] = len(c.token_ids)
        logprobs = c.logprobs[start:] if c.logprobs is not None else None
        text = ""
        if self.tokenizer is not None:
            text = self._text_delta(t, c, new_ids, final)
        return SampleDelta(i, text, list(new_ids), logprobs,
                           c.finish_reason if final else None, c.stop_reason if final else None)

    def _text_delta(self, t: _Tracked, c: CompletionOutput, new_ids: list[int], final: bool) -> str:
        i = c.index
        if not t.stream:   # one full decode at the end, as LLM.generate does
            return c.text if isinstance(c.stop_reason, str) else self.tokenizer.decode(c.token_ids)
        detok = t.detoks.get(i)
        if detok is None:
            detok = t.detoks[i] = IncrementalDetokenizer(self.tokenizer)
        detok.push(new_ids)
        sent = t.sent_text.get(i, "")
        if final:
            detok.flush()
            full = c.text if isinstance(c.stop_reason, str) else detok.text
            if not full.startswith(sent):
                logger.error("request %s: streamed text is not a prefix of the final text", t.request_id)
            t.sent_text[i] = full
            return full[len(sent):]
        visible = detok.text[:len(detok.text) - t.holdback] if t.holdback else detok.text
        if len(visible) <= len(sent):
            return ""
        t.sent_text[i] = visible
        return visible[len(sent):]


def _deliver(batch: list[tuple[asyncio.Queue, Update]]) -> None:
    for sink, update in batch:
        sink.put_nowait(update)

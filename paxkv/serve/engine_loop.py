"""`--no-engine-process`: the engine on a thread of the server process.

Every engine call happens on this thread. HTTP handlers (on the asyncio event loop) only
put commands in a thread-safe inbox (`_submit`, `_abort`); the loop drains the inbox between
steps, so an abort frees its blocks before the next step is scheduled. After each step the
thread turns the engine's outputs into rows and rows into `Update`s (`serve/streams.py`:
text deltas, finish reasons) and hands them to the event loop in one `call_soon_threadsafe`
per step, however many requests changed.

This is the simpler arrangement, and the slower one under load: the engine's Python and the
event loop's HTTP work share one GIL (results/serving.md). The default, `engine_client.py`,
moves the engine into a process of its own.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any

from paxkv.sampling_params import RequestOutputKind, SamplingParams
from paxkv.serve.handle import EngineHandle
from paxkv.serve.ipc import EngineInfo, EngineState
from paxkv.serve.metrics import ServerMetrics
from paxkv.serve.streams import OutputRows, RequestStream, Update, step_engine

logger = logging.getLogger("paxkv.serve")


class EngineLoop(EngineHandle):
    """Runs `engine.step()` on a thread whenever there is work; see the module docstring."""

    def __init__(self, llm: Any, metrics: ServerMetrics) -> None:
        super().__init__(EngineInfo.of(llm), llm.get_tokenizer(), metrics)
        self.llm = llm
        self.engine = llm.llm_engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._rows = OutputRows()
        self._streams: dict[int, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- called from the event loop --------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="paxkv-engine", daemon=True)
        self._thread.start()

    def _submit(self, key: int, request_id: str, prompt_ids: list[int], params: SamplingParams,
                stream: bool, rs: RequestStream) -> None:
        self._inbox.put(("add", key, request_id, prompt_ids, params, stream, rs))

    def _abort(self, key: int) -> None:
        self._inbox.put(("abort", key))

    async def shutdown(self) -> None:
        self.close()

    def close(self, timeout: float = 10.0) -> None:
        """Abort whatever is left and join the thread."""
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
                    self.metrics.observe_state(EngineState.of(engine))   # after aborts
                    continue
                stepped = step_engine(engine, self._fail_all, logger)
                if stepped is None:
                    continue
                outs, step_s = stepped
                t1 = time.perf_counter()
                now = time.monotonic()
                batch = []
                for row in self._rows.rows(outs):
                    rs = self._streams[row[0]]
                    if row[1]:
                        del self._streams[row[0]]
                    update = rs.apply(row, now, self.metrics)
                    if update is not None:
                        batch.append((rs.sink, update))
                t2 = time.perf_counter()
                if batch:
                    self._loop.call_soon_threadsafe(_deliver, batch)
                self.metrics.observe_step(EngineState.of(engine), step_s=step_s, process_s=t2 - t1)
        except BaseException as e:  # noqa: BLE001 - report, never die silently
            self.fatal = e
            logger.exception("engine loop died")
            self._fail_all(f"engine loop died: {e}")
        finally:
            self._rows.abort_all(engine)

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
                rid = str(cmd[1])
                self._streams.pop(cmd[1], None)
                if self._rows.forget(rid):
                    engine.abort_request(rid)
                continue
            _, key, _, ids, params, stream, rs = cmd
            try:
                engine.add_request(str(key), ids, params)
            except ValueError as e:   # checked on the HTTP side already; a race, not a crash
                self._loop.call_soon_threadsafe(_deliver, [(rs.sink, Update([], True, len(ids), 0, str(e)))])
                continue
            self._rows.track(str(key), key, stream, params.output_kind is RequestOutputKind.DELTA)
            self._streams[key] = rs

    def _fail_all(self, message: str) -> None:
        batch = []
        for key in self._rows.abort_all(self.engine):
            rs = self._streams.pop(key, None)
            if rs is not None:
                batch.append((rs.sink, Update([], True, rs.num_prompt_tokens, rs.num_output_tokens,
                                              message)))
        if batch and self._loop is not None:
            self._loop.call_soon_threadsafe(_deliver, batch)


def _deliver(batch: list[tuple[asyncio.Queue, Update]]) -> None:
    for sink, update in batch:
        sink.put_nowait(update)

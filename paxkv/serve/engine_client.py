"""The frontend's end of the engine process (the default arrangement of `paxkv serve`).

Two processes, vLLM V1's shape. The frontend (this process: uvicorn, FastAPI, request checks,
tokenization, chat templates, incremental detokenization, SSE) never imports JAX; the engine
process (`engine_core.py`) owns the `LLM` and steps it continuously. One socket pair joins
them (`ipc.py`): each command goes out as its own frame at once; results come back as
one frame per engine step, read by an asyncio protocol on the event loop, so the frontend has
no thread of its own and the engine's Python never waits for the frontend's GIL.

Faults: when the engine process dies its end of the socket closes; every request in flight
gets an error (HTTP 500, or an error event in a stream), /health answers 503, and the server
shuts down and exits 1 (`on_fatal`). On shutdown (SIGTERM) the frontend sends "shutdown" and
waits for the process, then terminates it if it lingers: no orphan holds the device.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from typing import Any, Callable

import paxkv
from paxkv.sampling_params import SamplingParams
from paxkv.serve.handle import EngineHandle
from paxkv.serve.ipc import Channel, EngineInfo, FrameBuffer, frame
from paxkv.serve.metrics import ServerMetrics
from paxkv.serve.streams import RequestStream, Update

logger = logging.getLogger("paxkv.serve")

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(paxkv.__file__)))


class EngineStartError(RuntimeError):
    """The engine process ended before it was ready."""


def launch_engine_process(config: dict[str, Any]) -> tuple[subprocess.Popen, socket.socket, EngineInfo]:
    """Start the engine process and wait until its model is loaded.

    `config`: {"model", "engine_args" (LLM keywords), "tokenizer" (a directory or None)}.
    A bad engine argument is a ValueError (its message names the field), as from LLM(...).
    """
    mine, theirs = socket.socketpair()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.Popen([sys.executable, "-m", "paxkv.serve.engine_core", "--fd", str(theirs.fileno())],
                            pass_fds=(theirs.fileno(),), env=env)
    theirs.close()
    channel = Channel(mine)
    try:
        channel.send(config)
        while True:   # model loading takes as long as it takes; a dead process ends the wait
            msgs = channel.receive(1.0)
            if msgs:
                break
            if proc.poll() is not None:
                raise EOFError
    except (EOFError, BrokenPipeError, ConnectionResetError):
        code = proc.wait()
        mine.close()
        raise EngineStartError(f"the engine process exited with code {code} while starting") from None
    kind, payload = msgs[0]
    if kind == "error":
        proc.wait()
        mine.close()
        raise ValueError(payload)
    logger.info("engine process %d ready: %s", proc.pid, payload)
    return proc, mine, payload


class _Protocol(asyncio.Protocol):
    def __init__(self, client: "EngineClient") -> None:
        self.client = client
        self.frames = FrameBuffer()

    def data_received(self, data: bytes) -> None:
        for msg in self.frames.feed(data):
            self.client._on_message(msg)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._on_engine_gone()


class EngineClient(EngineHandle):
    """Requests to the engine process and their updates back; see the module docstring."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, info: EngineInfo,
                 tokenizer: Any | None, metrics: ServerMetrics) -> None:
        super().__init__(info, tokenizer, metrics)
        self.proc = proc
        self._sock = sock
        self._transport: asyncio.Transport | None = None
        self._streams: dict[int, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.on_fatal: Callable[[], None] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    # ---- the interface the routes use ------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._transport, _ = await self._loop.create_connection(lambda: _Protocol(self), sock=self._sock)

    @property
    def alive(self) -> bool:
        return self._transport is not None and not self._stopping and self.fatal is None

    def _submit(self, key: int, request_id: str, prompt_ids: list[int], params: SamplingParams,
                stream: bool, rs: RequestStream) -> None:
        self._streams[key] = rs
        self._send(("add", key, prompt_ids, params, stream))

    def _abort(self, key: int) -> None:
        if self._streams.pop(key, None) is not None and self.alive:
            self._send(("abort", key))

    async def shutdown(self, timeout: float = 30.0) -> None:
        if self._transport is not None and self.fatal is None and not self._stopping:
            self._stopping = True
            self._send(("shutdown",))
            deadline = time.monotonic() + 5.0
            while self._transport.get_write_buffer_size() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            try:
                await asyncio.to_thread(self.proc.wait, timeout)
            except subprocess.TimeoutExpired:
                logger.error("the engine process did not stop in %.0f s: terminating it", timeout)
        self._stopping = True
        self._fail_all("the server is shutting down")
        self.close()

    def close(self) -> None:
        self._stopping = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._transport is not None:
            self._transport.close()
        else:
            self._sock.close()

    # ---- the wire -------------------------------------------------------------------------------
    def _send(self, cmd: tuple) -> None:
        """Write one command now. Batching them per event-loop turn (as before) held a
        burst's first request back until the loop had run every other ready handler of the
        burst, each milliseconds of HTTP parsing and checks, while the engine had nothing to
        do; a frame per command costs microseconds."""
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(frame([cmd]))

    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "step":
            _, rows, state, step_s, process_s, idle_s = msg
            t0 = time.perf_counter()
            now = time.monotonic()
            streams = self._streams
            for row in rows:
                rs = streams.get(row[0])
                if rs is None:
                    continue   # aborted here while the engine stepped
                if row[1]:
                    del streams[row[0]]
                update = rs.apply(row, now, self.metrics)
                if update is not None:
                    rs.sink.put_nowait(update)
            self.metrics.observe_step(state, step_s, process_s + time.perf_counter() - t0)
            self.metrics.engine_idle_seconds.inc(idle_s)
        elif kind == "failed":
            _, keys, message = msg
            for key in keys:
                rs = self._streams.pop(key, None)
                if rs is not None:
                    rs.sink.put_nowait(Update([], True, rs.num_prompt_tokens, rs.num_output_tokens,
                                              message))
        else:
            logger.error("unexpected message from the engine process: %r", kind)

    def _on_engine_gone(self) -> None:
        if self._stopping:
            return
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        self.fatal = f"the engine process died (exit code {code})"
        logger.error("%s: failing %d requests in flight and shutting down", self.fatal,
                     len(self._streams))
        self._fail_all(self.fatal)
        if self.on_fatal is not None:
            self.on_fatal()

    def _fail_all(self, message: str) -> None:
        for rs in self._streams.values():
            rs.sink.put_nowait(Update([], True, rs.num_prompt_tokens, rs.num_output_tokens, message))
        self._streams.clear()

"""The wire between the frontend process and the engine process: framed pickles over a socket.

A frame is a 4-byte big-endian length and a pickle of plain Python values (tuples, lists,
ints, strings, SamplingParams). Frontend -> engine, one frame per event-loop turn holds a
list of commands:

    ("add", key, prompt_token_ids, SamplingParams, stream)   checked by the frontend already
    ("abort", key)
    ("shutdown",)

Engine -> frontend, one frame per message:

    ("ready", EngineInfo)                 once the model is loaded (or ("error", text))
    ("step", rows, EngineState, step_s, process_s, idle_s)   once per engine step
    ("failed", keys, text)                requests a failed engine step took down

`rows` are `serve/streams.py`'s. The engine's end is a blocking socket (`Channel`); the
frontend's is an asyncio transport fed through `FrameBuffer`.

Host-only: no JAX.
"""
from __future__ import annotations

import dataclasses
import pickle
import select
import socket
import struct
from typing import Any

_HEADER = struct.Struct("!I")


def frame(obj: Any) -> bytes:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


class FrameBuffer:
    """Bytes in, whole messages out (a frame may arrive in pieces)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        out, at, buf = [], 0, self._buf
        while len(buf) - at >= _HEADER.size:
            (n,) = _HEADER.unpack_from(buf, at)
            end = at + _HEADER.size + n
            if len(buf) < end:
                break
            out.append(pickle.loads(memoryview(buf)[at + _HEADER.size:end]))
            at = end
        if at:
            del buf[:at]
        return out

    @property
    def pending(self) -> bool:
        """Whether part of a frame is waiting for the rest."""
        return bool(self._buf)


class Channel:
    """A blocking socket end that sends frames and receives whatever whole frames arrived."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self.sock = sock
        self._frames = FrameBuffer()

    def send(self, obj: Any) -> None:
        self.sock.sendall(frame(obj))

    def receive(self, timeout: float | None) -> list[Any]:
        """Messages that arrived (waiting up to `timeout` s for the first byte; None: forever).
        EOFError when the other end has closed."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return []
        out = []
        while True:
            try:
                data = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if out or not self._frames.pending:
                    return out
                select.select([self.sock], [], [])   # a frame is half here: wait for the rest
                continue
            if not data:
                raise EOFError("the other end of the engine channel closed")
            out += self._frames.feed(data)

    def receive_one(self, timeout: float | None = None) -> Any:
        """The next message (blocking)."""
        while True:
            msgs = self.receive(timeout)
            if msgs:
                if len(msgs) > 1:
                    raise RuntimeError(f"expected one message, got {len(msgs)}")
                return msgs[0]
            if timeout is not None:
                raise TimeoutError("no message from the engine channel")

    def close(self) -> None:
        self.sock.close()


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What the frontend needs to know of the engine to check requests and answer /v1/models."""

    vocab_size: int
    max_model_len: int
    num_layers: int
    max_logprobs: int
    max_num_seqs: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def of(cls, llm: Any) -> "EngineInfo":
        engine = llm.llm_engine
        return cls(engine.model_config.vocab_size, engine.max_model_len,
                   engine.model_config.num_layers, llm.config.max_logprobs,
                   llm.config.scheduler.max_num_seqs, tuple(sorted(engine.eos_token_ids)))


@dataclasses.dataclass(frozen=True)
class EngineState:
    """The engine's gauges and cumulative counters after a step, for /metrics."""

    num_waiting: int
    num_swapped: int
    num_running: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_compilations: int
    compile_s: float
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0

    @classmethod
    def of(cls, engine: Any) -> "EngineState":
        sched, bm = engine.scheduler, engine.block_manager
        waiting = sched.num_waiting
        runner = getattr(engine, "runner", None)
        return cls(waiting, sched.num_swapped,
                   max(0, engine.get_num_unfinished_requests() - waiting - sched.num_swapped),
                   bm.num_used_blocks / max(1, bm.num_blocks - 1), sched.num_preemptions,
                   bm.prefix_cache_queries, bm.prefix_cache_hits,
                   getattr(runner, "num_compilations", 0), getattr(runner, "compile_time_s", 0.0),
                   *_spec_counts(engine))


def _spec_counts(engine: Any) -> tuple[int, int, int]:
    m = getattr(engine, "metrics", None)
    return (getattr(m, "spec_decode_num_drafts", 0), getattr(m, "spec_decode_num_draft_tokens", 0),
            getattr(m, "spec_decode_num_accepted_tokens", 0))

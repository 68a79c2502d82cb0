"""What the HTTP routes see of the engine, wherever it runs: `EngineHandle`.

Two implementations: `engine_client.EngineClient` (the default: the engine in its own
process) and `engine_loop.EngineLoop` (`--no-engine-process`: the engine on a thread of the
server process). Both check requests with the engine's own validator before anything is
queued, and both turn the engine's rows into updates with `streams.RequestStream`, so their
outputs are the same by construction.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, AsyncIterator

from paxkv.engine.detokenizer import IncrementalDetokenizer
from paxkv.engine.llm_engine import check_request
from paxkv.engine.request_features import RequestFeatures
from paxkv.engine.validation import RequestValidator
from paxkv.sampling_params import SamplingParams
from paxkv.serve.ipc import EngineInfo
from paxkv.serve.metrics import ServerMetrics
from paxkv.serve.streams import EngineError, RequestStream, Update


class EngineHandle:
    """Submit, stream and abort requests; subclasses say how commands reach the engine."""

    def __init__(self, info: EngineInfo, tokenizer: Any | None, metrics: ServerMetrics) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.fatal: BaseException | str | None = None
        self._validator = RequestValidator(info.vocab_size, info.max_model_len, tokenizer,
                                           max_logprobs=info.max_logprobs,
                                           num_layers=info.num_layers)
        self._features = RequestFeatures(tokenizer, info.vocab_size, list(info.eos_token_ids))
        self._keys = itertools.count()
        self._live: dict[int, RequestStream] = {}   # requests a route is still consuming
        if tokenizer is not None:   # builds the byte table now (seconds for a 128k vocabulary),
            IncrementalDetokenizer(tokenizer)   # not on the event loop at the first stream

    # ---- the interface the routes use ------------------------------------------------------
    async def start(self) -> None:
        raise NotImplementedError

    async def shutdown(self) -> None:
        """Stop the engine (the server is shutting down); in-flight requests are aborted."""
        raise NotImplementedError

    def close(self) -> None:
        """Last resort after the event loop has ended: make sure the engine is gone."""

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def check(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The engine's own request checks (ValueError naming the field); returns prompt ids."""
        return check_request(self._validator, self._features, prompt, params)[1]

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       stream: bool) -> AsyncIterator[Update]:
        """Submit one request and yield its updates; leaving early (a client gone) aborts it."""
        if not self.alive:   # nothing would ever answer
            raise EngineError(f"the engine is not running ({self.fatal!r})")
        key = next(self._keys)
        sink: asyncio.Queue = asyncio.Queue()
        rs = RequestStream(params, stream, self.tokenizer, sink, time.monotonic(), len(prompt_ids))
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        self._submit(key, request_id, prompt_ids, params, stream, rs)
        self._live[key] = rs
        finished = False
        try:
            while not finished:
                update = await sink.get()
                while update.error is None and not update.finished and not sink.empty():
                    update = update.merged(sink.get_nowait())
                if update.error is not None:
                    finished = True
                    raise EngineError(update.error)
                finished = update.finished
                yield update
        finally:
            self._live.pop(key, None)
            if not finished:
                self.metrics.requests_aborted.inc()
                self._abort(key)

    def end_all(self, message: str) -> int:
        """End every request a route is consuming with an error update (their routes answer
        with an error, a stream with an error event and `[DONE]`) and abort them in the engine;
        used when the server stops and cannot wait any longer. Returns how many ended."""
        live, self._live = self._live, {}
        for key, rs in live.items():
            rs.sink.put_nowait(Update([], True, rs.num_prompt_tokens, rs.num_output_tokens, message))
            self.metrics.requests_aborted.inc()
            self._abort(key)
        return len(live)

    # ---- what a subclass provides -------------------------------------------------------------
    def _submit(self, key: int, request_id: str, prompt_ids: list[int], params: SamplingParams,
                stream: bool, rs: RequestStream) -> None:
        raise NotImplementedError

    def _abort(self, key: int) -> None:
        raise NotImplementedError

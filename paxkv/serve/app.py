"""The OpenAI-compatible routes (FastAPI): completions, chat, models, tokenize, health, metrics.

A handler parses its body with the protocol models, builds SamplingParams and runs the
engine's own request checks, so bad input is a 400 before anything reaches the engine (its
own process by default, `engine_client.py`; a thread of this one with `--no-engine-process`,
`engine_loop.py`: the routes see either as an `EngineHandle`). Bodies are read under the
bounds of `limits.py`; tokenization, chat templates, grammars and large bodies' parsing run on
a worker thread, so one heavy request never stalls the event loop (and /health) for others.
Admission is bounded: requests that have not produced a token yet count as waiting, reserved
at admission, and beyond `max_waiting_requests` a new one gets 503. Responses stream as
server-sent events (`data: {json}` per delta, `data: [DONE]` last); a client that goes away
has its requests aborted (by the generator's `finally`), freeing their blocks before the next
engine step. When the server stops, responses still open after `--shutdown-timeout` end with
an error (a stream: an error event, then `[DONE]`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from paxkv.sampling_params import SamplingParams
from paxkv.serve import protocol as proto
from paxkv.serve.handle import EngineHandle
from paxkv.serve.streams import EngineError, SampleDelta, Update
from paxkv.serve.errors import APIError, check_json_object, from_validation_error, from_value_error
from paxkv.serve.limits import RequestLimits, read_body
from paxkv.serve.metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger("paxkv.serve")

_OPEN_PATHS = ("/health", "/metrics")
_PARSE_ON_LOOP_BYTES = 64 << 10   # larger bodies are parsed on the worker thread
SHUTDOWN_MESSAGE = "the server is shutting down"


@dataclasses.dataclass
class ServerState:
    """Everything the routes share; built once by the CLI (or a test)."""

    engine: EngineHandle
    served_model_names: list[str]
    api_key: str | None = None
    max_waiting_requests: int = 10_000
    limits: RequestLimits = dataclasses.field(default_factory=RequestLimits)
    waiting: int = 0        # admitted engine requests that have produced no token yet
    stopping: bool = False  # open responses are being ended (the server stops)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        info = self.engine.info
        self.metrics: ServerMetrics = self.engine.metrics
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = info.max_model_len
        self.max_num_seqs = info.max_num_seqs
        self.max_logprobs = info.max_logprobs
        self.vocab_size = info.vocab_size
        # One worker: request preparation stays in arrival order and off the event loop.
        self.prep = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="paxkv-prep")

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run host work that scales with the request (tokenizing, templates, grammars)."""
        return await asyncio.get_running_loop().run_in_executor(self.prep, fn, *args)

    def end_open_responses(self) -> None:
        """Shutdown's last word: every response still open ends now with an error."""
        self.stopping = True
        ended = self.engine.end_all(SHUTDOWN_MESSAGE)
        if ended:
            logger.warning("shutdown: ended %d requests still running", ended)


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.engine.start()
        yield
        await state.engine.shutdown()
        state.prep.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="paxkv", lifespan=lifespan)
    app.state.paxkv = state
    if state.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=state.api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        """A bug is still a 500 in OpenAI's shape (logged with its traceback)."""
        logger.error("internal error on %s", request.url.path, exc_info=e)
        return APIError(500, f"internal error: {type(e).__name__}", None, "internal_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        """Unknown routes and methods answer in OpenAI's error shape too."""
        message = f"{request.method} {request.url.path}: {e.detail}"
        return APIError(e.status_code, message, None, str(e.detail).lower().replace(" ", "_")).response()

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.alive:
            return APIError(503, f"the engine is not running ({state.engine.fatal})").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "paxkv",
                "root": name, "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name) for name in state.served_model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        _check_model(state, model_id)
        return model_card(model_id)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await _parse(request, proto.TokenizeRequest)
        _check_model(state, body.model)
        tok = _need_tokenizer(state, "prompt")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt", "invalid_value")
        try:
            if body.messages is not None:
                ids = await state.off_loop(lambda: tok.apply_chat_template(
                    [{"role": m.role, "content": m.text()} for m in body.messages],
                    add_generation_prompt=body.add_generation_prompt))
            else:
                ids = await state.off_loop(lambda: tok.encode(
                    body.prompt, add_special_tokens=body.add_special_tokens))
        except ValueError as e:
            raise from_value_error(e, default="messages") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await _parse(request, proto.DetokenizeRequest)
        _check_model(state, body.model)
        tok = _need_tokenizer(state, "tokens")
        vocab = state.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: id {bad[0]} is outside the vocabulary [0, {vocab})",
                           "tokens", "invalid_value")
        return {"prompt": await state.off_loop(tok.decode, body.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, proto.CompletionRequest)
        params = _prepare(state, body, {}, body.logprobs, "logprobs")
        prompts = body.prompts()

        def prepare() -> tuple[list[list[int]], list[str]]:
            ids = [_check_prompt(state, p, params, "prompt", body) for p in prompts]
            # The prompt's text is needed only to echo it (token-id prompts are decoded for that).
            texts = [p if isinstance(p, str) else _decode(state, i) if body.echo else ""
                     for p, i in zip(prompts, ids)]
            return ids, texts

        ids, texts = await state.off_loop(prepare)
        for i in ids:
            _check_length(state, len(i), body.max_tokens, "max_tokens", body.min_tokens)
        return await _respond(state, request, body, params, ids,
                              _CompletionFormat(state, body, texts, ids))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _parse(request, proto.ChatCompletionRequest)
        renames = {"max_tokens": "max_completion_tokens" if body.max_completion_tokens is not None
                   else "max_tokens", "logprobs": "top_logprobs"}
        params = _prepare(state, body, renames, params_logprobs(body), "top_logprobs")
        tok = _need_tokenizer(state, "messages")

        def prepare() -> list[int]:
            try:
                prompt = tok.apply_chat_template(body.conversation(),
                                                 add_generation_prompt=body.add_generation_prompt)
            except ValueError as e:
                raise from_value_error(e, default="messages") from None
            return _check_prompt(state, prompt, params, "messages", body)

        ids = await state.off_loop(prepare)
        max_field = renames["max_tokens"]
        _check_length(state, len(ids), getattr(body, max_field), max_field, body.min_tokens)
        return await _respond(state, request, body, params, [ids], _ChatFormat(state, body))

    return app


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` (except /health and /metrics).

    Plain ASGI rather than `@app.middleware("http")`: Starlette's BaseHTTPMiddleware runs every
    request in a task of its own and passes each chunk of a streamed response through a memory
    stream, a per-chunk cost on every server-sent event."""

    def __init__(self, app: Callable, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(header, self.expected):   # constant time: no timing oracle
                response = APIError(401, "missing or wrong API key (Authorization: Bearer ...)",
                                    None, "invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def params_logprobs(body: proto.ChatCompletionRequest) -> int | None:
    return (body.top_logprobs or 0) if body.logprobs else None


# ---- request checks ------------------------------------------------------------------------
async def _parse(request: Request, model: type[BaseModel]) -> Any:
    state: ServerState = request.app.state.paxkv
    raw = await read_body(request, state.limits)
    body = _validate(raw, model) if len(raw) <= _PARSE_ON_LOOP_BYTES else \
        await state.off_loop(_validate, raw, model)
    extra = body.unknown_fields() if isinstance(body, proto.OpenAIModel) else []
    if extra:
        logger.warning("ignoring unknown request fields: %s", ", ".join(extra))
    return body


def _validate(raw: bytes, model: type[BaseModel]) -> Any:
    check_json_object(raw)
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.served_model_names:
        raise APIError(404, f"the model `{model}` does not exist (served: "
                       f"{', '.join(state.served_model_names)})", "model", "model_not_found")


def _need_tokenizer(state: ServerState, param: str) -> Any:
    if state.tokenizer is None:
        raise APIError(400, f"{param}: this model has no tokenizer; use token-id prompts with "
                       "/v1/completions", param, "no_tokenizer")
    return state.tokenizer


def _prepare(state: ServerState, body: proto.SamplingFields, renames: dict[str, str],
             logprobs: int | None, logprobs_field: str) -> SamplingParams:
    """Model, unsupported fields, SamplingParams (the engine's checks) and server limits."""
    _check_model(state, body.model)
    bad = body.unsupported()
    if bad is not None:
        raise APIError(400, bad[1], bad[0], "unsupported")
    try:
        params = body.to_sampling_params()
    except ValueError as e:
        raise from_value_error(e, renames) from None
    except TypeError as e:
        raise APIError(400, str(e), None, "invalid_value") from None
    if logprobs is not None and logprobs > state.max_logprobs:
        raise APIError(400, f"{logprobs_field} must be <= {state.max_logprobs}, got {logprobs}",
                       logprobs_field, "invalid_value")
    if params.best_of > state.max_num_seqs:
        field = "best_of" if params.best_of > params.n else "n"
        raise APIError(400, f"{field} must be <= max_num_seqs ({state.max_num_seqs}), got "
                       f"{params.best_of}", field, "invalid_value")
    return params


def _check_prompt(state: ServerState, prompt: Any, params: SamplingParams, field: str,
                  body: proto.SamplingFields) -> list[int]:
    """The engine's checks; a grammar that does not compile names the field that gave it."""
    renames = {"prompt": field, "structured_outputs": body.structured_field() or "structured_outputs"}
    try:
        return state.engine.check(prompt, params)
    except ValueError as e:
        raise from_value_error(e, renames, default=field) from None


def _check_length(state: ServerState, num_prompt: int, max_tokens: int | None, field: str,
                  min_tokens: int) -> None:
    """vLLM's check: prompt + max_tokens (and min_tokens) must fit max_model_len; a request
    that sets neither gets whatever room the prompt leaves."""
    room = state.max_model_len - num_prompt
    for name, value in ((field, max_tokens), ("min_tokens", min_tokens)):
        if value is not None and value > room:
            raise APIError(400, f"This model's maximum context length is {state.max_model_len} "
                           f"tokens. However, you requested {num_prompt + value} tokens "
                           f"({num_prompt} in the prompt, {value} in {name}). Please reduce the "
                           f"length of the prompt or {name}.", name, "context_length_exceeded")


def _decode(state: ServerState, ids: list[int]) -> str:
    return state.tokenizer.decode(ids) if state.tokenizer is not None else ""


def _token_str(state: ServerState, token: int) -> str:
    if state.tokenizer is None:
        return f"token_id:{token}"
    return state.tokenizer.decode([token], skip_special_tokens=False)


# ---- running requests ------------------------------------------------------------------------
class _Admission:
    """Waiting slots taken at admission, in the same event-loop turn as the bound's check (so
    a burst cannot pass the check before any of it is counted); each engine request gives its
    slot back at its first token or its end, and the response's end gives back the rest."""

    def __init__(self, state: ServerState, count: int) -> None:
        if state.waiting + count > state.max_waiting_requests:
            state.metrics.requests_rejected.inc()
            raise APIError(503, f"too many requests waiting ({state.waiting}; the bound is "
                           f"{state.max_waiting_requests}): retry later", None, "queue_full")
        state.waiting += count
        self.state, self.held = state, count

    def release(self, count: int = 1) -> None:
        count = min(count, self.held)
        self.held -= count
        self.state.waiting -= count

    def release_all(self) -> None:
        self.release(self.held)


class _AdmittedStream(StreamingResponse):
    """A streamed response that gives back its admission however it ends, even when the
    client left before its generator started (an unstarted generator runs no `finally`)."""

    def __init__(self, admission: _Admission, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.admission = admission

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.admission.release_all()


def _engine_error(state: ServerState, e: EngineError) -> APIError:
    if state.stopping:
        return APIError(503, str(e), None, "server_shutdown")
    return APIError(500, str(e), None, "engine_error")


async def _merged(state: ServerState, admission: _Admission, request_id: str, ids: list[list[int]],
                  params: SamplingParams, stream: bool) -> AsyncIterator[tuple[int, Update]]:
    """Run one engine request per prompt and yield (prompt index, update) as they come.

    Leaving early cancels the consumers, whose generators abort their engine requests.
    """
    if len(ids) == 1:   # the common case: no merging queue, one task switch less per delta
        waiting = True
        try:
            async with contextlib.aclosing(state.engine.generate(f"{request_id}-0", ids[0], params,
                                                               stream)) as updates:
                async for update in updates:
                    if waiting:
                        waiting = False
                        admission.release()
                    yield 0, update
        except EngineError as e:
            raise _engine_error(state, e) from None
        finally:
            if waiting:
                admission.release()
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def consume(k: int, prompt_ids: list[int]) -> None:
        waiting = True
        try:
            async for update in state.engine.generate(f"{request_id}-{k}", prompt_ids, params, stream):
                if waiting:
                    waiting = False
                    admission.release()
                await merged.put((k, update))
        except EngineError as e:
            await merged.put((k, e))
        finally:
            if waiting:
                admission.release()
            await merged.put((k, None))

    tasks = [asyncio.ensure_future(consume(k, p)) for k, p in enumerate(ids)]
    try:
        live = len(tasks)
        while live:
            k, item = await merged.get()
            if item is None:
                live -= 1
            elif isinstance(item, EngineError):
                raise _engine_error(state, item)
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _respond(state: ServerState, request: Request, body: proto.SamplingFields,
                   params: SamplingParams, ids: list[list[int]], fmt: "_Format") -> Response:
    request_id = f"{fmt.prefix}-{uuid.uuid4().hex}"
    if state.stopping:
        raise APIError(503, SHUTDOWN_MESSAGE, None, "server_shutdown")
    admission = _Admission(state, len(ids))   # a full queue is a 503 now, not an error in a stream
    if body.stream:
        return _AdmittedStream(admission, _sse(state, admission, request_id, body, params, ids, fmt))
    try:
        return await _collect(state, admission, request, request_id, params, ids, fmt)
    finally:
        admission.release_all()


async def _collect(state: ServerState, admission: _Admission, request: Request, request_id: str,
                   params: SamplingParams, ids: list[list[int]], fmt: "_Format") -> Response:
    """The whole (non-streamed) response, or 499 when the client left first."""
    finals: dict[tuple[int, int], SampleDelta] = {}
    usage = [0] * len(ids), [0] * len(ids)

    async def collect() -> None:
        async for k, update in _merged(state, admission, request_id, ids, params, stream=False):
            usage[0][k], usage[1][k] = update.num_prompt_tokens, update.num_output_tokens
            if update.prompt_logprobs is not None:
                fmt.prompt_logprobs[k] = update.prompt_logprobs
            for d in update.deltas:
                finals[(k, d.index)] = d

    task = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_wait_disconnect(request))
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not task.done():   # the client went away: cancelling aborts its engine requests
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)
    gone.cancel()
    task.result()
    choices = [fmt.choice(k * params.n + d.index, d, k) for (k, _), d in sorted(finals.items())]
    return JSONResponse(fmt.response(request_id, choices, _usage(usage)))


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _usage(usage: tuple[list[int], list[int]]) -> dict[str, int]:
    prompt, completion = sum(usage[0]), sum(usage[1])
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


async def _sse(state: ServerState, admission: _Admission, request_id: str,
               body: proto.SamplingFields, params: SamplingParams, ids: list[list[int]],
               fmt: "_Format") -> AsyncIterator[str]:
    usage = [len(i) for i in ids], [0] * len(ids)
    try:
        for k in range(len(ids)):
            for i in range(params.n):
                first = fmt.first_chunk(k * params.n + i, k)
                if first is not None:
                    yield _event(fmt.chunk(request_id, [first]))
        async for k, update in _merged(state, admission, request_id, ids, params, stream=True):
            usage[1][k] = update.num_output_tokens
            choices = [fmt.stream_choice(k * params.n + d.index, d, k) for d in update.deltas
                       if d.text or d.logprobs or d.finish_reason or fmt.untokenized]
            if choices:
                yield _event(fmt.chunk(request_id, choices))
        if body.include_usage:
            yield _event(fmt.chunk(request_id, [], _usage(usage)))
    except APIError as e:
        yield _event({"error": {"message": e.message, "type": APIError.TYPES.get(e.status),
                                "param": e.param, "code": e.code}})
    yield "data: [DONE]\n\n"


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


# ---- response shapes ---------------------------------------------------------------------------
class _Format:
    """How one endpoint shapes choices, chunks and responses."""

    prefix = "cmpl"
    chunk_object = "text_completion"

    def __init__(self, state: ServerState, body: proto.SamplingFields) -> None:
        self.state = state
        self.model = body.model or state.served_model_names[0]
        self.created = int(time.time())
        self.untokenized = state.tokenizer is None
        self.offsets: dict[int, int] = {}
        self.prompt_logprobs: dict[int, list] = {}   # per prompt, when asked for (not streamed)

    def prompt_logprobs_of(self, k: int) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's shape: per prompt token, None for the first, else {token id: {logprob,
        decoded_token}} holding the token itself and the top k."""
        entries = self.prompt_logprobs.get(k)
        if entries is None:
            return None
        return [None if e is None else
                {str(t): {"logprob": lp, "decoded_token": _token_str(self.state, t)} for t, lp in e.items()}
                for e in entries]

    def first_chunk(self, index: int, k: int) -> dict[str, Any] | None:
        return None

    def chunk(self, request_id: str, choices: list[dict[str, Any]],
              usage: dict[str, int] | None = None) -> dict[str, Any]:
        out = {"id": request_id, "object": self.chunk_object, "created": self.created,
               "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out


class _CompletionFormat(_Format):

    def __init__(self, state: ServerState, body: proto.CompletionRequest, prompt_texts: list[str],
                 prompt_ids: list[list[int]]):
        super().__init__(state, body)
        self.body, self.prompt_texts, self.prompt_ids = body, prompt_texts, prompt_ids
        self.echoed: set[int] = set()

    def _echo_logprobs(self, index: int, k: int) -> dict[str, Any]:
        """OpenAI's logprobs of an echoed prompt (what lm-eval scores): each prompt token's
        logprob, None for the first; the top `logprobs` alternatives with the token itself."""
        entries = self.prompt_logprobs.get(k) or [None] * len(self.prompt_ids[k])
        top_n = self.body.logprobs or 0
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        for tok, entry in zip(self.prompt_ids[k], entries):
            s = _token_str(self.state, tok)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            if entry is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(entry[tok])
            best = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
            top = {_token_str(self.state, t): lp for t, lp in best}
            top.setdefault(s, entry[tok])
            tops.append(top)
        self.offsets[index] = offset   # generated tokens' offsets continue after the prompt
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _logprobs(self, index: int, d: SampleDelta) -> dict[str, Any] | None:
        if d.logprobs is None or self.body.logprobs is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = self.offsets.get(index, 0)
        for tok, entry in zip(d.token_ids, d.logprobs):
            s = _token_str(self.state, tok)
            tokens.append(s)
            token_lps.append(entry.get(tok))
            tops.append({_token_str(self.state, t): lp for t, lp in entry.items()})
            offsets.append(offset)
            offset += len(s)
        self.offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _echo(self, index: int, k: int) -> str:
        if self.body.echo and index not in self.echoed:
            self.echoed.add(index)
            return self.prompt_texts[k]
        return ""

    def choice(self, index: int, d: SampleDelta, k: int) -> dict[str, Any]:
        echo = self.prompt_texts[k] if self.body.echo else ""
        only_prompt = self.body.echo_only
        logprobs = None
        if self.body.echo and self.body.logprobs is not None:
            logprobs = self._echo_logprobs(index, k)
            generated = None if only_prompt else self._logprobs(index, d)
            for key, values in (generated or {}).items():
                logprobs[key] += values
        else:
            logprobs = self._logprobs(index, d)
        out = {"index": index, "text": echo + ("" if only_prompt else d.text), "logprobs": logprobs,
               "finish_reason": "length" if only_prompt else d.finish_reason,
               "stop_reason": None if only_prompt else d.stop_reason}
        if self.body.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs_of(k)
        return out

    def stream_choice(self, index: int, d: SampleDelta, k: int) -> dict[str, Any]:
        echo = self._echo(index, k)   # the prompt once, in the first delta of each choice
        return {"index": index, "text": echo + d.text, "logprobs": self._logprobs(index, d),
                "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}

    def response(self, request_id: str, choices: list[dict[str, Any]],
                 usage: dict[str, int]) -> dict[str, Any]:
        if self.body.echo_only:   # the one step's token was dropped
            usage = {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}
        return self.chunk(request_id, choices, usage)


class _ChatFormat(_Format):
    prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def __init__(self, state: ServerState, body: proto.ChatCompletionRequest):
        super().__init__(state, body)
        self.body = body

    def _entry(self, token: int, lp: float) -> dict[str, Any]:
        s = _token_str(self.state, token)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    def _logprobs(self, d: SampleDelta) -> dict[str, Any] | None:
        if d.logprobs is None or not self.body.logprobs:
            return None
        k = self.body.top_logprobs or 0
        content = []
        for tok, entry in zip(d.token_ids, d.logprobs):
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
            content.append({**self._entry(tok, entry.get(tok)),
                            "top_logprobs": [self._entry(t, lp) for t, lp in top]})
        return {"content": content}

    def choice(self, index: int, d: SampleDelta, k: int) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": d.text},
                "logprobs": self._logprobs(d), "finish_reason": d.finish_reason,
                "stop_reason": d.stop_reason}

    def first_chunk(self, index: int, k: int) -> dict[str, Any] | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def stream_choice(self, index: int, d: SampleDelta, k: int) -> dict[str, Any]:
        delta = {"content": d.text} if d.text or not d.finish_reason else {}
        return {"index": index, "delta": delta, "logprobs": self._logprobs(d),
                "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}

    def response(self, request_id: str, choices: list[dict[str, Any]],
                 usage: dict[str, int]) -> dict[str, Any]:
        out = {"id": request_id, "object": "chat.completion", "created": self.created,
               "model": self.model, "choices": choices, "usage": usage}
        if self.body.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs_of(0)
        return out

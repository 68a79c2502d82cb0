"""`paxkv serve MODEL` / `python3 -m paxkv.serve MODEL`: flags, engine start, uvicorn.

Two processes by default (vLLM V1's shape): this one, the frontend (uvicorn: HTTP, request
checks, tokenization, detokenization, SSE), and an engine process that owns the `LLM`
(`engine_core.py`, joined by a socket pair, `engine_client.py`). `--no-engine-process`
keeps everything in this process, the engine on a thread (`engine_loop.py`), for comparison.

Engine flags are derived from `EngineArgs`' fields (what `LLM(...)` takes), under vLLM's
spelling (`max_num_seqs` -> `--max-num-seqs`, booleans as `--x / --no-x`), so a new engine
argument becomes a flag without touching this file; LLM itself checks the values (a bad one is a
usage error naming the field). argparse rather than absl here: vLLM's dashed
names and `--no-` booleans are what users of `vllm serve` type.

Shutdown: uvicorn handles SIGTERM / SIGINT by closing the listening socket, letting the
open responses finish (up to --shutdown-timeout seconds, after which each still open ends with
an OpenAI error, a stream with an error event and `[DONE]`, and its request is aborted), then
stopping the engine (process or thread); the process exits 0.
If the engine process dies, requests in flight fail, the server shuts down and exits 1.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import selectors
import signal
import sys
import time
from typing import Any, Sequence

from paxkv.config import SERVER_MAX_NUM_BATCHED_TOKENS

logger = logging.getLogger("paxkv.serve")

# LLM arguments that are not engine settings a flag can carry.
_NOT_FLAGS = {"self", "model", "params", "tokenizer"}
_HELP = {
    "dtype": "weights and activations dtype (auto: bfloat16 on GPU, float32 on CPU)",
    "block_size": "tokens per KV block",
    "gpu_memory_utilization": "share of device memory for weights, activations and the KV pool",
    "num_gpu_blocks_override": "fix the number of KV blocks instead of profiling memory",
    "max_num_seqs": "sequences in the running batch at most (None: 1024 on a GPU of H100 / H200 "
                    "size, else 256)",
    "max_num_batched_tokens": f"tokens per engine step at most (None: {SERVER_MAX_NUM_BATCHED_TOKENS} "
                              "for the server)",
    "max_model_len": "longest sequence (prompt + output); default: the model's, capped at 8192",
    "kv_cache_dtype": "KV page storage dtype (8-bit ones store per-token scales)",
    "enable_prefix_caching": "share KV blocks of identical prompt prefixes",
    "enable_chunked_prefill": "split long prompts across steps under the token budget",
    "preemption_mode": "what to do with a sequence when the pool runs dry",
    "swap_space": "GiB of host memory for swapped-out blocks (preemption_mode=swap)",
    "scheduler": "continuous (iteration-level) or static (request-level) batching",
    "scheduling_policy": "order of the waiting queue: fcfs, or priority (a request's "
                         "'priority', smaller first)",
    "attention_backend": "attention implementation",
    "tensor_parallel_size": "devices to shard the model over",
    "seed": "seed of requests that give none, and of random weights",
    "num_scheduler_steps": "decode steps per host round trip",
    "batch_invariant": "a request's tokens and logprobs do not depend on its batch mates "
                       "(bitwise; slower)",
    "precompile": "compile every step shape at start-up (GPU), so no request waits on a compilation",
}


def _annotation_type(annotation: Any, default: Any) -> type | None:
    """int / float / str / bool from a (string) annotation or the default's type."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    for name, typ in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if text.split("|")[0].strip() == name or (default is not None and type(default) is typ):
            return typ
    return None


def add_engine_flags(parser: argparse.ArgumentParser) -> list[str]:
    """One flag per engine argument (`EngineArgs`' fields); returns the argument names."""
    from paxkv.engine_args import EngineArgs
    names = []
    group = parser.add_argument_group("engine (LLM arguments)")
    for field in dataclasses.fields(EngineArgs):
        name = field.name
        if name in _NOT_FLAGS:
            continue
        typ = _annotation_type(field.type, field.default)
        if typ is None:
            continue
        flag = "--" + name.replace("_", "-")
        help_ = f"{_HELP.get(name, f'LLM({name}=...)')} (default: {field.default})"
        if typ is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                               default=field.default, help=help_)
        else:
            group.add_argument(flag, dest=name, type=typ, default=field.default, help=help_)
        names.append(name)
    group.add_argument("--speculative-config", dest="speculative_config", type=_json_object,
                       default=None, help="speculative decoding, vLLM's JSON: "
                       "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' (default: none)")
    names.append("speculative_config")
    return names


def _json_object(text: str) -> dict:
    """A flag's JSON object value (argparse reports the ValueError as a usage error)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def build_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    parser = argparse.ArgumentParser(
        prog="paxkv serve", description="Serve a model over the OpenAI API (completions, chat).")
    parser.add_argument("model", nargs="?", default="tiny",
                        help="preset name ('tiny', 'llama3-8b', 'smollm2-135m-instruct', ...), "
                        "Hugging Face checkpoint dir or GGUF file (default: tiny)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--api-key", default=os.environ.get("PAXKV_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $PAXKV_API_KEY)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use (default: MODEL)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory (default: the checkpoint's own)")
    parser.add_argument("--max-waiting-requests", type=int, default=10_000,
                        help="requests without a first token at most; beyond, new ones get 503 "
                        "(default: 10000)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight responses get to finish after SIGTERM; then "
                        "they end with an error (a stream: error event and [DONE]) (default: 30)")
    parser.add_argument("--max-request-body-bytes", type=int, default=None,
                        help="largest request body; a larger one gets 413 (default: 32 bytes "
                        "per token of max_model_len, at least 1 MiB)")
    parser.add_argument("--read-timeout", type=float, default=30.0,
                        help="seconds a client gets to send a request's headers (else the "
                        "connection is closed), then again its body (else 408) (default: 30)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="do not log one line per HTTP request")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="run the engine in a process of its own, apart from the HTTP "
                        "frontend (--no-engine-process: on a thread of the server process, "
                        "as vLLM's --disable-frontend-multiprocessing)")
    names = add_engine_flags(parser)
    return parser, names


def engine_arguments(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The LLM keywords of the parsed flags; the step's token budget, when no flag sets it, is
    vLLM's server value (SERVER_MAX_NUM_BATCHED_TOKENS) rather than LLM's own default."""
    engine_args = {n: getattr(args, n) for n in names}
    if engine_args.get("max_num_batched_tokens") is None:
        engine_args["max_num_batched_tokens"] = SERVER_MAX_NUM_BATCHED_TOKENS
    return engine_args


class _TimedSelector(selectors.DefaultSelector):
    """The event loop's selector, counting the time the loop spends *outside* select():
    the frontend's own work (HTTP parsing, handlers, JSON, SSE writes)."""

    def __init__(self, counter: Any) -> None:
        super().__init__()
        self._counter = counter
        self._since = time.perf_counter()

    def select(self, timeout: float | None = None) -> Any:
        self._counter.inc(time.perf_counter() - self._since)
        try:
            return super().select(timeout)
        finally:
            self._since = time.perf_counter()


def main(argv: Sequence[str] | None = None) -> int:
    parser, names = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_waiting_requests < 0:
        parser.error("--max-waiting-requests must be >= 0")
    if args.max_request_body_bytes is not None and args.max_request_body_bytes < 1:
        parser.error("--max-request-body-bytes must be >= 1")
    if args.read_timeout <= 0 or args.shutdown_timeout < 0:
        parser.error("--read-timeout must be > 0 and --shutdown-timeout >= 0")

    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from paxkv.serve.app import ServerState, build_app
    from paxkv.serve.limits import RequestLimits, default_max_body_bytes, with_header_timeout
    from paxkv.serve.metrics import ServerMetrics

    served = args.served_model_name or [args.model]
    metrics = ServerMetrics(served[0])
    engine_args = engine_arguments(args, names)
    logger.info("loading %s with %s (%s)", args.model, engine_args,
                "engine process" if args.engine_process else "engine thread")
    try:
        engine = (_engine_process(args, engine_args, metrics) if args.engine_process
                  else _engine_thread(args, engine_args, metrics))
    except ValueError as e:
        parser.error(str(e))
    except RuntimeError as e:   # the engine process died while loading (its log says why)
        logger.error("%s", e)
        return 1
    max_body = args.max_request_body_bytes or default_max_body_bytes(engine.info.max_model_len)
    state = ServerState(engine, served, api_key=args.api_key,
                        max_waiting_requests=args.max_waiting_requests,
                        limits=RequestLimits(max_body, args.read_timeout))
    app = build_app(state)
    # uvicorn cancels responses still open at its own deadline, cutting streams mid-chunk;
    # ours comes first (`_draining_server`) and ends them cleanly, so uvicorn's is a backstop.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            access_log=not args.disable_uvicorn_access_log,
                            http=with_header_timeout(AutoHTTPProtocol, args.read_timeout),
                            timeout_graceful_shutdown=args.shutdown_timeout + _BACKSTOP_S,
                            lifespan="on")
    server = _draining_server(config, state, args.shutdown_timeout)
    engine.on_fatal = lambda: setattr(server, "should_exit", True)
    # uvicorn re-raises the signal that stopped it once it has shut down; a handler that does
    # nothing makes that a clean exit 0 instead of death by SIGTERM.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    loop = asyncio.SelectorEventLoop(_TimedSelector(state.metrics.frontend_busy_seconds))
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(server.serve())
    finally:
        engine.close()
        loop.close()
    if engine.fatal is not None:
        logger.error("exiting: %s", engine.fatal)
        return 1
    return 0


_BACKSTOP_S = 5.0


def _draining_server(config: Any, state: Any, shutdown_timeout: float) -> Any:
    """uvicorn.Server whose shutdown ends the responses still open after `shutdown_timeout`
    seconds with an error (see the module docstring), before uvicorn's own deadline."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            timer = asyncio.get_running_loop().call_later(shutdown_timeout, state.end_open_responses)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return Server(config)


def _tokenizer(args: argparse.Namespace) -> Any:
    """The frontend's tokenizer: --tokenizer, else the checkpoint's own (None: ids only)."""
    from paxkv.tokenizer import load_tokenizer
    if args.tokenizer is not None:
        tok = load_tokenizer(args.tokenizer)
        if tok is None:
            raise ValueError(f"--tokenizer {args.tokenizer}: no tokenizer files there")
        return tok
    from paxkv.builder import resolve_model
    path, _ = resolve_model(args.model)
    return load_tokenizer(path) if path is not None else None


def _engine_process(args: argparse.Namespace, engine_args: dict[str, Any], metrics: Any) -> Any:
    from paxkv.serve.engine_client import EngineClient, launch_engine_process
    tokenizer = _tokenizer(args)   # before the engine loads: a bad --tokenizer fails fast
    proc, sock, info = launch_engine_process(
        {"model": args.model, "engine_args": engine_args, "tokenizer": args.tokenizer})
    return EngineClient(proc, sock, info, tokenizer, metrics)


def _engine_thread(args: argparse.Namespace, engine_args: dict[str, Any], metrics: Any) -> Any:
    from paxkv.llm import LLM
    from paxkv.serve.engine_loop import EngineLoop
    if args.tokenizer is not None:
        engine_args = {**engine_args, "tokenizer": _tokenizer(args)}
    return EngineLoop(LLM(args.model, **engine_args), metrics)


if __name__ == "__main__":
    sys.exit(main())

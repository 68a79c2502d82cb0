"""An adversarial pass over the server: hostile bodies, bursts, slow clients, shutdown, and the
request shapes of real clients (lm-evaluation-harness's loglikelihood requests).

One small server (one running sequence, two waiting requests at most, short read timeout,
a 4 MiB body bound, a 1 s shutdown timeout) serves the module; the last test stops it with
SIGTERM. Each case names the status a client gets; none may be a 500 or stall the others.
"""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from paxkv import LLM, SamplingParams
from serve_helpers import ServerProcess, compile_cache_env, use_compile_cache

pytestmark = pytest.mark.slow   # a server of its own: about 45 s on 2 cores

ENGINE = ["--max-num-seqs", "1", "--max-model-len", "2048", "--max-num-batched-tokens", "256"]
MAX_WAITING = 2
READ_TIMEOUT = 2.0
MAX_BODY = 4 << 20


@pytest.fixture(scope="module")
def cache_dir(request):
    return str(request.config.cache.mkdir("paxkv_jax_compile_cache"))


@pytest.fixture(scope="module")
def server(cache_dir):
    s = ServerProcess(["tiny", *ENGINE, "--max-waiting-requests", str(MAX_WAITING),
                       "--read-timeout", str(READ_TIMEOUT), "--max-request-body-bytes",
                       str(MAX_BODY), "--shutdown-timeout", "1"], env=compile_cache_env(cache_dir))
    yield s
    s.stop()


def _post(server, body, path="/v1/completions", **kw) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        kw["content"] = body
        kw.setdefault("headers", {"content-type": "application/json"})
    else:
        kw["json"] = body
    return httpx.post(f"{server.url}{path}", timeout=120, **kw)


def _error(r: httpx.Response, status: int) -> dict:
    """The response is `status` with OpenAI's error body; returns its `error`."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _idle(server, timeout: float = 20.0) -> None:
    """Nothing running, waiting or holding KV blocks (no leak)."""
    deadline = time.monotonic() + timeout
    names = ("paxkv:num_requests_running", "paxkv:num_requests_waiting", "paxkv:kv_cache_usage_perc")
    while time.monotonic() < deadline:
        if all(server.metric(n) == 0 for n in names):
            return
        time.sleep(0.1)
    raise AssertionError({n: server.metric(n) for n in names})


def _long_stream(url: str, max_tokens: int = 2000):   # seconds on the CPU
    body = {"prompt": "It was a fine morning", "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    return httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120)


# ---- hostile bodies ------------------------------------------------------------------------------
def test_deeply_nested_json_is_400(server):
    for depth in (2000, 300):
        body = b'{"prompt": ' + b"[" * depth + b"]" * depth + b', "max_tokens": 2}'
        assert _error(_post(server, body), 400)["code"] == "invalid_json"
        body = b'{"prompt": "x", "logit_bias": ' + b'{"a":' * depth + b"1" + b"}" * depth + b"}"
        assert _error(_post(server, body), 400)["code"] == "invalid_json"


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": None, "min_tokens": 10**9}, "min_tokens"),
    ("/v1/completions", {"prompt": [1] * 2040, "max_tokens": 16}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "max_tokens": 10**9}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "max_completion_tokens": 2100}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "min_tokens": 10**9}, "min_tokens"),
])
def test_prompt_plus_max_tokens_beyond_the_context_is_400(server, path, body, field):
    t0 = time.monotonic()
    err = _error(_post(server, body, path), 400)
    assert err["param"] == field and err["code"] == "context_length_exceeded", err
    assert "maximum context length is 2048" in err["message"]
    assert time.monotonic() - t0 < 10          # refused, not run to the end of the context


def test_max_tokens_that_fit_exactly_run(server):
    r = _post(server, {"prompt": [1] * 2036, "max_tokens": 12, "ignore_eos": True}).json()
    assert r["usage"] == {"prompt_tokens": 2036, "completion_tokens": 12, "total_tokens": 2048}


def test_body_over_the_bound_is_413_at_once_and_health_stays_fast(server):
    big = b'{"prompt": "' + b"a" * (10 * 10**6) + b'"}'
    t0 = time.monotonic()
    err = _error(_post(server, big), 413)
    assert err["code"] == "request_too_large" and time.monotonic() - t0 < 5
    # Without Content-Length (chunked), the bound holds while reading.
    def chunks():
        for _ in range(10):
            yield b"a" * 10**6
    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    assert _error(r, 413)["code"] == "request_too_large"
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


def test_tokenizing_a_huge_prompt_does_not_stall_other_clients(server):
    """A 3.5 MB prompt takes seconds to tokenize (then is refused: too long); /health keeps
    answering meanwhile, because tokenization runs off the event loop."""
    text = ("It was a truth universally acknowledged, that a single man in possession of a "
            "good fortune must be in want of a wife. ") * 30_000
    body = json.dumps({"prompt": text[:3_500_000], "max_tokens": 2}).encode()
    assert len(body) < MAX_BODY
    result: dict = {}

    def big():
        t0 = time.monotonic()
        result["response"] = _post(server, body)
        result["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=big)
    t.start()
    worst = 0.0
    time.sleep(0.3)
    while t.is_alive():
        t0 = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    t.join()
    assert _error(result["response"], 400)["param"] == "prompt"
    assert result["seconds"] > 1.0, result            # tokenizing took a while...
    assert worst < result["seconds"] / 3, (worst, result)   # ...and health never waited for it


def test_bad_types_and_malformed_bodies_are_400_never_422(server):
    cases = [b"{", b"[1, 2]", b'"prompt"', b"", b'{"prompt": "x", "max_tokens": "9"}',
             b'{"prompt": "x", "temperature": "hot"}', b'{"prompt": 7}',
             b'{"prompt": "x", "n": 1.5}', b'{"messages": "hi"}', b"\xff\xfe"]
    for body in cases:
        r = _post(server, body)
        assert r.status_code == 400, (body, r.status_code, r.text)
    assert _error(_post(server, {"messages": []}, "/v1/chat/completions"), 400)["param"] == "messages"


# ---- admission -----------------------------------------------------------------------------------
def test_the_waiting_bound_holds_under_a_burst(server):
    """With the one running slot taken, a burst of 40 admits exactly MAX_WAITING requests (they
    run once the slot frees); the rest get 503 at once."""
    with _long_stream(server.url) as running:
        lines = running.iter_lines()
        next(lines)                                   # running: it holds the only sequence slot

        async def burst():
            async with httpx.AsyncClient(timeout=120) as c:
                async def one():
                    return await c.post(f"{server.url}/v1/completions",
                                        json={"prompt": "Then", "max_tokens": 3})
                tasks = [asyncio.ensure_future(one()) for _ in range(40)]
                while sum(t.done() for t in tasks) < 40 - MAX_WAITING:   # the rejections
                    await asyncio.sleep(0.05)
                running.close()                       # frees the slot: the admitted ones run
                return await asyncio.gather(*tasks)
        results = asyncio.run(burst())
    codes = sorted(r.status_code for r in results)
    assert codes == [200] * MAX_WAITING + [503] * (40 - MAX_WAITING), codes
    err = next(r for r in results if r.status_code == 503).json()["error"]
    assert err["code"] == "queue_full" and f"the bound is {MAX_WAITING}" in err["message"]
    _idle(server)


# ---- slow clients ----------------------------------------------------------------------------------
def test_slow_headers_are_cut_and_slow_bodies_get_408(server):
    port = server.port
    half = socket.create_connection(("127.0.0.1", port))
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    half.settimeout(READ_TIMEOUT + 10)
    t0 = time.monotonic()
    assert half.recv(100) == b""                       # closed, nothing sent
    assert READ_TIMEOUT - 0.5 < time.monotonic() - t0 < READ_TIMEOUT + 5
    half.close()

    slow = socket.create_connection(("127.0.0.1", port))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\"")
    slow.settimeout(READ_TIMEOUT + 10)
    reply = b""
    while not reply.endswith(b"}"):                  # the whole response, however it is split
        piece = slow.recv(4096)
        if not piece:
            break
        reply += piece
    slow.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_stalled_connections_do_not_block_others(server):
    stalled = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(100)]
    try:
        for s in stalled[::2]:
            s.sendall(b"GET /v1/mod")
        r = _post(server, {"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200
    finally:
        for s in stalled:
            s.close()


# ---- clients that leave --------------------------------------------------------------------------------
def test_disconnects_and_an_abort_storm_leave_nothing_behind(server):
    async def storm():
        async with httpx.AsyncClient(timeout=30) as c:
            async def leave_mid_stream():
                async with c.stream("POST", f"{server.url}/v1/completions", json={
                        "prompt": "Hi", "max_tokens": 100, "stream": True, "ignore_eos": True}) as r:
                    async for _ in r.aiter_lines():
                        break

            async def abandon():
                await c.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 50})
            tasks = [asyncio.ensure_future(leave_mid_stream() if k % 2 else abandon())
                     for k in range(30)]
            await asyncio.sleep(0.5)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.run(storm())
    _idle(server)
    assert _post(server, {"prompt": "Hi", "max_tokens": 2}).status_code == 200


# ---- real clients: OpenAI routes and lm-evaluation-harness ---------------------------------------------
def test_model_retrieve_and_404_bodies(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert _error(httpx.get(f"{server.url}/v1/models/no-such-model"), 404)["code"] == "model_not_found"
    assert _error(httpx.get(f"{server.url}/v1/nothing-here"), 404)["type"] == "not_found_error"
    _error(httpx.get(f"{server.url}/v1/completions"), 405)


@pytest.fixture(scope="module")
def llm(cache_dir):
    use_compile_cache(cache_dir)
    return LLM("tiny", max_num_seqs=1, max_model_len=2048, max_num_batched_tokens=256)


def _lm_eval_payload(prompts: list[list[int]], max_tokens: int) -> dict:
    """What lm-evaluation-harness's `local-completions` sends for loglikelihood requests
    (tokenized: context + continuation ids, one request for a batch)."""
    return {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": max_tokens,
            "logprobs": 1, "seed": 1234, "echo": True}


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_requests_equal_offline_prompt_logprobs(server, llm, max_tokens):
    tok = llm.get_tokenizer()
    context = tok.encode("It was a truth universally acknowledged, that a single man")
    choices = [tok.encode(" must be in want of a wife", add_special_tokens=False),
               tok.encode(" is rich", add_special_tokens=False)]
    prompts = [context + c for c in choices]
    r = _post(server, _lm_eval_payload(prompts, max_tokens))
    assert r.status_code == 200, r.text
    out = r.json()
    offline = llm.generate(prompts,
                           SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
                           use_tqdm=False)
    for choice, prompt, want, cont in zip(out["choices"], prompts, offline, choices):
        lp = choice["logprobs"]
        n = len(prompt) + (0 if max_tokens == 0 else 1)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
        assert len(lp["text_offset"]) == n and lp["text_offset"] == sorted(lp["text_offset"])
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for pos in range(1, len(prompt)):
            assert lp["token_logprobs"][pos] == pytest.approx(want.prompt_logprobs[pos][prompt[pos]],
                                                              abs=1e-4)
            top = lp["top_logprobs"][pos]
            assert lp["tokens"][pos] in top and 1 <= len(top) <= 2
        # lm-eval's parse: continuation logprobs are token_logprobs[ctxlen:-1] when one token
        # was generated (max_tokens 1), [ctxlen:] when none was (max_tokens 0).
        ctxlen = len(context)
        scored = lp["token_logprobs"][ctxlen:-1] if max_tokens else lp["token_logprobs"][ctxlen:]
        assert len(scored) == len(cont)
        assert sum(scored) == pytest.approx(
            sum(want.prompt_logprobs[ctxlen + i][t] for i, t in enumerate(cont)), abs=1e-3)
        if max_tokens == 0:
            assert choice["text"] == tok.decode(prompt) and choice["finish_reason"] == "length"
    if max_tokens == 0:
        assert out["usage"]["completion_tokens"] == 0


def test_echo_with_logprobs_on_a_text_prompt(server):
    r = _post(server, {"prompt": "Hello there", "echo": True, "logprobs": 2, "max_tokens": 3,
                       "temperature": 0}).json()
    c = r["choices"][0]
    assert c["text"].startswith("Hello there")
    n_prompt = r["usage"]["prompt_tokens"]
    assert len(c["logprobs"]["tokens"]) == n_prompt + r["usage"]["completion_tokens"]
    assert c["logprobs"]["token_logprobs"][0] is None
    assert all(v <= 0 for v in c["logprobs"]["token_logprobs"][1:])
    # Generated tokens' offsets continue after the prompt's.
    offsets = c["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[n_prompt] >= offsets[n_prompt - 1]
    err = _error(_post(server, {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}), 400)
    assert err["param"] == "echo"
    assert _error(_post(server, {"prompt": "x", "max_tokens": 0}), 400)["param"] == "max_tokens"


# ---- the key ---------------------------------------------------------------------------------------------
def test_api_key_is_compared_in_constant_time(monkeypatch):
    from paxkv.serve import app as app_module
    calls = []
    real = app_module.hmac.compare_digest
    monkeypatch.setattr(app_module.hmac, "compare_digest",
                        lambda a, b: calls.append((a, b)) or real(a, b))
    sent = []

    async def inner(scope, receive, send):
        sent.append("app")

    async def send(message):
        sent.append(message.get("status"))

    mw = app_module.ApiKeyMiddleware(inner, "secret")
    scope = {"type": "http", "path": "/v1/models", "headers": [(b"authorization", b"Bearer nope")]}
    asyncio.run(mw(scope, None, send))
    assert calls == [(b"Bearer nope", b"Bearer secret")] and sent[0] == 401
    scope["headers"] = [(b"authorization", b"Bearer secret")]
    asyncio.run(mw(scope, None, send))
    assert sent[-1] == "app"


# ---- shutdown (last: it stops the server) -------------------------------------------------------------------
def test_sigterm_ends_a_stream_that_outlasts_the_timeout_cleanly(server):
    with _long_stream(server.url) as r:
        lines = r.iter_lines()
        first = next(lines)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rest = list(lines)                              # no "incomplete chunked read"
        ended = time.monotonic() - t0
    data = [x for x in [first, *rest] if x.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    error = json.loads(data[-2][6:])["error"]
    assert error["code"] == "server_shutdown" and error["type"] == "service_unavailable"
    assert 0.5 < ended < 10, ended                      # after --shutdown-timeout (1 s)
    assert server.proc.wait(60) == 0

"""Server faults: API key (401), a full waiting queue (503), SIGTERM with a stream in flight.

One small server (one running sequence, one waiting request at most, an API key) serves the
module; the last test stops it with SIGTERM.
"""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest

from serve_helpers import ServerProcess, compile_cache_env

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(request):
    cache = str(request.config.cache.mkdir("paxkv_jax_compile_cache"))
    s = ServerProcess(["tiny", "--max-num-seqs", "1", "--max-waiting-requests", "1",
                       "--max-model-len", "512", "--max-num-batched-tokens", "256",
                       "--served-model-name", "austen", "tiny", "--api-key", KEY],
                      env=compile_cache_env(cache))
    yield s
    s.stop()


def _long_stream(url: str, max_tokens: int = 400):
    body = {"prompt": "It was a fine morning", "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    return httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)


@pytest.mark.slow
def test_api_key(server):
    body = {"prompt": "x", "max_tokens": 2}
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer no"})
    assert r.status_code == 401
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200      # probes stay open
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).completions.create(
            model="tiny", prompt="x", max_tokens=2)
    ok = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in ok.models.list().data] == ["austen", "tiny"]
    assert ok.completions.create(model="austen", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_full_queue_is_503_and_recovers(server):
    with _long_stream(server.url) as running:
        lines = running.iter_lines()
        next(lines)                                   # A has its first token: running
        waiting_result: dict = {}

        def waiter():                                 # B waits behind A (one sequence at most)
            r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=120,
                           json={"prompt": "Then", "max_tokens": 3, "temperature": 0.0})
            waiting_result["status"] = r.status_code

        t = threading.Thread(target=waiter)
        t.start()
        deadline = time.monotonic() + 20
        while server.metric("paxkv:num_requests_waiting") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        r = httpx.post(f"{server.url}/v1/completions", headers=AUTH,
                       json={"prompt": "Now", "max_tokens": 3})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "queue_full"
    # Closing A aborts it; B then runs and succeeds.
    t.join(60)
    assert waiting_result.get("status") == 200
    assert server.metric("paxkv:request_rejected_total") == 1


def test_sigterm_finishes_in_flight_and_exits_0(server):
    with _long_stream(server.url, max_tokens=60) as r:
        lines = r.iter_lines()
        first = next(lines)
        assert first.startswith("data: ")
        server.proc.send_signal(signal.SIGTERM)
        rest = list(lines)                            # the stream runs to its end
    events = [json.loads(x[6:]) for x in [first, *rest] if x.startswith("data: {")]
    assert [x for x in rest if x][-1] == "data: [DONE]"
    # Every token arrived (a consumer that falls behind gets several per chunk, so count
    # tokens, not chunks): the usage chunk comes last, after the finish.
    assert events[-1]["usage"]["completion_tokens"] == 60
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["text"]) for e in events for c in e["choices"]) >= 60
    assert server.proc.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=5)

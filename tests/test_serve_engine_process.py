"""The two arrangements of `paxkv serve`: an engine process (the default) and an engine thread
(`--no-engine-process`). Both answer what `LLM.generate` answers; the engine process goes
away with the server, and a dead engine process makes the server fail requests and exit
rather than hang.
"""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from paxkv import LLM, SamplingParams
from serve_helpers import ServerProcess, compile_cache_env, use_compile_cache

ENGINE_ARGS = ["--max-num-seqs", "16", "--max-model-len", "256", "--max-num-batched-tokens", "256",
               "--seed", "0"]
PROMPT = "It is a truth universally acknowledged"


def child_pids(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def cache_env(request):
    return compile_cache_env(str(request.config.cache.mkdir("paxkv_jax_compile_cache")))


@pytest.fixture(scope="module")
def servers(cache_env):
    split = ServerProcess(["tiny", *ENGINE_ARGS], env=cache_env)
    threaded = ServerProcess(["tiny", *ENGINE_ARGS, "--no-engine-process"], env=cache_env)
    yield {"process": split, "thread": threaded}
    assert threaded.stop() == 0, threaded.output()
    assert split.stop() == 0, split.output()


@pytest.fixture(scope="module")
def llm(cache_env):
    use_compile_cache(cache_env["JAX_COMPILATION_CACHE_DIR"])
    return LLM("tiny", max_num_seqs=16, max_model_len=256, max_num_batched_tokens=256, seed=0)


def _complete(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, body: dict) -> tuple[dict[int, str], dict[int, str], list[str]]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=120) as r:
        lines = [x for x in r.iter_lines() if x]
    for line in lines:
        if not line.startswith("data: {"):
            continue
        for c in json.loads(line[6:])["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                reasons[c["index"]] = c["finish_reason"]
    return texts, reasons, lines


@pytest.mark.parametrize("kw", [
    dict(temperature=0.0),
    dict(temperature=0.9, top_p=0.9, seed=7, logprobs=2),
    dict(temperature=1.0, top_k=20, seed=11, n=2),
    dict(temperature=0.0, stop=[" the", "@@"]),
])
@pytest.mark.slow
def test_engine_process_and_thread_answer_what_generate_answers(servers, llm, kw):
    ref = llm.generate([PROMPT], SamplingParams(max_tokens=24, **kw), use_tqdm=False)[0]
    body = {"prompt": PROMPT, "max_tokens": 24, **kw}
    for mode, server in servers.items():
        full = _complete(server.url, body)
        texts, reasons, _ = _stream(server.url, body)
        for i, want in enumerate(ref.outputs):
            got = full["choices"][i]
            assert got["text"] == texts[i] == want.text, (mode, i)
            assert got["finish_reason"] == reasons[i] == want.finish_reason, (mode, i)
            if kw.get("logprobs"):
                lps = got["logprobs"]["token_logprobs"]
                assert lps == pytest.approx([e[t] for t, e in zip(want.token_ids, want.logprobs)],
                                            abs=1e-4), mode
        assert full["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in ref.outputs)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_disconnect_frees_blocks_in_both_arrangements(servers, mode):
    server = servers[mode]
    before = server.metric("paxkv:request_aborted_total")
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        assert server.metric("paxkv:kv_cache_usage_perc") > 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (server.metric("paxkv:num_requests_running") > 0
                                           or server.metric("paxkv:kv_cache_usage_perc") > 0):
        time.sleep(0.05)
    assert server.metric("paxkv:request_aborted_total") == before + 1
    assert server.metric("paxkv:num_requests_running") == 0
    assert server.metric("paxkv:kv_cache_usage_perc") == 0


def test_sigterm_stops_the_engine_process_too(servers):
    server = servers["process"]   # the module's last use of it
    children = child_pids(server.proc.pid)
    assert children, "the engine process is a child of the server"
    assert _complete(server.url, {"prompt": PROMPT, "max_tokens": 4})["choices"][0]["text"]
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0, server.output()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in children):
        time.sleep(0.05)
    assert not [p for p in children if alive(p)], "orphans left behind"


@pytest.mark.slow
def test_a_killed_engine_process_fails_requests_and_the_server_exits(cache_env):
    server = ServerProcess(["tiny", *ENGINE_ARGS, "--shutdown-timeout", "30"], env=cache_env)
    engine_pid = child_pids(server.proc.pid)
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    t0 = time.monotonic()
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        for pid in engine_pid:
            os.kill(pid, signal.SIGKILL)
        rest = [x for x in lines if x]
    assert rest[-1] == "data: [DONE]"
    errors = [json.loads(x[6:])["error"] for x in rest if x.startswith('data: {"error"')]
    assert errors and "engine process died" in errors[0]["message"], rest[-3:]
    try:   # until it has exited: no hang, new requests are refused or fail
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       timeout=30)
        assert r.status_code in (500, 503), r.text
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 503
    except httpx.ConnectError:
        pass
    assert server.proc.wait(30) == 1, server.output()
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_a_killed_server_takes_its_engine_process_along(cache_env):
    server = ServerProcess(["tiny", *ENGINE_ARGS], env=cache_env)
    children = child_pids(server.proc.pid)
    assert children
    server.proc.kill()
    server.proc.wait(30)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in children):
        time.sleep(0.05)
    assert not [p for p in children if alive(p)], "the engine process outlived its server"

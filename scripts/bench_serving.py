"""Online serving benchmark over HTTP, vLLM's benchmark_serving in spirit.

One run, on the same engine settings and the same requests:
1. offline: `LLM.generate` on the whole trace in a subprocess (compile steps cut out of the
   clock), the reference the HTTP figure is held to (>= --min_offline_ratio of it);
2. the server (`python3 -m paxkv.serve`, another subprocess, sharing the offline run's JAX
   compilation cache), warmed up, then driven by an async HTTP client (aiohttp, as vLLM's
   benchmark_serving, or httpx: --clients; streaming /v1/completions with token-id prompts):
   the whole trace sent at once (once per client in --clients), then Poisson arrivals at each
   --rates value. --engine_modes picks the server's arrangement: `process`
   (the default: an engine process apart from the HTTP frontend), `thread`
   (`--no-engine-process`: the engine on a thread of the server process), or both in turn,
   each against the same offline run.

Per request it records TTFT (send -> first streamed chunk), TPOT ((e2e - TTFT) / (tokens - 1)),
the inter-chunk latencies (ITL) and E2E; per run p50/p90/p99 of each, request and token
throughput, goodput (requests/s meeting every --goodput_* limit), and where the server's wall
time went, from its /metrics counters: engine steps, output processing (detokenization),
the event loop's busy time (HTTP handling), engine idle, and a timeline of the server's
gauges (sampled every --timeline_interval_s) that places the idle time: before the engine
held its first request, or after it had finished them all while the client still read. The
client's own CPU time says whether the client kept up. Writes serving.json, serving.md and
serving.png (latency against request rate) to --out_dir; exits 1 when a request failed or
the HTTP throughput missed its offline reference.

    PYTHONPATH=. python3 scripts/bench_serving.py --out_dir /tmp/serving        # CPU smoke
    PYTHONPATH=. python3 scripts/bench_serving.py --engine_modes process,thread \
        --out_dir /tmp/serving                                   # both arrangements, one run
    PYTHONPATH=. python3 scripts/bench_serving.py --model llama3-8b --num_prompts 1000 \\
        --input_len 256 --output_len 256 --rates 10,20,40 --rate_num_prompts 150 \\
        --warmup_prompts 256 --warmup_output_len 16 --engine_args="--precompile" \\
        --clients aiohttp,httpx --deadline_s 470 --out_dir results/serving          # H200

The client is aiohttp (`pip install -e ".[bench]"`), as in vLLM's benchmark_serving.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "preset or checkpoint directory (served and offline)")
flags.DEFINE_enum("workload", "fixed", ["fixed", "sharegpt", "alpaca"], "request lengths")
flags.DEFINE_integer("num_prompts", 16, "requests of the all-at-once run (and the offline one)")
flags.DEFINE_integer("input_len", 32, "fixed workload: prompt tokens")
flags.DEFINE_integer("output_len", 16, "fixed workload: output tokens")
flags.DEFINE_list("rates", ["4"], "Poisson request rates (requests/s) after the all-at-once run")
flags.DEFINE_integer("rate_num_prompts", 16, "requests per Poisson-rate run")
flags.DEFINE_integer("max_num_seqs", 256, "engine: running sequences at most")
flags.DEFINE_integer("max_num_batched_tokens", 8192, "engine: tokens per step at most")
flags.DEFINE_integer("max_model_len", 2048, "engine: longest sequence")
flags.DEFINE_string("engine_args", "", "more `paxkv serve` engine flags, e.g. '--num-scheduler-steps 8'")
flags.DEFINE_bool("offline", True, "measure LLM.generate on the same trace first")
flags.DEFINE_float("min_offline_ratio", 0.9, "fail when HTTP all-at-once throughput < this x offline")
flags.DEFINE_integer("warmup_prompts", 0, "warm-up requests before timing (0: as many as num_prompts)")
flags.DEFINE_integer("warmup_output_len", 8, "output tokens of each warm-up request (0: the trace's)")
flags.DEFINE_integer("warmup_rate_prompts", 32, "warm-up requests arriving at the fastest rate")
flags.DEFINE_float("goodput_ttft_ms", 2000.0, "goodput: TTFT limit")
flags.DEFINE_float("goodput_tpot_ms", 100.0, "goodput: TPOT limit")
flags.DEFINE_integer("seed", 0, "trace seed")
flags.DEFINE_list("engine_modes", ["process"],
                  "server arrangements to measure in turn: process (engine process, the "
                  "default), thread (--no-engine-process)")
flags.DEFINE_string("url", "", "benchmark this running server instead of starting one (no offline)")
flags.DEFINE_string("out_dir", "scratch/results/serving", "where serving.json / .md / .png go (--out_dir=results/serving updates the committed results)")
flags.DEFINE_float("startup_timeout_s", 600.0, "how long the server may take to become healthy")
flags.DEFINE_string("offline_json", "", "internal: run only the offline part, write it here")
flags.DEFINE_string("compile_cache_dir", os.path.join(tempfile.gettempdir(), "paxkv_bench_serving_jax"),
                    "JAX compilation cache shared by the offline run and the server")
flags.DEFINE_float("deadline_s", 1e9, "skip the rate runs that would start after this many seconds")
flags.DEFINE_list("clients", ["aiohttp"],
                  "HTTP clients of the all-at-once run, one run each in turn: aiohttp (vLLM's "
                  "benchmark_serving's), httpx; warm-up and the rate runs use the first")
flags.DEFINE_float("timeline_interval_s", 0.25, "how often the server's gauges are sampled during a run")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the trace -------------------------------------------------------------------------------
def make_trace(num: int, rate: float, seed: int, vocab: int) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt ids, output tokens) per request: paxkv.sim.workloads lengths, random ids."""
    from paxkv.sim import workloads
    if FLAGS.workload == "fixed":
        trace = workloads.fixed(num, FLAGS.input_len, FLAGS.output_len, seed=seed, rate=rate)
    else:
        trace = workloads.make_trace(FLAGS.workload, num, seed=seed, rate=rate)
    requests = workloads.random_token_requests(trace, vocab, FLAGS.max_model_len, seed + 1)
    return [(r.arrival_time, ids, output_len) for r, (ids, output_len) in zip(trace, requests)]


def engine_kwargs() -> dict:
    """The LLM(...) arguments equal to the server's flags (parsed by the server's own parser)."""
    from paxkv.serve.cli import build_parser
    parser, names = build_parser()
    args = parser.parse_args([FLAGS.model, *server_engine_flags()])
    return {n: getattr(args, n) for n in names}


def server_engine_flags() -> list[str]:
    return ["--max-num-seqs", str(FLAGS.max_num_seqs), "--max-num-batched-tokens",
            str(FLAGS.max_num_batched_tokens), "--max-model-len", str(FLAGS.max_model_len),
            *shlex.split(FLAGS.engine_args)]


def vocab_size() -> int:
    from paxkv.builder import resolve_model
    path, cfg = resolve_model(FLAGS.model)
    if cfg is None:
        from paxkv.model.weights import checkpoint_config
        cfg = checkpoint_config(path)
    return cfg.vocab_size


# ---- offline reference (own process: the server needs the device memory afterwards) --------------
def run_offline(out_path: str) -> None:
    import jax

    from paxkv import LLM, SamplingParams
    llm = LLM(FLAGS.model, tokenizer=None, **engine_kwargs())
    trace = make_trace(FLAGS.num_prompts, math.inf, FLAGS.seed, llm.config.model.vocab_size)
    warm = make_trace(FLAGS.num_prompts, math.inf, FLAGS.seed + 1000,
                      llm.config.model.vocab_size)[:FLAGS.warmup_prompts or None]
    llm.generate([p for _, p, _ in warm], [SamplingParams(temperature=0.0, ignore_eos=True,
                 max_tokens=FLAGS.warmup_output_len or o, detokenize=False) for _, _, o in warm],
                 use_tqdm=False)
    llm.llm_engine.block_manager.reset_prefix_cache()
    llm.metrics.reset()
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o, detokenize=False)
              for _, _, o in trace]
    t0 = time.perf_counter()
    outs = llm.generate([p for _, p, _ in trace], params)
    wall = time.perf_counter() - t0
    s = llm.metrics.summary()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p) for _, p, _ in trace)
    run_s = wall - s["compile_s"]
    result = {"requests": len(outs), "wall_s": wall, "compile_s": s["compile_s"], "run_s": run_s,
              "request_throughput": len(outs) / run_s, "output_throughput": out_tokens / run_s,
              "total_token_throughput": (in_tokens + out_tokens) / run_s,
              "host_share": s["host_share"], "device": str(jax.devices()[0].device_kind)}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


# ---- the HTTP client ---------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def request_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def read_event(res: Result, data: bytes | str, t0: float, last: float | None) -> tuple[bool, float | None]:
    """Apply one SSE `data:` payload to `res`; (stream over, time of the last text chunk)."""
    if data in ("[DONE]", b"[DONE]"):
        return True, last
    chunk = json.loads(data)
    now = time.perf_counter()
    if "error" in chunk:
        res.error = str(chunk["error"])
        return True, last
    if chunk.get("usage"):
        res.prompt_tokens = chunk["usage"]["prompt_tokens"]
        res.output_tokens = chunk["usage"]["completion_tokens"]
    if chunk.get("choices"):
        if last is None:
            res.ttft = now - t0
        else:
            res.itl.append(now - last)
        last = now
    return False, last


def finish_result(res: Result, t0: float, max_tokens: int) -> Result:
    if res.error:
        return res
    res.e2e = time.perf_counter() - t0
    res.ok = res.output_tokens == max_tokens
    if not res.ok:
        res.error = f"got {res.output_tokens} tokens, expected {max_tokens}"
    return res


@contextlib.asynccontextmanager
async def _httpx_stream(client, url: str, body: dict):
    """(status, body reader, lines, SSE data prefix) of one streamed POST with httpx."""
    async with client.stream("POST", url, json=body) as r:
        yield r.status_code, r.aread, r.aiter_lines(), "data: "


@contextlib.asynccontextmanager
async def _aiohttp_stream(session, url: str, body: dict):
    """The same with aiohttp, whose lines are bytes (one per iteration, newline kept)."""
    async with session.post(url, json=body) as r:
        yield r.status, r.read, r.content, b"data: "


async def one_request(client, stream, url: str, model: str, prompt: list[int], max_tokens: int) -> Result:
    t0 = time.perf_counter()
    last = None
    res = Result(ok=False)
    try:
        async with stream(client, f"{url}/v1/completions",
                          request_body(model, prompt, max_tokens)) as (status, read, lines, prefix):
            if status != 200:
                res.error = f"HTTP {status}: {(await read())[:200]!r}"
                return res
            async for line in lines:
                if line.startswith(prefix):
                    done, last = read_event(res, line[6:].rstrip(), t0, last)
                    if done:
                        break
        return finish_result(res, t0, max_tokens)
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
    return res


def http_client(kind: str):
    """(async context manager of a client with no connection limit, its streamed POST)."""
    if kind == "aiohttp":
        import aiohttp
        return (aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                      timeout=aiohttp.ClientTimeout(total=3600.0)), _aiohttp_stream)
    if kind == "httpx":
        import httpx
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        return httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits), _httpx_stream
    raise ValueError(f"--clients: {kind!r} is neither aiohttp nor httpx")


async def drive(url: str, model: str, trace, label: str, client_kind: str) -> tuple[list[Result], float]:
    from tqdm.auto import tqdm
    client_cm, stream = http_client(client_kind)
    async with client_cm as client:
        bar = tqdm(total=len(trace), desc=label, dynamic_ncols=True, mininterval=1.0)
        start = time.perf_counter()

        async def launch(arrival, prompt, out_len):
            delay = arrival - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            r = await one_request(client, stream, url, model, prompt, out_len)
            bar.update(1)
            return r

        results = await asyncio.gather(*[launch(*t) for t in trace])
        wall = time.perf_counter() - start
        bar.close()
    return list(results), wall


class Timeline:
    """Samples the server's gauges on a thread during a run: when the engine held work, so
    that the run's idle time splits into before its first request and after its last."""

    KEYS = ("num_requests_running", "num_requests_waiting", "engine_idle_seconds_total",
            "request_success_total", "generation_tokens_total")

    def __init__(self, url: str, interval_s: float) -> None:
        import threading
        self.url, self.interval_s = url, interval_s
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = 0.0

    def __enter__(self) -> "Timeline":
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                m = scrape(self.url)
            except Exception:  # noqa: BLE001 - a missed sample is not a failed run
                continue
            self.samples.append({"t": time.perf_counter() - self.t0,
                                 **{k: m.get(f"paxkv:{k}", float("nan")) for k in self.KEYS}})

    def summary(self, wall: float, num_requests: int) -> dict:
        """When the engine first held work, first held every request of the run (running or
        queued; None if it never did), and had none left for good."""
        s = self.samples
        held = [x["num_requests_running"] + x["num_requests_waiting"] for x in s]
        first_work = next((x["t"] for x, h in zip(s, held) if h > 0), None)
        all_held = next((x["t"] for x, h in zip(s, held) if h >= num_requests), None)
        drained = None
        for x, h in zip(s, held):
            if h > 0:
                drained = None
            elif drained is None and first_work is not None and x["t"] > first_work:
                drained = x["t"]
        return {"interval_s": self.interval_s, "first_work_s": first_work, "all_held_s": all_held,
                "engine_drained_s": drained,
                "tail_after_drained_s": None if drained is None else max(0.0, wall - drained),
                "max_held": max(held) if held else None, "samples": s}


def scrape(url: str) -> dict[str, float]:
    import httpx
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("paxkv:") and "{" not in line:
            name, value = line.split()[:2]
            out[name] = float(value)
    return out


def pct(xs: list[float]) -> dict[str, float]:
    import numpy as np
    if not xs:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan")}
    a = np.asarray(xs) * 1e3
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}}


def summarize(results: list[Result], wall: float, before: dict, after: dict, rate: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    good = [r for r in ok if r.ttft * 1e3 <= FLAGS.goodput_ttft_ms
            and (r.tpot is None or r.tpot * 1e3 <= FLAGS.goodput_tpot_ms)]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    shares = {name: delta.get(f"paxkv:{key}_seconds_total", 0.0) / wall for name, key in
              (("engine_step", "engine_step"), ("output_processing", "output_processing"),
               ("frontend_busy", "frontend_busy"), ("engine_idle", "engine_idle"))}
    return {
        "rate": "inf" if math.isinf(rate) else rate, "requests": len(results), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5], "wall_s": wall,
        "request_throughput": len(ok) / wall, "output_throughput": out_tok / wall,
        "total_token_throughput": (in_tok + out_tok) / wall,
        "goodput": len(good) / wall, "goodput_share": len(good) / max(1, len(results)),
        "ttft_ms": pct([r.ttft for r in ok]), "tpot_ms": pct([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": pct([x for r in ok for x in r.itl]), "e2e_ms": pct([r.e2e for r in ok]),
        "server_time_shares": shares,
        "compilations_during_run": delta.get("paxkv:num_compilations", 0.0),
        # A run must find none of its prompts cached (the offline reference starts cold too).
        "prefix_cache_hit_rate": (delta.get("paxkv:prefix_cache_hits_total", 0.0)
                                  / max(1.0, delta.get("paxkv:prefix_cache_queries_total", 0.0))),
        # A compile stalls every stream; throughput with those stalls taken out of the clock is
        # what the offline figure (compile cut out too) compares with.
        "compile_s_during_run": delta.get("paxkv:compile_seconds", 0.0),
        "output_throughput_excl_compile": out_tok / max(1e-9, wall - delta.get("paxkv:compile_seconds", 0.0)),
    }


class Server:
    def __init__(self, port: int, env: dict, mode: str) -> None:
        cmd = [sys.executable, "-m", "paxkv.serve", FLAGS.model, "--host", "127.0.0.1", "--port",
               str(port), "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
               "--engine-process" if mode == "process" else "--no-engine-process",
               *server_engine_flags()]
        print("server:", " ".join(cmd), flush=True)
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
        self.url = f"http://127.0.0.1:{port}"

    def wait(self, timeout: float) -> None:
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server not healthy in time")

    def stop(self) -> int:
        import signal
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- reports --------------------------------------------------------------------------------------
def write_reports(result: dict) -> None:
    out = FLAGS.out_dir
    with open(os.path.join(out, "serving.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Online serving over HTTP: {result['model']}", "",
             f"Command: `{result['command']}`", "",
             f"JAX {result['jax']}, device {result['device']}; server flags: `{result['server_flags']}`", ""]
    off = result.get("offline")
    if off:
        lines += [f"Offline `LLM.generate`, same trace and engine settings: {off['request_throughput']:.2f} "
                  f"requests/s, {off['output_throughput']:.0f} output tokens/s "
                  f"({off['total_token_throughput']:.0f} total tokens/s; compile {off['compile_s']:.1f} s "
                  "cut out)", ""]
    lines += ["| engine | client | rate (req/s) | requests | failed | req/s | output tok/s | goodput req/s | "
              "TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | ITL p50/p99 ms | E2E p50/p99 ms | engine step | "
              "output proc. | event loop busy | engine idle | compiles |", "|" + " --- |" * 17]
    for r in result["runs"]:
        t, p, i, e, s = r["ttft_ms"], r["tpot_ms"], r["itl_ms"], r["e2e_ms"], r["server_time_shares"]
        lines.append(
            f"| {r.get('engine_mode') or 'url'} | {r['client']} | {r['rate']} | {r['requests']} | "
            f"{r['failed']} | {r['request_throughput']:.2f} | "
            f"{r['output_throughput']:.0f} | {r['goodput']:.2f} | {t['p50']:.0f} / {t['p90']:.0f} / "
            f"{t['p99']:.0f} | {p['p50']:.1f} / {p['p90']:.1f} / {p['p99']:.1f} | {i['p50']:.1f} / "
            f"{i['p99']:.1f} | {e['p50']:.0f} / {e['p99']:.0f} | {100 * s['engine_step']:.1f}% | "
            f"{100 * s['output_processing']:.2f}% | {100 * s['frontend_busy']:.1f}% | "
            f"{100 * s['engine_idle']:.1f}% | {r['compilations_during_run']:.0f} |")
    timed = [r for r in result["runs"] if "timeline" in r]
    if timed:
        lines += ["", "Where each run's wall time went, from the client's CPU time and the server's gauges "
                  "sampled during the run (engine: requests running or queued in the engine):", "",
                  "| engine | client | rate | wall s | client CPU | prefix-cache hits | engine's first step with work done at s | "
                  "held every request at s | had none left from s | client still reading after that, s |",
                  "|" + " --- |" * 10]
        for r in timed:
            tl = r["timeline"]
            f = lambda v: "-" if v is None else f"{v:.2f}"   # noqa: E731
            lines.append(f"| {r.get('engine_mode') or 'url'} | {r.get('client')} | {r['rate']} | "
                         f"{r['wall_s']:.2f} | {100 * r['client_cpu_share']:.0f}% | "
                         f"{100 * r.get('prefix_cache_hit_rate', 0.0):.1f}% | {f(tl['first_work_s'])} | "
                         f"{f(tl['all_held_s'])} | {f(tl['engine_drained_s'])} | {f(tl['tail_after_drained_s'])} |")
    off = result.get("offline")
    for r in result["runs"]:
        if r["rate"] != "inf" or not off:
            continue
        ratio = r["output_throughput"] / off["output_throughput"]
        excl = r["output_throughput_excl_compile"] / off["output_throughput"]
        lines += ["", f"Engine {r.get('engine_mode')}, client {r.get('client')}: all at once over HTTP / "
                  f"offline output throughput: **{ratio:.3f}** (target >= {FLAGS.min_offline_ratio}); with "
                  f"the {r['compilations_during_run']:.0f} compilations of the HTTP run "
                  f"({r['compile_s_during_run']:.1f} s) cut out of its clock as the offline "
                  f"run's are: {excl:.3f}"]
    lines += ["", f"Goodput: requests with TTFT <= {FLAGS.goodput_ttft_ms:.0f} ms and TPOT <= "
              f"{FLAGS.goodput_tpot_ms:.0f} ms, per second. Time shares are of the run's wall time, "
              "from the server's /metrics counters (engine step: inside engine.step(); output "
              "processing: turning outputs into deltas, detokenization included; event loop busy: "
              "the asyncio loop outside select(), i.e. HTTP parsing, handlers, JSON and SSE writes, "
              "which with the engine on a thread (engine `thread`) includes waiting for its GIL; "
              "engine `process`: the engine runs in its own process, and engine step, output "
              "processing (there: its rows plus the frontend's detokenization) and idle are that "
              "process's)."]
    with open(os.path.join(out, "serving.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot_rates(result, out)
    plot_bursts(result, out)


def save_figure(path: str, draw, **subplots_kw) -> None:
    """Draw one matplotlib figure (`draw(fig, ax)`) and save it as a PNG; a failure is printed,
    not raised: the numbers matter more than the picture."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(**subplots_kw)
        draw(fig, ax)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
    except Exception as e:  # noqa: BLE001
        print("plot failed:", e, flush=True)


def plot_rates(result: dict, out: str) -> None:
    """serving.png: latency percentiles against the request rate (runs at a finite rate)."""
    if not any(r["rate"] != "inf" for r in result["runs"]):
        return

    def draw(fig, ax):
        for mode in dict.fromkeys(r.get("engine_mode") for r in result["runs"]):
            runs = [r for r in result["runs"] if r["rate"] != "inf" and r.get("engine_mode") == mode]
            if not runs:
                continue
            rates = [r["rate"] for r in runs]
            tag = f"{mode} " if mode else ""
            for key, label in (("ttft_ms", "TTFT"), ("e2e_ms", "E2E")):
                ax[0].plot(rates, [r[key]["p50"] for r in runs], "o-", label=f"{tag}{label} p50")
                ax[0].plot(rates, [r[key]["p99"] for r in runs], "o--", label=f"{tag}{label} p99")
            ax[1].plot(rates, [r["tpot_ms"]["p50"] for r in runs], "o-", label=f"{tag}TPOT p50")
            ax[1].plot(rates, [r["tpot_ms"]["p99"] for r in runs], "o--", label=f"{tag}TPOT p99")
            ax[1].plot(rates, [r["itl_ms"]["p99"] for r in runs], "s:", label=f"{tag}ITL p99")
        for a, y in zip(ax, ("latency (ms)", "per-token latency (ms)")):
            a.set_xlabel("request rate (requests/s)")
            a.set_ylabel(y)
            a.legend()
            a.grid(alpha=0.3)
        fig.suptitle(f"paxkv serve {result['model']} over HTTP ({result['device']})")

    save_figure(os.path.join(out, "serving.png"), draw, nrows=1, ncols=2, figsize=(10, 4))


def plot_bursts(result: dict, out: str) -> None:
    """serving_burst.png: output tokens over time in each all-at-once run (from the server's
    gauges), beside the offline run's average pace: where an HTTP run loses its time."""
    bursts = [r for r in result["runs"] if r["rate"] == "inf" and r.get("timeline", {}).get("samples")]
    if not bursts:
        return

    def draw(fig, ax):
        for i, r in enumerate(bursts):
            samples = r["timeline"]["samples"]
            base = samples[0]["generation_tokens_total"]
            ax.plot([x["t"] for x in samples], [x["generation_tokens_total"] - base for x in samples],
                    label=f"HTTP run {i + 1} ({r.get('engine_mode') or ''} {r['client']}), "
                          f"{r['output_throughput']:.0f} tok/s")
        offline = result.get("offline") or {}
        if offline.get("run_s"):
            total = offline["output_throughput"] * offline["run_s"]
            ax.plot([0, offline["run_s"]], [0, total], "k--",
                    label=f"offline pace, {offline['output_throughput']:.0f} tok/s")
        ax.set_xlabel("seconds since the burst was sent")
        ax.set_ylabel("output tokens generated")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"{result['model']}: all requests at once ({result['device']})")

    save_figure(os.path.join(out, "serving_burst.png"), draw, figsize=(7, 4))


def main(argv) -> None:
    del argv
    import logging
    import resource
    logging.getLogger("httpx").setLevel(logging.WARNING)   # one line per request otherwise
    # A thousand streams at once are a thousand sockets on each side (children inherit this).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if FLAGS.offline_json:
        run_offline(FLAGS.offline_json)
        return
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    # The offline run and the server compile the same step programs: compile them once.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", FLAGS.compile_cache_dir)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")   # as bench_throughput.py
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    import jax
    result: dict = {"command": " ".join(["python3", *sys.argv]), "model": FLAGS.model,
                    "jax": jax.__version__, "server_flags": " ".join(server_engine_flags()),
                    "workload": FLAGS.workload, "runs": []}
    t_start = time.perf_counter()
    if FLAGS.offline and not FLAGS.url:
        path = os.path.join(FLAGS.out_dir, "offline.json")
        cmd = [sys.executable, os.path.abspath(__file__), *[a for a in sys.argv[1:]], f"--offline_json={path}"]
        print("offline:", " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        with open(path) as f:
            result["offline"] = json.load(f)
        print("offline", result["offline"], flush=True)
    failed = False
    modes = [None] if FLAGS.url else FLAGS.engine_modes
    try:
        for mode in modes:
            failed |= measure_server(mode, env, result, t_start)
        if result.get("offline"):
            off = result["offline"]["output_throughput"]
            for mode in modes:
                first = next(r for r in result["runs"] if r.get("engine_mode") == mode)   # first client
                result.setdefault("offline_ratio_by_mode", {})[str(mode)] = first["output_throughput"] / off
            for r in result["runs"]:
                if r["rate"] == "inf":
                    key = f"{r.get('engine_mode')}/{r.get('client')}"
                    result.setdefault("offline_ratio_by_mode_and_client", {})[key] = r["output_throughput"] / off
            first = result["runs"][0]
            result["offline_ratio"] = first["output_throughput"] / off
            result["offline_ratio_excl_compile"] = first["output_throughput_excl_compile"] / off
    finally:
        result["bench_wall_s"] = time.perf_counter() - t_start
        write_reports(result)
    print(open(os.path.join(FLAGS.out_dir, "serving.md")).read(), flush=True)
    if failed:
        print("FAILED: some requests failed (see errors in serving.json)", flush=True)
        sys.exit(1)
    short = {m: r for m, r in result.get("offline_ratio_by_mode", {}).items() if r < FLAGS.min_offline_ratio}
    if short:
        print(f"FAILED: HTTP throughput / offline {short} (target {FLAGS.min_offline_ratio})", flush=True)
        sys.exit(1)


def measure_server(mode: str | None, env: dict, result: dict, t_start: float) -> bool:
    """Start the server in `mode` (None: --url's server), warm it up, run the trace at once
    and at each rate; append the runs to `result`. True when a request failed."""
    if mode not in (None, "process", "thread"):
        raise ValueError(f"--engine_modes: {mode!r} is neither process nor thread")
    server = None
    failed = False
    try:
        if mode is None:
            url = FLAGS.url
        else:
            server = Server(free_port(), env, mode)
            server.wait(FLAGS.startup_timeout_s)
            url = server.url
        import httpx
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        vocab = vocab_size()
        # Not jax.devices() here: this process must not claim the accelerator the server uses.
        result["device"] = (result.get("offline") or {}).get("device", "see the server log")
        trace = make_trace(FLAGS.num_prompts, math.inf, FLAGS.seed, vocab)
        # Warm-up prompts of the same lengths but other ids: the same step shapes get compiled,
        # and the timed run finds nothing of its own in the prefix cache.
        warm = [(0.0, p, FLAGS.warmup_output_len or o) for _, p, o in
                make_trace(FLAGS.num_prompts, math.inf, FLAGS.seed + 1000, vocab)[:FLAGS.warmup_prompts or None]]
        phases = [warm]
        if FLAGS.rates:   # then staggered arrivals: prefills mixed into running decodes
            fastest = max(float(r) for r in FLAGS.rates)
            phases.append([(a, p, FLAGS.warmup_output_len or o) for a, p, o in
                           make_trace(FLAGS.warmup_rate_prompts, fastest, FLAGS.seed + 2000, vocab)])
        t = time.perf_counter()
        for i, phase in enumerate(phases):
            warm_results, _ = asyncio.run(drive(url, model, phase, f"{mode} warm-up {i + 1}",
                                                FLAGS.clients[0]))
            if not all(r.ok for r in warm_results):
                raise RuntimeError(f"warm-up failed: {[r.error for r in warm_results if not r.ok][:3]}")
        result.setdefault("warmup_s", {})[str(mode)] = time.perf_counter() - t
        runs = [(math.inf, trace)] + [(float(r), make_trace(FLAGS.rate_num_prompts, float(r),
                                                            FLAGS.seed + 1 + i, vocab))
                                      for i, r in enumerate(FLAGS.rates)]
        for k, (rate, tr) in enumerate(runs):
            if k > 0 and time.perf_counter() - t_start > FLAGS.deadline_s:
                result.setdefault("skipped_rates", []).append(f"{mode}:{rate}")
                continue
            for c, client_kind in enumerate(FLAGS.clients if math.isinf(rate) else FLAGS.clients[:1]):
                if c:   # same lengths, other ids: nothing of it is in the prefix cache yet
                    tr = make_trace(len(tr), rate, FLAGS.seed + 500 + c, vocab)
                before = scrape(url)
                cpu0 = time.process_time()
                with Timeline(url, FLAGS.timeline_interval_s) as timeline:
                    results, wall = asyncio.run(drive(url, model, tr, f"{mode} {client_kind} rate {rate}",
                                                      client_kind))
                client_cpu_s = time.process_time() - cpu0
                summary = {"engine_mode": mode, "client": client_kind,
                           **summarize(results, wall, before, scrape(url), rate),
                           "client_cpu_share": client_cpu_s / wall,
                           "timeline": timeline.summary(wall, len(tr))}
                result["runs"].append(summary)
                print(json.dumps({k: v for k, v in summary.items() if k != "timeline"}), flush=True)
                print("timeline:", json.dumps({k: v for k, v in summary["timeline"].items()
                                               if k != "samples"}), flush=True)
                failed |= summary["failed"] > 0
    finally:
        if server is not None:
            result.setdefault("server_exit_code", {})[str(mode)] = server.stop()
    return failed


if __name__ == "__main__":
    app.run(main)

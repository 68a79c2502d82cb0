"""Driving the real engine for the serving experiments: engines, prompts, offline and timed runs.

The serving experiments (throughput against request rate, block size, sharing, preemption)
all run the same loop: build an `LLM` of a given geometry, turn a synthetic trace into
token-id prompts of the trace's lengths (random ids, `ignore_eos`, `max_tokens` = the
trace's output length, so every request generates exactly its length), step the engine and
stamp each request's finish time.

Compilation is kept out of every figure. The runner compiles one program per shape bucket
on first use (seconds on a GPU for Llama-3-8B); a step that compiled is flagged in its
`StepStats.compile_s`, and the clock used for arrivals and finish times is paused for it
(`VirtualClock`). Offline runs are also made twice (`run_offline_twice`): scheduling is
deterministic given the lengths, so the second pass, on fresh random prompts of the same
lengths, sees the same shapes and compiles nothing (the count is recorded to check it).
"""
from __future__ import annotations

import dataclasses
import datetime
import inspect
import json
import math
import os
import time
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import numpy as np
from absl import flags

from configs import experiments as configs
from experiments import common
from paxkv.sim import workloads
from paxkv.sim.workloads import Request

T = TypeVar("T")

# Weights are the same for every engine of an experiment: built once, shared by all LLMs.
_PARAMS: dict[tuple[str, str], Any] = {}


def make_llm(geo: "configs.EngineGeometry", **override: Any):
    """An LLM of `geo` (pool of `geo.pool_tokens` token slots, prefix caching off).

    `override` replaces LLM arguments (block_size, scheduler, preemption_mode, ...); a
    changed `block_size` keeps the pool's token capacity. Weights are shared between calls.
    """
    from paxkv import LLM
    bs = override.pop("block_size", geo.block_size)
    pool_tokens = override.pop("pool_tokens", geo.pool_tokens)
    kw: dict[str, Any] = dict(
        dtype=geo.dtype, block_size=bs, num_gpu_blocks_override=pool_tokens // bs + 1,
        max_num_seqs=geo.max_num_seqs, max_num_batched_tokens=geo.max_num_batched_tokens,
        max_model_len=geo.max_model_len, enable_prefix_caching=False, seed=geo.seed)
    kw.update(common.parallel_llm_kwargs())
    kw.update(override)
    key = (geo.model, geo.dtype)
    # A multi-host engine loads its own shards on every process: weights are not passed.
    shared = None if kw.get("distributed_coordinator_address") else _PARAMS.get(key)
    llm = LLM(geo.model, params=shared, **kw)
    _PARAMS.setdefault(key, llm.llm_engine.runner.params)
    return llm


def clip_trace(trace: Sequence[Request], max_prompt_len: int, max_output_len: int) -> list[Request]:
    """The trace with prompt and output lengths capped (so it fits a smaller max_model_len)."""
    return [Request(min(r.prompt_len, max_prompt_len), min(r.output_len, max_output_len), r.arrival_time)
            for r in trace]


def settings_trace(s: Any, name: str, num: int, **make_kwargs: Any) -> list[Request]:
    """Trace `name` of `num` requests from the settings' seed, clipped to their max prompt and
    output lengths (`make_kwargs`, e.g. `rate`, go to `workloads.make_trace`)."""
    return clip_trace(workloads.make_trace(name, num, s.seed, **make_kwargs), s.max_prompt_len,
                      s.max_output_len)


def random_prompts(lengths: Sequence[int], vocab_size: int, seed: int) -> list[list[int]]:
    """Token-id prompts of the given lengths, ids drawn uniformly away from the special ids."""
    rng = np.random.default_rng(seed)
    lo, hi = min(10, vocab_size - 1), vocab_size
    return [rng.integers(lo, hi, size=int(n)).tolist() for n in lengths]


def greedy_params(output_len: int, **extra: Any):
    """Exactly `output_len` tokens: greedy, EOS ignored."""
    from paxkv import SamplingParams
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=int(output_len), **extra)


@dataclasses.dataclass
class Work:
    """One request to submit: its prompt, parameters and (timed runs) arrival offset in seconds."""

    prompt: list[int]
    params: Any                     # SamplingParams or BeamSearchParams
    output_len: int                 # tokens per sequence it will generate
    arrival: float = 0.0
    num_seqs: int = 1               # sequences it generates (n samples, beams)


def trace_work(trace: Sequence[Request], vocab_size: int, seed: int,
               params_fn: Callable[[Request], Any] | None = None) -> list[Work]:
    """Work items for a trace: random prompts of its lengths, greedy to its output lengths."""
    prompts = random_prompts([r.prompt_len for r in trace], vocab_size, seed)
    params_fn = params_fn or (lambda r: greedy_params(r.output_len))
    return [Work(p, params_fn(r), r.output_len, r.arrival_time) for p, r in zip(prompts, trace)]


class VirtualClock:
    """Wall time since start, minus the time spent compiling (steps flagged `compile_s`)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.paused = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.start - self.paused

    def pause(self, seconds: float) -> None:
        self.paused += seconds


class SwapTimer:
    """Times the runner's swap-out / swap-in copies (blocking until each has landed)."""

    def __init__(self, llm: Any) -> None:
        import jax
        runner = llm.llm_engine.runner
        self.out_s = self.in_s = 0.0
        self.blocks_out = self.blocks_in = 0
        self.calls = 0
        orig_out, orig_in = runner.swap_out, runner.swap_in

        def swap_out(pairs):
            if not pairs:
                return orig_out(pairs)
            t = time.perf_counter()
            orig_out(pairs)                 # ends with device -> host numpy copies: synchronous
            self.out_s += time.perf_counter() - t
            self.blocks_out += len(pairs)
            self.calls += 1

        def swap_in(pairs):
            if not pairs:
                return orig_in(pairs)
            t = time.perf_counter()
            orig_in(pairs)
            jax.block_until_ready(runner.kv_pool)
            self.in_s += time.perf_counter() - t
            self.blocks_in += len(pairs)
            self.calls += 1

        runner.swap_out, runner.swap_in = swap_out, swap_in

    def reset(self) -> None:
        self.out_s = self.in_s = 0.0
        self.blocks_out = self.blocks_in = self.calls = 0

    def summary(self) -> dict[str, float]:
        return {"swap_out_s": self.out_s, "swap_in_s": self.in_s, "swap_s": self.out_s + self.in_s,
                "blocks_swapped_out": self.blocks_out, "blocks_swapped_in": self.blocks_in,
                "swap_calls": self.calls}


@dataclasses.dataclass
class RunStats:
    """One run of work through the engine, timed on the virtual clock (compilation excluded)."""

    num_requests: int
    num_finished: int
    wall_s: float                   # first submission to last finish (or the cut-off)
    compile_s: float                # paused: steps that compiled
    num_compiles: int               # new shape buckets compiled during the run
    steps: int
    output_tokens: int
    prefill_tokens: int             # includes recomputation after preemption
    decode_tokens: int
    preemptions: int
    mean_batch: float               # sequences per step
    max_blocks_used: int
    physical_block_steps: int       # sum over steps of blocks held (shared blocks once)
    logical_block_steps: int        # ... had no block been shared
    latencies: list[float]          # per request: finish - arrival (unfinished: cut-off - arrival)
    normalized: list[float]         # latency / output tokens per sequence
    finished_mask: list[bool]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def sharing_saving(self) -> float:
        """Share of the KV blocks sharing saved, time-weighted over steps."""
        lg = self.logical_block_steps
        return 1.0 - self.physical_block_steps / lg if lg else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.num_finished / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        norm = np.asarray(self.normalized, dtype=np.float64)
        lat = np.asarray(self.latencies, dtype=np.float64)
        return {
            "num_requests": self.num_requests, "num_finished": self.num_finished,
            "wall_s": self.wall_s, "compile_s_excluded": self.compile_s,
            "compiles_during_run": self.num_compiles, "steps": self.steps,
            "output_tokens": self.output_tokens, "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens, "preemptions": self.preemptions,
            "mean_batch": self.mean_batch, "max_blocks_used": self.max_blocks_used,
            "requests_per_s": self.requests_per_s, "output_tokens_per_s": self.output_tokens_per_s,
            "mean_latency_s": float(lat.mean()) if len(lat) else 0.0,
            "mean_normalized_latency_s": float(norm.mean()) if len(norm) else 0.0,
            "p90_normalized_latency_s": float(np.percentile(norm, 90)) if len(norm) else 0.0,
            "sharing_saving": self.sharing_saving, **self.extra,
        }


def _supports_only_finished(engine: Any) -> bool:
    try:
        return "only_finished" in inspect.signature(engine.step).parameters
    except (TypeError, ValueError):
        return False


def run(llm: Any, work: Sequence[Work], *, realtime: bool = False, cutoff_s: float | None = None,
        progress: Any = None) -> RunStats:
    """Submit `work` and step the engine until every request finished (or `cutoff_s`).

    Offline (`realtime=False`): everything is queued at once. Real time: a request is
    submitted when the virtual clock passes its `arrival`; the engine steps continuously
    while it has work and sleeps until the next arrival otherwise. Latency of a request is
    its finish minus its arrival; `cutoff_s` (virtual seconds) stops a run that cannot keep
    up: unfinished requests are aborted and counted with the cut-off as their finish (a
    lower bound on their latency).
    """
    from paxkv.sampling_params import BeamSearchParams
    engine = llm.llm_engine
    runner = engine.runner
    sched = engine.scheduler
    bm = engine.block_manager
    only_finished = {"only_finished": True} if _supports_only_finished(engine) else {}
    order = sorted(range(len(work)), key=lambda i: (work[i].arrival if realtime else 0.0, i))
    rid_of: dict[int, str] = {}
    index_of: dict[str, int] = {}
    arrival = [w.arrival if realtime else 0.0 for w in work]
    finish: list[float | None] = [None] * len(work)
    pending: set[str] = set()
    beams: set[str] = set()
    compiles0 = runner.num_compilations
    steps0 = len(engine.metrics.steps)
    phys = logic = 0
    clock = VirtualClock()
    base = time.monotonic()
    nxt = 0
    done = 0
    stopped_at: float | None = None

    def submit(i: int) -> None:
        w = work[i]
        if isinstance(w.params, BeamSearchParams):
            rid = engine.add_beam_request(w.prompt, w.params)
            beams.add(rid)
        else:
            rid = f"w{id(work)}-{i}"
            engine.add_request(rid, w.prompt, w.params, arrival_time=base + arrival[i])
        rid_of[i] = rid
        index_of[rid] = i
        pending.add(rid)

    while done < len(work):
        now = clock.now()
        if cutoff_s is not None and now > cutoff_s:
            stopped_at = now
            break
        while nxt < len(order) and (not realtime or work[order[nxt]].arrival <= now):
            submit(order[nxt])
            nxt += 1
        if not pending:
            if nxt >= len(order):
                break
            wait = work[order[nxt]].arrival - clock.now()
            if wait > 0:
                time.sleep(min(wait, 0.05))
            continue
        engine.step(**only_finished)
        last = engine.metrics.steps[-1]
        if last.compile_s:
            clock.pause(last.compile_s)
        now = clock.now()
        phys += bm.num_used_blocks
        logic += sum(len(s.block_table) for s in sched.running_seqs)
        for rid in [r for r in pending if r not in engine.requests]:
            pending.discard(rid)
            finish[index_of[rid]] = now
            done += 1
            if rid in beams:
                engine.pop_beam_result(rid)
        if progress is not None:
            progress.n = done
            progress.refresh()
    if stopped_at is not None:
        engine.abort_request(list(pending))     # frees their blocks at once
    end = stopped_at if stopped_at is not None else max((f for f in finish if f is not None), default=0.0)
    steps = [s for s in engine.metrics.steps[steps0:]]
    timed = [s for s in steps if s.num_seqs_scheduled]
    lat, norm, mask = [], [], []
    for i, w in enumerate(work):
        if i not in rid_of:          # never submitted (cut off before it arrived)
            continue
        f = finish[i]
        mask.append(f is not None)
        latency = (f if f is not None else end) - arrival[i]
        lat.append(latency)
        norm.append(latency / max(1, w.output_len))
    return RunStats(
        num_requests=len(work), num_finished=done, wall_s=end, compile_s=clock.paused,
        num_compiles=runner.num_compilations - compiles0, steps=len(timed),
        output_tokens=sum(w.output_len * w.num_seqs for i, w in enumerate(work) if finish[i] is not None),
        prefill_tokens=sum(s.num_prefill_tokens for s in timed),
        decode_tokens=sum(s.num_decode_tokens for s in timed),
        preemptions=sum(s.num_preemptions for s in steps),
        mean_batch=float(np.mean([s.num_seqs_scheduled for s in timed])) if timed else 0.0,
        max_blocks_used=max((s.blocks_used for s in steps), default=0),
        physical_block_steps=phys, logical_block_steps=logic,
        latencies=lat, normalized=norm, finished_mask=mask)


def run_offline_twice(llm: Any, make_work: Callable[[int], Sequence[Work]], seed: int,
                      **kw: Any) -> RunStats:
    """A warm-up pass (compiles every shape the run needs) and a timed pass on fresh prompts.

    `make_work(seed)` must give the same lengths and parameters for any seed.
    """
    run(llm, make_work(seed + 7919), **kw)
    return run(llm, make_work(seed), **kw)


def engine_hardware(model: str) -> str:
    """Which model ran where, for result files."""
    import platform

    import jax
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        where = (f"CPU only ({platform.machine()}, {os.cpu_count()} cores, JAX {jax.__version__}, "
                 "reference attention)")
    else:
        where = f"{dev.device_kind}, JAX {jax.__version__}"
    what = {"tiny": "the embedded tiny model (4 layers, 256 wide)",
            "llama3-8b": "Llama-3-8B shapes with random bf16 weights"}.get(model, model)
    return f"{what} on {where}"


def settings_from_flags(name: str) -> Any:
    """Experiment `name`'s settings for `--setting`, with `--time_budget_s` applied (<= 0:
    no budget); the flags are `common.define_serving_flags()`'s."""
    f = flags.FLAGS
    s = configs.get(name, f.setting)
    if f.time_budget_s is not None:
        s = dataclasses.replace(s, time_budget_s=f.time_budget_s if f.time_budget_s > 0 else None)
    return s


def result_name(name: str) -> str:
    """The files' stem: `<name>` for the CPU and tiny settings, `<name>_gpu` for the GPU one,
    so that CPU and GPU results live side by side."""
    return name + ("_gpu" if flags.FLAGS.setting == "gpu" else "")


def write_serving_results(name: str, s: Any, *, title: str, results: dict[str, Any], table: str,
                          notes: str, figure: Any, quiet: bool = False) -> None:
    """Writes a serving experiment's files under `--out_dir` with the command, hardware and
    settings, then prints the table (`quiet`: only the paths, for a sweep's interim writes)."""
    f = flags.FLAGS
    runs = {r.get("run_started", "before resuming was recorded") for r in results.get("runs", [])}
    if len(runs) > 1:
        notes += (f" The points were measured in {len(runs)} runs, each resuming the last (`--resume_from`); "
                  "every point's `run_started` in the json says which run measured it.")
    hardware = engine_hardware(s.engine.model)
    loads = [r["host_load_1m"] for r in results.get("runs", []) if "host_load_1m" in r]
    if loads and hardware.split(" on ", 1)[-1].startswith("CPU"):
        # Real-time figures on a shared CPU depend on what else ran: say how busy it was.
        notes += (f" The machine's 1-minute load average as each point finished: {min(loads):.1f} to "
                  f"{max(loads):.1f} on {os.cpu_count()} cores.")
    paths = common.write_results(
        result_name(name), f.out_dir, title=title,
        command=common.command_line(), hardware=hardware,
        settings=dataclasses.asdict(s), results=results, table=table, notes=notes, figure=figure)
    if not quiet:
        print(table)
    print("wrote", ", ".join(paths.values()))


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class SweepLog:
    """A sweep's finished points: those a previous run left in its json, then each new one.

    GPU sweeps outlast one device session, so they run in parts: every new point is written
    out as soon as it finishes (`write(rows)` rewrites the experiment's files), so a run
    stopped by its time budget, or killed, keeps every point it finished; a later run with
    `--resume_from` that json keeps those points and runs only the others. `key(row)` names a
    point (e.g. `(row["block_size"], row["mode"])`).
    """

    def __init__(self, key: Callable[[dict[str, Any]], tuple], rows: Sequence[dict[str, Any]] = (),
                 write: Callable[[list[dict[str, Any]]], None] | None = None) -> None:
        self.key = key
        self.rows = list(rows)
        self.write = write
        self.num_resumed = len(self.rows)
        self._done = {key(r) for r in self.rows}
        self.started = _utc_now()

    def done(self, *key: Any) -> bool:
        return tuple(key) in self._done

    def add(self, row: dict[str, Any]) -> None:
        row.setdefault("run_started", self.started)
        if hasattr(os, "getloadavg"):
            row.setdefault("host_load_1m", round(os.getloadavg()[0], 2))
        row.setdefault("measured_at", _utc_now())
        self.rows.append(row)
        self._done.add(self.key(row))
        if self.write is not None:
            self.write(self.rows)


def previous_rows(path: str | None, *, name: str, settings: Any, hardware: str,
                  point_fields: Sequence[str] = (),
                  measured_since: str | None = None) -> list[dict[str, Any]]:
    """The finished points ("runs") of a previous run's json, checked to be the same experiment.

    The file must hold `name` (the stem, e.g. "preemption_gpu"), measured on `hardware`, with
    the same settings except the time budget and `point_fields` (the fields that list or
    order the points, such as `block_sizes`; "loads.rates" names the `rates` of every entry
    of a field `loads`): anything else would mix points of different experiments, so it
    raises ValueError naming what differs. A missing file: no points.

    `measured_since` (a UTC time, "YYYY-MM-DDTHH:MM:SSZ") keeps only the points measured at or
    after it: the settings check cannot see that the engine itself changed between parts, so
    this is how points of an older engine are dropped and measured again. Points that carry
    no time (written before times were recorded) are dropped too.
    """
    since = _parse_utc(measured_since) if measured_since else None
    if not path:
        return []
    if not os.path.exists(path):
        print(f"resume_from: {path} does not exist; starting from no points")
        return []
    with open(path) as f:
        payload = json.load(f)
    if payload.get("name") != name:
        raise ValueError(f"resume_from: {path} holds {payload.get('name')!r}, not {name!r}")
    if payload.get("hardware") != hardware:
        raise ValueError(f"resume_from: {path} was measured on {payload.get('hardware')!r}, "
                         f"this run is on {hardware!r}")
    want = _without(json.loads(json.dumps(common.jsonable(dataclasses.asdict(settings)))), point_fields)
    got = _without(payload.get("settings", {}), point_fields)
    ignored = {"time_budget_s", *point_fields}
    differ = sorted(k for k in set(want) | set(got) if k not in ignored and want.get(k) != got.get(k))
    if differ:
        raise ValueError(f"resume_from: {path} has other settings: {', '.join(differ)} differ "
                         f"(theirs: {', '.join(f'{k}={got.get(k)!r}' for k in differ)})")
    rows = payload.get("results", {}).get("runs", [])
    if since is not None:
        kept = [r for r in rows if r.get("measured_at") and _parse_utc(r["measured_at"]) >= since]
        print(f"resume_from: dropping {len(rows) - len(kept)} points measured before {measured_since} "
              "(or without a time); they are measured again")
        rows = kept
    print(f"resume_from: {len(rows)} finished points from {path}")
    return rows


def _parse_utc(stamp: str) -> datetime.datetime:
    """A "YYYY-MM-DDTHH:MM:SSZ" time (the json's measured_at); ValueError naming the format."""
    try:
        return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    except ValueError:
        raise ValueError(f"resume_measured_since: expected a UTC time like 2026-12-01T21:00:00Z, "
                         f"got {stamp!r}") from None


def run_resumable(name: str, s: Any, key: Callable[[dict[str, Any]], tuple], point_fields: Sequence[str],
                  sweep: Callable[..., tuple], write: Callable[..., None]) -> None:
    """An experiment's main: `sweep(s, log)` from the points of `--resume_from`, writing the
    files after every point (`write(s, rows, [], final=False)`) and at the end."""
    log = sweep_log(name, s, key, point_fields, write=lambda rows: write(s, rows, [], final=False))
    rows, skipped = sweep(s, log)[:2]
    write(s, rows, skipped)


def _without(settings: dict[str, Any], point_fields: Sequence[str]) -> dict[str, Any]:
    """`settings` without the sub-fields named "field.sub" (in a dict or in each dict of a list)."""
    out = dict(settings)
    for pf in point_fields:
        field, _, sub = pf.partition(".")
        if not sub or field not in out:
            continue
        value = out[field]
        if isinstance(value, dict):
            out[field] = {k: v for k, v in value.items() if k != sub}
        elif isinstance(value, list):
            out[field] = [{k: v for k, v in x.items() if k != sub} if isinstance(x, dict) else x for x in value]
    return out


def sweep_log(name: str, s: Any, key: Callable[[dict[str, Any]], tuple], point_fields: Sequence[str],
              write: Callable[[list[dict[str, Any]]], None] | None = None) -> SweepLog:
    """A SweepLog holding the points of `--resume_from` (when given), for experiment `name`."""
    rows = previous_rows(flags.FLAGS.resume_from, name=result_name(name), settings=s,
                         hardware=engine_hardware(s.engine.model), point_fields=point_fields,
                         measured_since=flags.FLAGS.resume_measured_since)
    return SweepLog(key, rows, write)


# A wall-clock deadline (seconds since the epoch) for a batch of experiments: each sweep's
# budget is cut to what is left of it (scripts/run_all.sh sets it for the GPU settings).
DEADLINE_ENV = "PAXKV_DEADLINE"


class Budget:
    """A time budget for a sweep: run points in priority order while the estimate fits.

    The budget is `seconds` from now, or what is left until $PAXKV_DEADLINE if sooner.
    """

    def __init__(self, seconds: float | None) -> None:
        deadline = os.environ.get(DEADLINE_ENV)
        if deadline:
            left = float(deadline) - time.time()
            seconds = left if seconds is None else min(seconds, left)
        self.seconds = seconds
        self.start = time.perf_counter()
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, estimate_s: float, label: str) -> bool:
        if self.seconds is None or self.elapsed() + estimate_s <= self.seconds:
            return True
        self.skipped.append(label)
        return False

    def points(self, items: Iterable[T], label: Callable[[T], str]) -> Iterator[T]:
        """The items whose turn still fits, each estimated to cost what the last one run did
        (the caller's loop body is what gets timed); the rest go to `skipped`."""
        last_cost = 0.0
        for item in items:
            if not self.allows(last_cost, label(item)):
                continue
            t0 = self.elapsed()
            yield item
            last_cost = self.elapsed() - t0


def engine_note(g: "configs.EngineGeometry", pool: str) -> str:
    """The "Engine: ..." sentence of a serving experiment's notes; `pool` says how the token
    slots are split ("at every block size", "in blocks of 16")."""
    return (f"Engine: {g.model} ({g.dtype}), KV pool of {g.pool_tokens} token slots {pool}, at most "
            f"{g.max_num_seqs} sequences and {g.max_num_batched_tokens} tokens per step, max_model_len "
            f"{g.max_model_len}")


def completion_fields(skipped: Sequence[str], final: bool) -> dict[str, Any]:
    """The results' `skipped`, `complete` and `in_progress` fields: a sweep is complete only
    at its final write and only when the time budget skipped nothing."""
    return {"skipped": skipped, "complete": final and not skipped, "in_progress": not final}


def skipped_note(skipped: Sequence[str]) -> str:
    """The notes' closing sentence naming the points a time budget skipped (or nothing)."""
    return f" Skipped for the time budget: {', '.join(skipped)}." if skipped else ""


def fmt_s(x: float) -> str:
    if not math.isfinite(x):
        return "inf"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"

"""The latency-against-load experiments (Figs. 13, 14, 16, 17) at their tiny settings, and the
resumable sweeps: a resumed sweep keeps the points it was given and runs only the others."""
import dataclasses
import functools
import json
import os
import subprocess
import sys

import pytest

from configs import experiments as configs
from experiments import serving
from experiments.load_sweep import static_capacity
from paxkv.sim import workloads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A tiny run compiles the tiny model's shape buckets; on a busy two-core machine that takes a while.
TIMEOUT_S = 300


def _proc(script: str, out_dir: str, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu", MPLBACKEND="Agg")
    return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", script), f"--out_dir={out_dir}", *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _run(script: str, out_dir, *flags: str) -> dict:
    proc = _proc(script, str(out_dir), "--setting=tiny", *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = script[:-3]
    for ext in ("json", "md", "png"):
        assert os.path.getsize(os.path.join(out_dir, f"{name}.{ext}")) > 0
    with open(os.path.join(out_dir, f"{name}.json")) as f:
        payload = json.load(f)
    assert f"PYTHONPATH=. python3 experiments/{script}" in payload["command"]
    assert payload["results"]["complete"] and not payload["results"]["in_progress"]
    return payload


def _static_ok(rows, g: configs.EngineGeometry, per_request: int = 1) -> None:
    for r in rows:
        assert r["num_requests"] > 0 and r["mean_normalized_latency_s"] > 0
        if r["policy"] == "static":   # each sequence reserves max_model_len
            assert r["mean_batch"] <= static_capacity(g) + 1e-9


@pytest.mark.slow
def test_batched_requests_tiny(tmp_path):
    s = configs.get("batched_requests", "tiny")
    payload = _run("batched_requests.py", tmp_path)
    rows = payload["results"]["runs"]
    assert {(r["group"], r["policy"], r["rate"]) for r in rows} == {
        (ld.trace, p, rate) for ld in s.loads for p in s.policies for rate in ld.rates}
    _static_ok(rows, s.engine)
    bars = payload["results"]["batched_requests"]
    for ld in s.loads:
        mine = {r["policy"]: r["mean_batch"] for r in rows if r["group"] == ld.trace and r["rate"] == ld.bar_rate}
        assert bars[ld.trace] == mine
    md = (tmp_path / "batched_requests.md").read_text()
    assert "2.2x Orca (Oracle)" in md and "## Every rate" in md


@pytest.mark.slow
def test_sampling_vs_rate_tiny(tmp_path):
    s = configs.get("sampling_vs_rate", "tiny")
    payload = _run("sampling_vs_rate.py", tmp_path)
    rows = payload["results"]["runs"]
    assert {(r["group"], r["policy"]) for r in rows} == {(g, p) for g in ("parallel n=2", "beam width 2")
                                                         for p in s.policies}
    _static_ok(rows, s.engine)
    for r in rows:
        n = max(s.min_requests, round(r["rate"] * s.window_s))
        trace = serving.clip_trace(workloads.make_trace(s.trace, n, s.seed, rate=r["rate"]), s.max_prompt_len,
                                   s.max_output_len)
        if not r["cut_off"]:   # every sample and beam generated the trace's length
            assert r["num_finished"] == n and r["output_tokens"] == 2 * sum(q.output_len for q in trace)
    assert "2.3x" in (tmp_path / "sampling_vs_rate.md").read_text()


@pytest.mark.slow
def test_shared_prefix_tiny_caches_the_prefix(tmp_path):
    s = configs.get("shared_prefix", "tiny")
    payload = _run("shared_prefix.py", tmp_path)
    rows = {(r["group"], r["policy"], r["rate"]): r for r in payload["results"]["runs"]}
    (shots, tokens), = s.prefixes
    rate, = s.rates
    group = f"{shots} prefix ({tokens} tokens)"
    on, off = rows[(group, "prefix caching", rate)], rows[(group, "no prefix caching", rate)]
    assert (group, "static", rate) in rows
    _static_ok(rows.values(), s.engine)
    assert on["prefill_tokens"] < off["prefill_tokens"]
    if not (on["cut_off"] or off["cut_off"] or on["preemptions"] or off["preemptions"]):
        # The warm-up left the prefix cached: every request reuses its full blocks.
        full = tokens // s.engine.block_size * s.engine.block_size
        assert off["prefill_tokens"] - on["prefill_tokens"] == full * on["num_requests"]
    assert "1.67x Orca (Oracle)" in (tmp_path / "shared_prefix.md").read_text()


@pytest.mark.slow
def test_chatbot_tiny(tmp_path):
    s = configs.get("chatbot", "tiny")
    payload = _run("chatbot.py", tmp_path)
    rows = payload["results"]["runs"]
    assert {(r["policy"], r["rate"]) for r in rows} == {(p, r) for p in s.policies for r in s.rates}
    _static_ok(rows, s.engine)
    summary = payload["results"]["trace_at_highest_rate"]
    assert summary["prompt_max"] == s.max_prompt_len and summary["prompt_mean"] > summary["output_mean"]
    assert "2x the three Orca baselines" in (tmp_path / "chatbot.md").read_text()


# ---- resuming a sweep --------------------------------------------------------------------------

def _rows(path) -> list[dict]:
    with open(path) as f:
        return json.load(f)["results"]["runs"]


@pytest.mark.slow
def test_resumed_sweep_keeps_finished_points_and_runs_the_rest(tmp_path):
    first, second, third = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    a = _run_bs(first, "--block_sizes=16")
    assert {r["block_size"] for r in a} == {16}
    b = _run_bs(second, "--block_sizes=16,64", f"--resume_from={first / 'block_size_ablation.json'}")
    assert [r for r in b if r["block_size"] == 16] == a          # carried over, not measured again
    assert {(r["trace"], r["block_size"]) for r in b} == {(t, bs) for t in ("sharegpt", "alpaca") for bs in (16, 64)}
    # Nothing left to run: the same points come back, none measured again.
    c = _run_bs(third, "--block_sizes=16,64", f"--resume_from={second / 'block_size_ablation.json'}")
    assert c == b
    # Points measured before a given time (an older engine's) are dropped and measured again.
    # Here: the first run's points (block 16), seconds older than the second run's.
    since = min(r["measured_at"] for r in b if r["block_size"] == 64)
    assert all(r["measured_at"] < since for r in a)
    d = _run_bs(tmp_path / "d", "--block_sizes=16,64", f"--resume_from={third / 'block_size_ablation.json'}",
                f"--resume_measured_since={since}")
    kept = [r for r in b if r["block_size"] == 64]
    assert [r for r in d if r["block_size"] == 64] == kept       # the newer points carried over
    again = [r for r in d if r["block_size"] == 16]
    assert {r["trace"] for r in again} == {"sharegpt", "alpaca"}
    assert all(r["measured_at"] >= since and r not in a for r in again)


def _run_bs(out_dir, *flags: str) -> list[dict]:
    proc = _proc("block_size_ablation.py", str(out_dir), "--setting=tiny", *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _rows(out_dir / "block_size_ablation.json")


def _payload(tmp_path, settings, name="preemption", hardware="hw") -> str:
    path = tmp_path / "prev.json"
    path.write_text(json.dumps({"name": name, "hardware": hardware,
                                "settings": json.loads(json.dumps(dataclasses.asdict(settings))),
                                "results": {"runs": [{"block_size": 16, "mode": "swap", "wall_s": 1.0}]}}))
    return str(path)


def test_previous_rows_checks_experiment_hardware_and_settings(tmp_path):
    s = configs.get("preemption", "tiny")
    path = _payload(tmp_path, s)
    rows = serving.previous_rows(path, name="preemption", settings=s, hardware="hw", point_fields=("block_sizes",))
    assert rows == [{"block_size": 16, "mode": "swap", "wall_s": 1.0}]
    # The point list and the budget may change between parts; nothing else may.
    other = dataclasses.replace(s, block_sizes=(16, 32), time_budget_s=5.0)
    assert serving.previous_rows(path, name="preemption", settings=other, hardware="hw",
                                 point_fields=("block_sizes",)) == rows
    with pytest.raises(ValueError, match="num_requests"):
        serving.previous_rows(path, name="preemption", settings=dataclasses.replace(s, num_requests=5),
                              hardware="hw", point_fields=("block_sizes",))
    with pytest.raises(ValueError, match="holds 'preemption', not 'preemption_gpu'"):
        serving.previous_rows(path, name="preemption_gpu", settings=s, hardware="hw")
    with pytest.raises(ValueError, match="measured on 'hw'"):
        serving.previous_rows(path, name="preemption", settings=s, hardware="other")
    assert serving.previous_rows(str(tmp_path / "missing.json"), name="preemption", settings=s, hardware="hw") == []


def test_previous_rows_drops_points_measured_before_a_time(tmp_path):
    s = configs.get("preemption", "tiny")
    path = tmp_path / "prev.json"
    runs = [{"block_size": 8, "mode": "swap"},                                    # no time: dropped
            {"block_size": 16, "mode": "swap", "measured_at": "2026-12-01T07:56:00Z"},
            {"block_size": 32, "mode": "swap", "measured_at": "2026-12-01T21:20:30Z"}]
    path.write_text(json.dumps({"name": "preemption", "hardware": "hw",
                                "settings": json.loads(json.dumps(dataclasses.asdict(s))),
                                "results": {"runs": runs}}))
    read = functools.partial(serving.previous_rows, str(path), name="preemption", settings=s, hardware="hw")
    assert read() == runs
    assert read(measured_since="2026-12-01T21:00:00Z") == runs[2:]
    assert read(measured_since="2026-12-01T07:56:00Z") == runs[1:]              # at the time: kept
    with pytest.raises(ValueError, match="resume_measured_since"):
        read(measured_since="yesterday")


def test_sweep_log_names_points_and_writes_each_one():
    written = []
    log = serving.SweepLog(lambda r: (r["block_size"], r["mode"]), [{"block_size": 16, "mode": "swap"}],
                           write=lambda rows: written.append(len(rows)))
    assert log.done(16, "swap") and not log.done(16, "recompute") and log.num_resumed == 1
    log.add({"block_size": 16, "mode": "recompute"})
    assert log.done(16, "recompute") and written == [2] and "measured_at" in log.rows[-1]


def test_rate_sweep_runs_only_the_points_it_lacks():
    from experiments import load_sweep

    trace = lambda rate: [workloads.Request(4, 2, 0.0)]  # noqa: E731
    load = load_sweep.Load(rates=(1.0, 2.0), trace=trace, work=lambda t, v, seed: [])
    done = [{"group": "g", "policy": p, "rate": r} for p in ("continuous", "static") for r in (1.0, 2.0)]
    log = serving.SweepLog(load_sweep.point_key, done)

    def no_engine(policy):
        raise AssertionError(f"built an engine for {policy}, though every point was done")

    warm = load_sweep.sweep(name="t", loads={"g": load}, policies=("continuous", "static"), make_llm=no_engine,
                            drain_s=1.0, seed=0, budget=serving.Budget(None), log=log, progress=False)
    assert warm == {} and log.rows == done
    # A missing point needs its policy's engine.
    log = serving.SweepLog(load_sweep.point_key, done[:-1])
    with pytest.raises(AssertionError, match="static"):
        load_sweep.sweep(name="t", loads={"g": load}, policies=("continuous", "static"), make_llm=no_engine,
                         drain_s=1.0, seed=0, budget=serving.Budget(None), log=log, progress=False)


def test_sustained_rate_interpolates_and_brackets():
    from experiments.load_sweep import sustained_rate
    assert sustained_rate([1, 2, 4], [1.0, 2.0, 6.0], 4.0) == (3.0, "crossing")
    assert sustained_rate([1, 2], [1.0, 2.0], 5.0) == (2, ">=")
    assert sustained_rate([1, 2], [9.0, 12.0], 5.0) == (1, "<")


def test_a_cut_off_run_does_not_sustain_its_rate():
    from experiments.load_sweep import sustained_rate
    # Latency under the threshold, but the 4/s run was cut off: 2/s is what was sustained.
    assert sustained_rate([1, 2, 4], [1.0, 2.0, 3.0], 4.0, [False, False, True]) == (2, "cut")
    assert sustained_rate([1, 2, 4], [1.0, 2.0, 3.0], 4.0) == (4, ">=")
    assert sustained_rate([1, 2], [1.0, 2.0], 4.0, [True, True]) == (1, "<")
    # Cut off above the threshold too: no crossing is interpolated towards a lower bound.
    assert sustained_rate([1, 2, 4], [1.0, 2.0, 9.0], 4.0, [False, False, True]) == (2, "cut")


def test_previous_rows_ignores_the_rates_inside_each_load(tmp_path):
    s = configs.get("batched_requests", "tiny")
    path = tmp_path / "prev.json"
    path.write_text(json.dumps({"name": "batched_requests", "hardware": "hw",
                                "settings": json.loads(json.dumps(dataclasses.asdict(s))),
                                "results": {"runs": []}}))
    more = dataclasses.replace(s, loads=tuple(dataclasses.replace(ld, rates=ld.rates + (64.0,)) for ld in s.loads))
    assert serving.previous_rows(str(path), name="batched_requests", settings=more, hardware="hw",
                                 point_fields=("loads.rates",)) == []
    clipped = dataclasses.replace(s, loads=tuple(dataclasses.replace(ld, max_output_len=1) for ld in s.loads))
    with pytest.raises(ValueError, match="loads"):
        serving.previous_rows(str(path), name="batched_requests", settings=clipped, hardware="hw",
                              point_fields=("loads.rates",))

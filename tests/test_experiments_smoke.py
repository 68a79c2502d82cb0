"""Each paper-style experiment runs end to end at a tiny setting and writes its results."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, out_dir: str, *flags: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", MPLBACKEND="Agg")
    name = os.path.splitext(os.path.basename(script))[0]
    # Bounded, but generous: on a busy two-core machine compiling the tiny model's buckets alone
    # can take a minute or two.
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), f"--out_dir={out_dir}", *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for ext in ("json", "md", "png"):
        path = os.path.join(out_dir, f"{name}.{ext}")
        assert os.path.getsize(path) > 0, path
    with open(os.path.join(out_dir, f"{name}.json")) as f:
        payload = json.load(f)
    assert f"PYTHONPATH=. python3 experiments/{name}.py" in payload["command"]
    return payload


def test_kv_utilization_tiny(tmp_path):
    payload = _run("experiments/kv_utilization.py", str(tmp_path), "--setting=tiny")
    runs = payload["results"]["runs"]
    for trace in ("sharegpt", "alpaca"):
        by = {(r["policy"], r["block_size"]): r for r in runs if r["trace"] == trace}
        paged = by[("paged", 16)]
        assert paged["num_finished"] == paged["num_requests"]
        for baseline in ("reserve-max", "reserve-pow2", "reserve-oracle"):
            assert paged["loaded_utilization"] > by[(baseline, 1)]["loaded_utilization"], (trace, baseline)
        assert paged["loaded_utilization"] > by[("static", 16)]["loaded_utilization"]
        # Internal fragmentation grows with the block.
        assert by[("paged", 16)]["loaded_utilization"] > by[("paged", 256)]["loaded_utilization"]
    md = (tmp_path / "kv_utilization.md").read_text()
    assert "| paged (vLLM), block 16 |" in md and "20.4%" in md


def test_capacity_cpu(tmp_path):
    payload = _run("experiments/capacity.py", str(tmp_path))
    plans = payload["results"]["plans"]
    worked = [p for p in plans if p["budget"] == "whole device" and p["model"] == "llama3-8b"]
    bf16 = next(p for p in worked if p["kv_dtype"] == "bf16")
    fp8 = next(p for p in worked if p["kv_dtype"] == "fp8")
    assert 72 * 1024 <= bf16["tokens"] <= 73 * 1024
    assert fp8["tokens"] >= 2 * bf16["tokens"]
    h200 = [p for p in plans if p["gpu"].startswith("H200") and p["model"] == "llama3-8b"]
    assert h200 and all(p["tokens"] > 800_000 for p in h200)
    assert payload["results"]["device_check"] is None


# ---- serving experiments: the real engine on the embedded tiny model, tiny settings ----------

def _trace_outputs(name: str, num: int, seed: int, max_prompt: int, max_output: int, rate: float = float("inf")):
    from experiments.serving import clip_trace
    from paxkv.sim import workloads
    return clip_trace(workloads.make_trace(name, num, seed, rate=rate), max_prompt, max_output)


@pytest.mark.slow
def test_throughput_vs_rate_tiny(tmp_path):
    from configs import experiments as configs
    s = configs.get("throughput_vs_rate", "tiny")
    payload = _run("experiments/throughput_vs_rate.py", str(tmp_path), "--setting=tiny")
    runs = payload["results"]["runs"]
    assert {(r["policy"], r["rate"]) for r in runs} == {(p, r) for p in s.policies for r in s.rates}
    low = min(s.rates)
    n = max(s.min_requests, int(round(low * s.window_s)))
    want_tokens = sum(r.output_len for r in _trace_outputs(s.trace, n, s.seed, s.max_prompt_len,
                                                            s.max_output_len, rate=low))
    for r in runs:
        assert r["mean_normalized_latency_s"] > 0
        if r["rate"] == low:   # an unloaded server finishes everything, every token generated
            assert r["num_finished"] == r["num_requests"] == n and not r["cut_off"]
            assert r["output_tokens"] == want_tokens
    static_cap = min(s.engine.max_num_seqs, s.engine.pool_tokens // s.engine.max_model_len)
    assert all(r["mean_batch"] <= static_cap for r in runs if r["policy"] == "static")
    an = payload["results"]["analysis"]
    for th, factor in zip(an["thresholds"], s.latency_threshold_factors):
        assert th["threshold_s"] == pytest.approx(factor * an["unloaded_normalized_latency_s"])
        assert set(th["policies"]) == set(s.policies)
    assert "2-4x" in (tmp_path / "throughput_vs_rate.md").read_text()


@pytest.mark.slow
def test_block_size_ablation_tiny(tmp_path):
    from configs import experiments as configs
    s = configs.get("block_size_ablation", "tiny")
    payload = _run("experiments/block_size_ablation.py", str(tmp_path), "--setting=tiny")
    runs = payload["results"]["runs"]
    assert {(r["trace"], r["block_size"]) for r in runs} == {(t, b) for t, _ in s.traces for b in s.block_sizes}
    for r in runs:
        n = dict(s.traces)[r["trace"]]
        want = sum(q.output_len for q in _trace_outputs(r["trace"], n, s.seed, s.max_prompt_len, s.max_output_len))
        assert r["num_finished"] == n and r["output_tokens"] == want
        # The warm-up pass compiled every shape: the timed pass compiles nothing.
        assert r["compiles_during_run"] == 0
        assert r["num_blocks"] == s.engine.pool_tokens // r["block_size"]
    assert "16-32" in (tmp_path / "block_size_ablation.md").read_text()


@pytest.mark.slow
def test_sharing_savings_tiny(tmp_path):
    payload = _run("experiments/sharing_savings.py", str(tmp_path), "--setting=tiny")
    runs = {(r["kind"], r["width"]): r for r in payload["results"]["runs"]}
    par, beam = runs[("parallel", 2)], runs[("beam", 2)]
    for r in (par, beam):
        assert r["shared"]["num_finished"] == r["num_requests"]
        assert r["shared"]["output_tokens"] == r["unshared"]["output_tokens"] > 0
        assert r["saving"] > 0.05
        assert r["unshared"]["sharing_saving"] == 0.0   # nothing shared: the measure reads zero
    # Beams share their whole common prefix, samples only the prompt.
    assert beam["saving"] > par["saving"]
    assert "37.6%-55.2%" in (tmp_path / "sharing_savings.md").read_text()


@pytest.mark.slow
def test_preemption_tiny(tmp_path):
    payload = _run("experiments/preemption.py", str(tmp_path), "--setting=tiny")
    rows = {r["mode"]: r for r in payload["results"]["runs"]}
    rc, sw = rows["recompute"], rows["swap"]
    assert rc["output_tokens"] == sw["output_tokens"] > 0
    assert rc["num_finished"] == rc["num_requests"] and sw["num_finished"] == sw["num_requests"]
    assert rc["preemptions"] > 0 and sw["preemptions"] > 0
    assert rc["recomputed_tokens"] > 0 and rc["blocks_swapped_out"] == 0
    assert sw["swap_preemptions"] > 0 and sw["blocks_swapped_out"] == sw["blocks_swapped_in"] > 0
    assert sw["swap_s"] > 0
    ratio = payload["results"]["recompute_over_swap"]
    assert ratio[str(rc["block_size"])] == pytest.approx(rc["wall_s"] / sw["wall_s"])


@pytest.mark.slow
def test_kernel_overhead_tiny(tmp_path):
    bench = {"device": "Some GPU", "jax": "0.0", "decode": [
        {"batch": 8, "context": 512, "best": {"us": 110.0}, "contiguous_us": 100.0, "bundled_best_us": 200.0},
        {"batch": 4, "context": 256, "paxkv": []}]}          # a row without timings is skipped
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(bench))
    payload = _run("experiments/kernel_overhead.py", str(tmp_path), "--setting=tiny", f"--kernels_json={path}")
    got = payload["results"]["kernel_benchmark"]["decode"]
    assert len(got) == 1 and got[0]["overhead"] == pytest.approx(0.10)
    (row,) = payload["results"]["this_run"]
    assert row["reference_err"] < 1e-4 and row["reference_paged_us"] > 0 and row["contiguous_xla_us"] > 0
    assert row["pallas_err"] < 1e-4      # the GPU kernel's path, in interpret mode here
    md = (tmp_path / "kernel_overhead.md").read_text()
    assert "+10.0%" in md and "+20% to +26%" in md and "stand-in" in md


@pytest.mark.slow
def test_rl_rollouts_learns_the_keyword(tmp_path):
    """GRPO through the engine with weights synced in place: in six steps the keyword's
    reward rises (it starts near 0.03), and the engine's sampled-token logprobs stay the
    trainer's to float32 rounding."""
    payload = _run("experiments/rl_rollouts.py", str(tmp_path), "--steps=6")
    summary, history = payload["results"]["summary"], payload["results"]["history"]
    assert len(history) == 6
    assert max(h["reward"] for h in history[3:]) > history[0]["reward"]
    assert summary["logprob_gap_max"] < 1e-4

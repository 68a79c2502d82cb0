"""Each paper-style experiment runs end to end at a tiny setting and writes its results."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, out_dir: str, *flags: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", MPLBACKEND="Agg")
    name = os.path.splitext(os.path.basename(script))[0]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), f"--out_dir={out_dir}", *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
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

"""The decode-step trace summary (`scripts/trace_summary.py`) on a synthetic Perfetto trace of
known kernels: counts, busy time, and the idle time at each kind of boundary."""
from __future__ import annotations

import gzip
import json

import pytest

from scripts.trace_summary import boundary_gaps, kernel_family, summarize_trace


def _trace(tmp_path, kernels: list[tuple[str, float, float]], pid: int = 7) -> str:
    """A trace directory holding one device's kernels as (name, start us, duration us)."""
    events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
              {"ph": "X", "name": "host_work", "pid": 1, "ts": 0.0, "dur": 1e6}]
    events += [{"ph": "X", "name": n, "pid": pid, "ts": ts, "dur": dur} for n, ts, dur in kernels]
    run = tmp_path / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(tmp_path)


def _two_steps() -> list[tuple[str, float, float]]:
    """Two steps of: norm, matmul (starting 0.25 us after the norm), reduce (overlapping the
    matmul's end by 0.5 us), then the next step 100 us later."""
    out = []
    for step, t0 in enumerate((0.0, 200.0)):
        out += [(f"paxkv_add_rms_norm_{step}", t0, 2.0),
                ("gemm_fusion_dot_1", t0 + 2.25, 10.0),
                (f"loop_reduce_fusion_{94 + step}", t0 + 11.75, 1.5)]
    return out


def test_kernel_family_drops_numbering_but_keeps_matmuls_apart():
    assert kernel_family("loop_reduce_fusion_94") == "loop_reduce_fusion"
    assert kernel_family("paxkv_add_rms_norm__1") == "paxkv_add_rms_norm"
    assert kernel_family("paxkv_combine_splits_s4") == "paxkv_combine_splits_s4"
    assert kernel_family("gemm_fusion_dot_1") == "gemm_fusion_dot_1"
    assert kernel_family("gemm_fusion_dot_2") != kernel_family("gemm_fusion_dot_1")


def test_boundary_gaps_by_kind():
    kernels = [{"name": n, "ts": ts, "dur": dur} for n, ts, dur in _two_steps()]
    rows = {(r["before"], r["after"]): r for r in boundary_gaps(kernels, steps=2)}
    norm_to_mm = rows[("paxkv_add_rms_norm", "gemm_fusion_dot_1")]
    assert norm_to_mm["per_step"] == 1.0
    assert norm_to_mm["median_gap_us"] == pytest.approx(0.25)
    overlap = rows[("gemm_fusion_dot_1", "loop_reduce_fusion")]
    assert overlap["median_gap_us"] == pytest.approx(-0.5)       # launched early
    # the step boundary (reduce -> next norm) happens once in two steps: left out
    assert ("loop_reduce_fusion", "paxkv_add_rms_norm") not in rows


def test_summarize_trace_counts_busy_time_and_boundaries(tmp_path):
    summary = summarize_trace(_trace(tmp_path, _two_steps()), steps=2)
    assert summary["processes"] == ["/device:GPU:0"]
    assert summary["kernels_per_step"] == 3.0
    # per step: 2 + 10 + 1.5 us of kernels, 0.5 us of them overlapping
    assert summary["busy_ms_per_step"] == pytest.approx(13.0e-3)
    top = {t["name"]: t for t in summary["top"]}
    assert top["gemm_fusion_dot_1"]["mean_us"] == pytest.approx(10.0)
    assert summary["ms_per_step_per_device_by_kind"]["matmul"] == pytest.approx(10.0e-3)
    assert {(b["before"], b["after"]) for b in summary["boundaries"]} == {
        ("paxkv_add_rms_norm", "gemm_fusion_dot_1"), ("gemm_fusion_dot_1", "loop_reduce_fusion")}


def test_summarize_trace_without_a_trace(tmp_path):
    assert "error" in summarize_trace(str(tmp_path), steps=1)

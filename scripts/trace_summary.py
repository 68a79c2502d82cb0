"""Summaries of a Perfetto trace of decode steps (`jax.profiler`): per-step kernel count, busy
time, the kernels that take it, and the idle time at each kind of boundary between kernels.

Plain JSON reading, no JAX: `profile_step.py` writes the trace and calls `summarize_trace`.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import statistics

# What a kernel's name says it does, for the split of a traced step (first match wins).
KERNEL_KINDS = (("all-reduce", ("all-reduce", "allreduce", "nccl", "all_reduce")),
                ("attention", ("paxkv_paged", "paxkv_ragged", "attention")),
                ("matmul", ("gemm", "cublas", "cutlass", "matmul", "dot", "xmma", "wgmma", "sm90")))


def kernel_kind(name: str) -> str:
    lower = name.lower()
    for kind, words in KERNEL_KINDS:
        if any(w in lower for w in words):
            return kind
    return "other"


def kernel_family(name: str) -> str:
    """A kernel's name without XLA's numbering (`loop_reduce_fusion_94` -> `loop_reduce_fusion`,
    `paxkv_add_rms_norm__1` -> `paxkv_add_rms_norm`), so the boundaries between the same two
    kinds of kernel add up across layers; numbers that belong to a name (`..._s4`: 4 splits)
    stay, and the weight matmuls keep their numbers, which tell the projections apart."""
    if name.startswith("gemm_fusion"):
        return name
    return re.sub(r"[_.]+\d+$", "", name) or name


def boundary_gaps(kernels: list[dict], steps: int, top: int = 16) -> list[dict]:
    """Idle time between consecutive kernels of one device, by (kernel before, kernel after):
    what each kind of boundary costs per step. A negative gap is an overlap (the next kernel
    started before the last one ended: programmatic dependent launch)."""
    ordered = sorted(kernels, key=lambda e: float(e["ts"]))
    gaps: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for before, after in zip(ordered, ordered[1:]):
        end = float(before["ts"]) + float(before["dur"])
        gaps[(kernel_family(before["name"][:90]), kernel_family(after["name"][:90]))].append(
            float(after["ts"]) - end)
    # the steps' own boundaries (host waits between steps) are the largest: median, not mean
    rows = [{"before": b, "after": a, "per_step": len(g) / steps,
             "median_gap_us": statistics.median(g),
             "us_per_step": statistics.median(g) * len(g) / steps}
            for (b, a), g in gaps.items() if len(g) >= steps]
    return sorted(rows, key=lambda r: -abs(r["us_per_step"]))[:top]


def summarize_trace(trace_dir: str, steps: int) -> dict:
    """Per-step kernel count, busy time and top kernels from a Perfetto trace of `steps` steps."""
    files = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        return {"error": "no perfetto trace written"}
    with gzip.open(files[0], "rt") as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    pnames = {e["pid"]: e.get("args", {}).get("name", "") for e in events
              if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {p for p, n in pnames.items() if "/device:" in n and "CPU" not in n.upper()}
    if not device_pids:   # CPU backend: XLA ops run on host threads
        device_pids = {p for p, n in pnames.items() if "host" in n.lower()}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids
               and e.get("dur") is not None]
    if not kernels:
        return {"error": "no device events", "processes": sorted(set(pnames.values()))[:20]}
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in kernels:
        by_name[e["name"][:90]].append(float(e["dur"]))
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels)
    busy, cur_a, cur_b = 0.0, None, None
    for a, b in spans:                       # union of the kernel intervals
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                busy += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    busy += cur_b - cur_a
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:20]
    kinds: dict[str, float] = collections.defaultdict(float)
    for name, d in by_name.items():   # per device: the trace holds every device's kernels
        kinds[kernel_kind(name)] += sum(d) / 1e3 / steps / len(device_pids)
    first_device = min(device_pids)
    boundaries = boundary_gaps([e for e in kernels if e.get("pid") == first_device], steps)
    return {"processes": sorted(pnames[p] for p in device_pids),
            "boundaries": boundaries,
            "ms_per_step_per_device_by_kind": dict(kinds),
            "kernels_per_step": len(kernels) / steps,
            "busy_ms_per_step": busy / 1e3 / steps,
            "span_ms_per_step": (spans[-1][1] - spans[0][0]) / 1e3 / steps,
            "top": [{"name": n, "calls_per_step": len(d) / steps, "ms_per_step": sum(d) / 1e3 / steps,
                     "mean_us": statistics.fmean(d)} for n, d in top]}

"""Probe: XLA's own Triton tiling for the decode step's 8-row weight matmuls against other
tilings, timed the way the step meets them (weights streamed from HBM).

XLA's autotuner times each matmul alone over one set of buffers, so a weight that fits in L2
(o: 33.5 MB, q/k/v: 50.3 MB; the H200 has 50 MB) may be read from L2 after the first
repetition, and the tiling it picks be the fastest from L2 rather than from HBM, where the
decode step reads it (at 3.3-3.6 TB/s for o and q/k/v against 4.3 for gate/up). This probe times a
chain of NW such matmuls over distinct weights (400 MB together), each one's input computed
from the one before by a small fusion as in the step (so XLA cannot merge them), per tiling.

    PYTHONPATH=. python3 scripts/probes/probe_xla_gemm_tilings.py --out_dir DIR [--shapes o,qkv]
    PYTHONPATH=. python3 scripts/probes/probe_xla_gemm_tilings.py --out_dir DIR --shapes down \
        --budget_s 0 --dump_autotune      # XLA's pick only, its autotuning results dumped

A tiling is forced with `--xla_gpu_override_gemm_autotuner` (a `TritonGemmKey` textproto) in
XLA_FLAGS of a fresh process per tiling, persistent compilation cache off: passed as a compile
option in one process it changes nothing (the compiled HLO is identical; XLA's in-process
autotuning cache is the likely reason). The key's `split_k` is not honoured on this XLA
(JAX 0.11.2): the split of K comes from a rewrite before tiling, and every split_k gives the
same kernels (the `fusions` count). Every tiling's output is checked against the default
compilation's. Time per matrix = the chain's median back-to-back time / NW (it includes the
small fusion after each matmul, as the step does).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "down": (14336, 4096), "gate_up": (4096, 28672)}
ROWS = 8


def child(shape: str, out_path: str) -> None:
    """One process, one tiling (whatever XLA_FLAGS says): time the chain and save the output."""
    sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),   # the probes, scripts/
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench_common import back_to_back

    k, n = SHAPES[shape]
    nw = max(2, -(-int(4.0e8) // (k * n * 2)))
    key = jax.random.key(0)
    ws = [(jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.float32) * 0.02
           ).astype(jnp.bfloat16) for i in range(nw)]
    x0 = jax.random.normal(key, (ROWS, k), jnp.float32).astype(jnp.bfloat16)

    @jax.jit
    def chain(x0, ws):
        x, outs = x0, []
        for w in ws:
            y = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
            # The next input depends on all of this output (so no column can be dropped),
            # through one small row-reduction fusion, like the step's norms.
            row = jnp.sum(y.astype(jnp.float32), axis=1, keepdims=True)
            outs.append(row)
            x = x0 + (row * 1e-6).astype(jnp.bfloat16)
        return jnp.stack(outs)

    got = chain(x0, ws)
    t = back_to_back(chain, x0, ws) / nw
    text = chain.lower(x0, ws).compile().as_text()
    entry = text[text.find("ENTRY"):]
    np.save(out_path + ".npy", np.asarray(got, np.float32))
    with open(out_path + ".json", "w") as f:
        json.dump({"us": t * 1e6, "tbps": k * n * 2 / t / 1e12, "nw": nw,
                   "fusions": entry.count(" fusion("),
                   # What XLA compiled, to confirm the forced tiling took effect.
                   "gemm_configs": sorted(set(re.findall(
                       r'"(?:block_level_fusion_config|triton_gemm_config)":(\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\})', text)))[:4],
                   "xla_flags": os.environ.get("XLA_FLAGS", "")}, f)


def tiling_key(bm: int, bn: int, bk: int, sk: int, stages: int, warps: int) -> str:
    return (f"block_m: {bm} block_n: {bn} block_k: {bk} split_k: {sk} "
            f"num_stages: {stages} num_warps: {warps} num_ctas: 1")


def candidates(shape: str) -> list[tuple]:
    """Tilings in XLA's own orientation for these matmuls (M = the weight's output features,
    N = the 8 token rows, as the autotuner's picks in the engine show)."""
    k, n = SHAPES[shape]
    out = []
    for bm, bk, sk in itertools.product((64, 128, 256), (32, 64, 128), (1, 2, 4)):
        if n % bm or k % (bk * sk):
            continue
        out.append((bm, 8, bk, sk, 4, 4))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out_dir", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default="o,qkv")
    ap.add_argument("--budget_s", type=float, default=420.0)
    ap.add_argument("--dump_autotune", action="store_true",
                    help="the default processes dump XLA's autotuning results to "
                         "OUT_DIR/autotune_SHAPE_LABEL.textproto (see scripts/autotune_results.py)")
    ap.add_argument("--child", default=None)
    ap.add_argument("--child_out", default=None)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.child_out)
        return
    import numpy as np

    os.makedirs(args.out_dir, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="tilings_")   # each process's output; only the summary stays
    shapes = args.shapes.split(",")
    plan = []
    for shape in shapes:
        plan.append((shape, None))
        plan += [(shape, c) for c in candidates(shape)]
        plan.append((shape, None))   # the default again, last: drift over the run
    res = {"method": __doc__, "shapes": {s: {} for s in shapes}}
    t0 = time.perf_counter()
    started, reference = {}, {}
    for shape, cfg in plan:
        started.setdefault(shape, time.perf_counter())
        # XLA's own pick always runs, first and last; the tilings between share the budget.
        if cfg is not None and time.perf_counter() - started[shape] > args.budget_s / len(shapes):
            res.setdefault("stopped", []).append(f"{shape}: budget, skipped {cfg}")
            continue
        label = "default" if cfg is None else "bm{}_bn{}_bk{}_sk{}_s{}_w{}".format(*cfg)
        if label == "default" and "default" in res["shapes"][shape]:
            label = "default_again"
        env = dict(os.environ, PAXKV_COMPILATION_CACHE_DIR="off")
        env.pop("XLA_FLAGS", None)
        if cfg is not None:
            env["XLA_FLAGS"] = f'--xla_gpu_override_gemm_autotuner="{tiling_key(*cfg)}"'
        elif args.dump_autotune:
            dump = os.path.join(os.path.abspath(args.out_dir), f"autotune_{shape}_{label}.textproto")
            env["XLA_FLAGS"] = f"--xla_gpu_dump_autotune_results_to={dump}"
        path = os.path.join(scratch, f"tiling_{shape}_{label}")
        proc = subprocess.run([sys.executable, __file__, "--child", shape, "--child_out", path],
                              env=env, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            row = {"error": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr else "?"}
        else:
            with open(path + ".json") as f:
                row = json.load(f)
            got = np.load(path + ".npy")
            if cfg is None:
                reference.setdefault(shape, got)   # XLA's pick, run first for each shape
            ref = reference.get(shape)
            row["rel_err"] = (float("nan") if ref is None else   # no pick to check against
                              float(np.max(np.abs(got - ref)) / (np.max(np.abs(ref)) + 1e-6)))
        res["shapes"][shape][label] = row
        print(shape, label, {k: (round(v, 3) if isinstance(v, float) else v)
                             for k, v in row.items() if k != "xla_flags"}, flush=True)
        with open(os.path.join(args.out_dir, "xla_gemm_tilings.json"), "w") as f:
            json.dump(res, f, indent=1)
    print("\nus per matrix (with its small fusion), fastest five against XLA's pick")
    for shape, rows in res["shapes"].items():
        ok = {lab: r for lab, r in rows.items() if "us" in r and r.get("rel_err", 1) < 0.02}
        base = [rows[lab]["us"] for lab in ("default", "default_again") if "us" in rows.get(lab, {})]
        print(shape, "XLA's pick", [round(b, 2) for b in base])
        for lab in sorted(ok, key=lambda lab: ok[lab]["us"])[:5]:
            print(f"   {lab}: {ok[lab]['us']:.2f} ({ok[lab]['tbps']:.2f} TB/s, {ok[lab]['fusions']} fusions)")
    shutil.rmtree(scratch, ignore_errors=True)
    print("elapsed", round(time.perf_counter() - t0, 1))


if __name__ == "__main__":
    main()

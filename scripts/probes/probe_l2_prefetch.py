"""Probe: how fast one stream's thin matmuls run when their weights were read into L2 first.

At one stream a decode layer spends about 20 us in latency-bound kernels (attention, norms,
RoPE, combines) while HBM idles, and its narrow matmuls (o: 33.5 MB, q/k/v: 50 MB) read at
only 3.5-3.6 TB/s, their ramp and tail a large part of 10-14 us. If the idle kernels had
read the next matmul's weights into the H200's 50 MB L2, how long would the matmul take?

    PYTHONPATH=. python3 scripts/probes/probe_l2_prefetch.py --out_dir DIR
    PYTHONPATH=. python3 scripts/probes/probe_l2_prefetch.py --smoke     # small shapes, CPU interpret

Per shape and variant, over distinct weight matrices (together far over L2), one jit
dispatched REPS times back to back, median of 5 (us per matrix):
    dot        XLA's matmul of 8 rows alone
    read       a Pallas kernel of P programs that reads the matrix (summing it, one float per
               program out), with and without the evict-last cache hint
    read+dot   the read, then the matmul (ordered through an optimization barrier)
The matmul from L2 is then `read+dot - read`. The read's sums are checked against jnp.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),   # the probes, scripts/
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from bench_common import back_to_back  # noqa: E402  (the probes' timing method)

ROWS = 8
SHAPES = {"o_proj": (4096, 4096), "qkv_proj": (4096, 6144)}
WIDTH = 512            # the read views the matrix as rows of this many elements
STEP_ROWS = 32         # rows per load: 32 KB of bf16
REPS = 20
MIN_BYTES = 400e6
INTERPRET = False


def read_kernel(w_ref, o_ref, *, steps: int, policy: str | None):
    def body(i, acc):
        tile = plgpu.load(w_ref.at[pl.ds(i * STEP_ROWS, STEP_ROWS), :], eviction_policy=policy)
        return acc + jnp.sum(tile.astype(jnp.float32))
    o_ref[0] = jax.lax.fori_loop(0, steps, body, jnp.float32(0))


def read(w: jax.Array, programs: int, policy: str | None) -> jax.Array:
    """Sum of each of `programs` equal slices of w -> `[programs]` float32 (w read once)."""
    flat = w.reshape(-1, WIDTH)
    per_program = flat.shape[0] // programs
    steps = per_program // STEP_ROWS
    if per_program % STEP_ROWS or flat.shape[0] % programs:
        raise ValueError(f"{w.shape} does not split into {programs} programs of whole steps")
    return pl.pallas_call(
        functools.partial(read_kernel, steps=steps, policy=policy),
        grid=(programs,),
        in_specs=[pl.BlockSpec((per_program, WIDTH), lambda p: (p, 0))],
        out_specs=pl.BlockSpec((1,), lambda p: (p,)),
        out_shape=jax.ShapeDtypeStruct((programs,), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=INTERPRET, name="probe_l2_read",
    )(flat)


def variants(count: int, programs: int, policy: str | None):
    def dot_only(ws, x):
        return [jnp.dot(x, ws[i]) for i in range(count)]

    def read_only(ws, x):
        return [read(ws[i], programs, policy) for i in range(count)]

    def read_then_dot(ws, x):
        outs = []
        for i in range(count):
            sums = read(ws[i], programs, policy)
            xi, sums = jax.lax.optimization_barrier((x, sums))
            outs.append((jnp.dot(xi, ws[i]), sums))
        return outs
    return {"dot": jax.jit(dot_only), "read": jax.jit(read_only),
            "read+dot": jax.jit(read_then_dot)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out_dir", default="")
    parser.add_argument("--programs", default="64,128,256")
    parser.add_argument("--smoke", action="store_true", help="small shapes, interpret mode")
    args = parser.parse_args()
    global INTERPRET, MIN_BYTES, REPS
    programs_list = [int(p) for p in args.programs.split(",")]
    if args.smoke:
        INTERPRET, MIN_BYTES, REPS = True, 4e6, 2
        SHAPES.update(o_proj=(256, 512), qkv_proj=(256, 1024))
        programs_list = [2, 4]
    rows = []
    report = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "rows": ROWS,
              "reps": REPS, "results": rows}
    for name, (k, n) in SHAPES.items():
        count = max(2, int(-(-MIN_BYTES // (k * n * 2))))
        ws = jax.random.normal(jax.random.PRNGKey(0), (count, k, n), jnp.bfloat16)
        x = jax.random.normal(jax.random.PRNGKey(1), (ROWS, k), jnp.bfloat16)
        want = np.asarray(jnp.sum(ws.astype(jnp.float32).reshape(count, -1), axis=1))
        dot_us = None
        for programs in programs_list:
            for policy in (None, "evict_last"):
                fns = variants(count, programs, policy)
                times = {}
                for label, fn in fns.items():
                    if label == "dot" and dot_us is not None:
                        continue
                    times[label] = back_to_back(fn, ws, x, reps=REPS) / count * 1e6
                    if label == "read":
                        got = np.asarray([np.sum(np.asarray(o, np.float64)) for o in fn(ws, x)])
                        if not np.allclose(got, want, rtol=1e-3, atol=1e-1 * np.sqrt(k * n)):
                            sys.exit(f"FAIL {name}: the read's sums {got[:3]} != {want[:3]}")
                dot_us = times.get("dot", dot_us)
                from_l2 = times["read+dot"] - times["read"]
                row = {"projection": name, "k": k, "n": n, "matrices": count,
                       "programs": programs, "policy": policy or "default", "dot_us": dot_us,
                       "read_us": times["read"], "read_then_dot_us": times["read+dot"],
                       "dot_after_read_us": from_l2,
                       "read_tbps": k * n * 2 / (times["read"] * 1e-6) / 1e12}
                rows.append(row)
                print(f"{name:9s} P={programs:4d} {row['policy']:10s} dot {dot_us:6.2f}  read "
                      f"{times['read']:6.2f} ({row['read_tbps']:.2f} TB/s)  read+dot "
                      f"{times['read+dot']:6.2f}  -> dot after the read {from_l2:6.2f} us",
                      flush=True)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "probe_l2_prefetch.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

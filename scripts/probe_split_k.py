"""Probe: one stream's thin matmuls with XLA's split-K reduction, against split-K partial sums
that the next fused kernel adds up (`paxkv.model.split_k`).

For q/k/v, o and down at one stream's 8 padded rows, each followed by the kernel that reads
it in the model (RoPE + KV write after q/k/v; residual add + RMSNorm after o and down):
`splits` 1 is XLA's own matmul (its split-K choice and reduction kernel included) and the
consumer on its bf16 output; `splits` s > 1 is the matmul with K as a batch axis of s slices,
float32 partials out, and the consumer adding them as it loads. Every split's consumer output
is checked against the unsplit one first.

    PYTHONPATH=. python3 scripts/probe_split_k.py --out_dir DIR
    PYTHONPATH=. python3 scripts/probe_split_k.py --smoke     # small shapes, CPU interpret mode

Method as `probe_thin_matmuls.py`: each case runs over enough distinct weight matrices to
exceed L2 in one jit, dispatched REPS times back to back, then one wait; time per matrix =
wall / (REPS * matrices), median of 5.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from paxkv.model import split_k
from pallas_kernels.layer_ops import add_rms_norm, rope_kv_write

ROWS = 8
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 4096, 32, 8, 128, 14336
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM
SHAPES = {"qkv_proj": (HIDDEN, QKV), "o_proj": (HIDDEN, HIDDEN),
          "down_proj": (INTERMEDIATE, HIDDEN)}
SPLITS = (1, 2, 4, 8)
REPS = 20
MIN_BYTES = 300e6   # weights per case: well over the H200's 50 MB of L2
INTERPRET = False


def case(name: str, splits: int, count: int):
    """-> (jitted fn, its args, the index of its first output): `count` matmuls of x by distinct
    weights, each followed by the model's consumer of that projection."""
    k, n = SHAPES[name]
    key = jax.random.PRNGKey(0)
    ws = jax.random.normal(key, (count, k, n), jnp.bfloat16) * 0.02
    x = jax.random.normal(jax.random.PRNGKey(1), (ROWS, k), jnp.bfloat16)
    residual = jax.random.normal(jax.random.PRNGKey(2), (ROWS, HIDDEN), jnp.bfloat16)
    scale = jnp.ones((HIDDEN,), jnp.bfloat16)
    angles = jax.random.uniform(jax.random.PRNGKey(3), (ROWS, HEAD_DIM // 2)) * 100
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    slots = jnp.arange(ROWS, dtype=jnp.int32) * 3
    pages = jnp.zeros((64, 16, KV_HEADS, HEAD_DIM), jnp.bfloat16)

    def run(ws, x, residual, k_pages, v_pages):
        outs = []
        for i in range(count):
            y = split_k.matmul(x, ws[i], splits)
            partial_sums = isinstance(y, split_k.SplitK)
            y = y.partials if partial_sums else y
            if name == "qkv_proj":
                heads = y.reshape(*y.shape[:-1], HEADS + 2 * KV_HEADS, HEAD_DIM)
                q, k_pages, v_pages = rope_kv_write(heads, cos, sin, slots, k_pages, v_pages,
                                                    partial_sums=partial_sums,
                                                    dtype=jnp.bfloat16, interpret=INTERPRET)
                outs.append(q)
            else:
                outs.append(add_rms_norm(y, residual, scale, eps=1e-5,
                                         partial_sums=partial_sums, interpret=INTERPRET)[1])
        return outs, k_pages, v_pages

    fn = jax.jit(run, donate_argnums=(3, 4))
    return fn, [ws, x, residual, pages, pages.copy()]


def timed(fn, args, trials: int = 5) -> tuple[float, list]:
    outs, k, v = fn(*args)
    jax.block_until_ready(outs)
    args[3], args[4] = k, v
    times = []
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(REPS):
            outs, args[3], args[4] = fn(*args)
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t) / REPS)
    return statistics.median(times), outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out_dir", default="")
    parser.add_argument("--smoke", action="store_true", help="small shapes, interpret mode")
    args = parser.parse_args()
    global INTERPRET, MIN_BYTES, REPS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, QKV
    if args.smoke:
        INTERPRET, MIN_BYTES, REPS = True, 1e6, 2
        HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 256, 4, 2, 64, 512
        QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        SHAPES.update(qkv_proj=(HIDDEN, QKV), o_proj=(HIDDEN, HIDDEN),
                      down_proj=(INTERMEDIATE, HIDDEN))
    rows, report = [], {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                        "rows": ROWS, "reps": REPS}
    for name, (k, n) in SHAPES.items():
        count = max(2, int(-(-MIN_BYTES // (k * n * 2))))
        reference = None
        for splits in SPLITS:
            fn, fargs = case(name, splits, count)
            seconds, outs = timed(fn, fargs)
            got = np.asarray(jnp.stack(outs).astype(jnp.float32))
            if reference is None:
                reference, err = got, 0.0
            else:
                err = float(np.max(np.abs(got - reference)) / np.max(np.abs(reference)))
                if err > 2e-2:
                    sys.exit(f"FAIL {name} splits={splits}: relative error {err:.3g} against splits=1")
            us = seconds / count * 1e6
            row = {"projection": name, "k": k, "n": n, "splits": splits, "matrices": count,
                   "us_per_matmul_and_consumer": us, "weights_tbps": k * n * 2 / (us * 1e-6) / 1e12,
                   "max_rel_err_vs_unsplit": err}
            rows.append(row)
            print(f"{name:10s} K={k:6d} N={n:6d} splits={splits}: {us:7.2f} us "
                  f"({row['weights_tbps']:.2f} TB/s of weights), rel err {err:.2g}", flush=True)
    report["rows"] = rows
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "probe_split_k.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

"""Probe: the small fused layer kernels at one stream's 8 rows, by warps per program.

The residual add + RMSNorm kernel (two per layer) and the RoPE + KV-write kernel (one) take
2.3-2.4 us each in a one-stream step, against 1.3-1.5 us for XLA's smallest fusions there.
Each runs one program per row, so their time is a latency chain; this times them with
every warp count that fits, in chains of CALLS dependent launches in one jit (us per
launch, median of 5), next to XLA's own jnp form of the same work. Every variant's output
is checked against the jnp reference first.

    PYTHONPATH=. python3 scripts/probes/probe_layer_kernels.py --out_dir DIR
    PYTHONPATH=. python3 scripts/probes/probe_layer_kernels.py --smoke    # small shapes, CPU interpret
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.layer_ops import (add_rms_norm, add_rms_norm_reference, rope_kv_write,
                                      rope_kv_write_reference)

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),   # the probes, scripts/
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from bench_common import back_to_back  # noqa: E402  (the probes' timing method)

ROWS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 8, 4096, 32, 8, 128
CALLS, REPS = 64, 10
INTERPRET = False


def us_per_launch(fn, *args, donated: int = 0) -> float:
    """`back_to_back` of a chain of CALLS launches, per launch, in microseconds."""
    return back_to_back(fn, *args, reps=REPS, donated=donated) / CALLS * 1e6


def check(label: str, got, want) -> None:
    """Exit loudly unless every output matches its jnp reference (one bf16 rounding)."""
    for g, r in zip(got, want):
        if not np.allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                           rtol=1e-2, atol=1e-2):
            sys.exit(f"FAIL {label}")


def norm_chain(num_warps: int | None):
    """CALLS add + norm launches, each reading the previous one's outputs."""
    def run(x, residual, scale):
        for _ in range(CALLS):
            if num_warps == 0:   # XLA's own form
                residual, x = add_rms_norm_reference(x, residual, scale, 1e-5)
            else:
                residual, x = add_rms_norm(x, residual, scale, eps=1e-5, interpret=INTERPRET,
                                           num_warps=num_warps)
        return residual, x
    return jax.jit(run)


def rope_chain(num_warps: int | None):
    """CALLS RoPE + KV-write launches into the same (donated) pages."""
    def run(qkv, cos, sin, slots, k_pages, v_pages):
        qs = []
        for i in range(CALLS):
            if num_warps == 0:
                q, k_pages, v_pages = rope_kv_write_reference(qkv, cos, sin, slots + i, k_pages,
                                                              v_pages)
            else:
                q, k_pages, v_pages = rope_kv_write(qkv, cos, sin, slots + i, k_pages, v_pages,
                                                    interpret=INTERPRET, num_warps=num_warps)
            qs.append(q[0, 0, 0])
        return jnp.stack(qs), k_pages, v_pages
    return jax.jit(run, donate_argnums=(4, 5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out_dir", default="")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    global INTERPRET, CALLS, REPS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM
    warps = [0, 1, 2, 4, 8, 16]
    if args.smoke:
        INTERPRET, CALLS, REPS = True, 2, 1
        HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 256, 4, 2, 32
        warps = [0, 1, 4]
    rng = np.random.default_rng(0)
    bf16 = jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((ROWS, HIDDEN)), bf16)
    residual = jnp.asarray(rng.standard_normal((ROWS, HIDDEN)), bf16)
    scale = jnp.asarray(rng.standard_normal(HIDDEN), bf16)
    qkv = jnp.asarray(rng.standard_normal((ROWS, HEADS + 2 * KV_HEADS, HEAD_DIM)), bf16)
    angles = rng.uniform(0, 300, (ROWS, HEAD_DIM // 2)).astype(np.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    slots = jnp.asarray(np.arange(ROWS) * 7, jnp.int32)
    page_shape = (256, 16, KV_HEADS, HEAD_DIM)
    rows = []
    want_norm = add_rms_norm_reference(x, residual, scale, 1e-5)
    want_rope = rope_kv_write_reference(qkv, cos, sin, slots, jnp.zeros(page_shape, bf16),
                                        jnp.zeros(page_shape, bf16))
    for w in warps:
        label = "xla" if w == 0 else f"pallas, {w} warps"
        if w:
            check(f"add_rms_norm num_warps={w}",
                  add_rms_norm(x, residual, scale, eps=1e-5, interpret=INTERPRET, num_warps=w),
                  want_norm)
        us = us_per_launch(norm_chain(w), x, residual, scale)
        rows.append({"kernel": "add_rms_norm", "variant": label, "num_warps": w, "us": us})
        print(f"add_rms_norm  [{ROWS}, {HIDDEN}]   {label:18s} {us:6.2f} us", flush=True)
    for w in [v for v in warps if v <= 8]:
        label = "xla" if w == 0 else f"pallas, {w} warps"
        if w:
            check(f"rope_kv_write num_warps={w}",
                  rope_kv_write(qkv, cos, sin, slots, jnp.zeros(page_shape, bf16),
                                jnp.zeros(page_shape, bf16), interpret=INTERPRET, num_warps=w),
                  want_rope)
        # the chain donates the pages: back_to_back threads them through the calls
        us = us_per_launch(rope_chain(w), qkv, cos, sin, slots, jnp.zeros(page_shape, bf16),
                           jnp.zeros(page_shape, bf16), donated=2)
        rows.append({"kernel": "rope_kv_write", "variant": label, "num_warps": w, "us": us})
        print(f"rope_kv_write [{ROWS}, {HEADS + 2 * KV_HEADS}, {HEAD_DIM}] {label:18s} {us:6.2f} us",
              flush=True)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "probe_layer_kernels.json"), "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                       "rows": rows, "calls_per_jit": CALLS}, f, indent=1)


if __name__ == "__main__":
    main()

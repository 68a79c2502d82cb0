"""Probe: the fused RoPE + decode attention kernel at one stream, per layer, by split count.

At one Llama-3-8B stream the fused kernel (with its split combine) is the largest of a
layer's small kernels, about 7.9 us at a 512-token context (results/one_stream.md): 32
programs, each a chain of dependent loads (the sequence length, then its block-table
entries, then K and V rows) with almost no bytes to move. This times the kernel as the
engine runs it (8 decode rows, one real sequence, the others padding; Llama-3-8B heads;
16-token blocks; a table as wide as 8,192 tokens), ROUNDS passes of LAYERS launches over
distinct page pools in one jit (more bytes than L2 holds), us per layer, at several split counts, loop-step
sizes, pipeline depths and warp counts. Every variant's output is checked against the jnp reference first (the run stops
loudly on a mismatch). Commit 8cb6f65 also timed strided splits with it
(results/one_stream.md).

    PYTHONPATH=. python3 scripts/probes/probe_decode_latency.py --out_dir DIR
    PYTHONPATH=. python3 scripts/probes/probe_decode_latency.py --smoke    # small shapes, CPU interpret
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import rope_paged_attention, rope_paged_attention_reference

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),   # the probes, scripts/
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from bench_common import back_to_back  # noqa: E402  (the probes' timing method)

ROWS, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 32, 8, 128, 16
TABLE_PAGES, LAYERS, REPS = 512, 32, 10
# Passes over the LAYERS pools per dispatch: with one pass (32 launches, some 0.3 ms of device
# work) the dispatch of a jit holding 64 donated pools could take as long as the device, and
# two calls on H100s gave the default 8.42 and 14.67 us per layer at the same context.
ROUNDS = 8
CONTEXTS = (200, 384, 512, 640)
# (splits, pages per loop step, pipeline stages, warps); the first is the engine's default
# (stages None: the kernel's default, 2)
VARIANTS = [(4, 8, None, 4), (4, 8, None, 8), (4, 4, None, 4), (4, 8, 1, 4), (4, 8, 3, 4),
            (4, 8, None, 2), (2, 8, None, 4), (8, 4, None, 4), (1, 8, None, 4)]
INTERPRET = False


def make_layer_inputs(rng, ctx: int):
    """One sequence of `ctx` tokens (the new one included) in row 0, padding rows after it,
    and LAYERS distinct pools holding just its pages (permuted, block 0 the null block)."""
    pages = -(-ctx // BLOCK)
    num_blocks = pages + 2
    table = np.zeros((ROWS, TABLE_PAGES), np.int32)
    table[0, :pages] = rng.permutation(np.arange(1, num_blocks))[:pages]
    lens = np.zeros((ROWS,), np.int32)
    lens[0] = ctx
    slots = np.full((ROWS,), -1, np.int32)
    slots[0] = table[0, (ctx - 1) // BLOCK] * BLOCK + (ctx - 1) % BLOCK
    qkv = jnp.asarray(rng.standard_normal((ROWS, Q_HEADS + 2 * KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    angles = rng.uniform(0, 300, (ROWS, HEAD_DIM // 2)).astype(np.float32)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    pools = []
    for _ in range(LAYERS):
        pools.append(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))
        pools.append(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))
    return (qkv, jnp.cos(angles), jnp.sin(angles), jnp.asarray(slots), jnp.asarray(table),
            jnp.asarray(lens)), pools


def layer_chain(splits: int, ppcb: int, stages: int | None, warps: int):
    """ROUNDS x LAYERS fused decode launches, one per pool pair in turn (donated, returned)."""
    def run(qkv, cos, sin, slots, table, lens, *pools):
        outs, pools = [], list(pools)
        for _ in range(ROUNDS):
            for layer in range(LAYERS):
                out, pools[2 * layer], pools[2 * layer + 1] = rope_paged_attention(
                    qkv, cos, sin, slots, pools[2 * layer], pools[2 * layer + 1], table, lens,
                    num_splits=splits, pages_per_compute_block=ppcb, num_stages=stages,
                    num_warps=warps, interpret=INTERPRET)
                outs.append(out[0, 0, 0])
        return (jnp.stack(outs), *pools)
    return jax.jit(run, donate_argnums=tuple(range(6, 6 + 2 * LAYERS)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out_dir", default="")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)),
                        help="comma-separated context lengths")
    parser.add_argument("--max_variants", type=int, default=len(VARIANTS),
                        help="time only the first N variants of VARIANTS")
    args = parser.parse_args()
    global INTERPRET, LAYERS, REPS, ROUNDS, Q_HEADS, KV_HEADS, HEAD_DIM, TABLE_PAGES
    contexts = tuple(int(c) for c in args.contexts.split(","))
    variants = VARIANTS[:args.max_variants]
    if args.smoke:
        INTERPRET, LAYERS, REPS, ROUNDS = True, 2, 1, 1
        Q_HEADS, KV_HEADS, HEAD_DIM, TABLE_PAGES = 8, 2, 32, 16
        contexts, variants = (37, 100), VARIANTS[:2] + [(8, 1, None, 4)]
    rng = np.random.default_rng(0)
    rows = []
    for ctx in contexts:
        inputs, pools = make_layer_inputs(rng, ctx)
        qkv, cos, sin, slots, table, lens = inputs
        want = rope_paged_attention_reference(qkv, cos, sin, slots, pools[0], pools[1], table, lens)[0]
        base = None
        for splits, ppcb, stages, warps in variants:
            label = f"{splits} splits x {ppcb} pages, {stages or 2} stages, {warps} warps"
            got, _, _ = rope_paged_attention(*inputs[:4], pools[0], pools[1], *inputs[4:],
                                             num_splits=splits, pages_per_compute_block=ppcb,
                                             num_stages=stages, num_warps=warps,
                                             interpret=INTERPRET)
            err = float(jnp.linalg.norm((got[0] - want[0]).astype(jnp.float32))
                        / jnp.linalg.norm(want[0].astype(jnp.float32)))
            if not err < 2e-2 or not bool(jnp.isfinite(got).all()):
                sys.exit(f"FAIL ctx {ctx} {label}: relative error {err:.3g}")
            fresh = [jnp.copy(p) for p in pools]
            us = back_to_back(layer_chain(splits, ppcb, stages, warps), *inputs, *fresh, reps=REPS,
                              donated=2 * LAYERS) / (ROUNDS * LAYERS) * 1e6
            base = us if base is None else base
            rows.append({"context": ctx, "splits": splits, "ppcb": ppcb, "stages": stages or 2,
                         "warps": warps,
                         "us_per_layer": us, "rel_err": err})
            print(f"ctx {ctx:4d}  {label:36s} {us:7.2f} us/layer  ({us / base:.3f} of the "
                  f"default)  err {err:.1e}", flush=True)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "probe_decode_latency.json"), "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                       "layers": LAYERS, "rounds": ROUNDS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

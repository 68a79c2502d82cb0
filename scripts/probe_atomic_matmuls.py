"""Probe: matmuls whose programs each own a slice of K and add into a float32 output with
atomics, so that what stands before them fuses in and no split-K reduction follows; at one
stream's 8 padded rows, against what XLA and the engine run today.

- **The MLP in one kernel** (`pallas_kernels.layer_ops.atomic_mlp`): at one stream XLA reads
  the MLP's 352 MB with a gate/up matmul, a SwiGLU kernel, the down matmul (split over K) and
  its reduction, two ramps and tails and two latency-bound launches (results/one_stream.md:
  55.7 + 1.6 + 28.7 + 1.5 us a layer, against 78.8 us for the bytes at 4.47 TB/s). Program j
  owns intermediate features `[j*ti, (j+1)*ti)`: gate and up columns over all of K, SwiGLU
  in registers, the same rows of the down weight, atomics into the output.
- **The split combine inside the o projection** (`layer_ops.atomic_out_proj`): program
  (head, chunk) merges its head's attention splits and multiplies them by the head's rows
  of `w_o`, in place of the combine kernel, XLA's split-K o matmul and its reduction
  (1.4 + 9.8 + 1.5 us a layer).

The cost: the atomics, a zeroed output, and float rounding order that varies from run to run.

    PYTHONPATH=. python3 scripts/probe_atomic_matmuls.py --out_dir DIR
    PYTHONPATH=. python3 scripts/probe_atomic_matmuls.py --smoke     # CPU, interpret mode: checks only

Variants, each checked against the XLA form on the same inputs (relative max error):
- `mlp:xla`: the engine's MLP (gate/up matmul, SwiGLU, down matmul, bf16 between them);
- `mlp:gu_swiglu_*`: a Pallas gate/up kernel with SwiGLU in its epilogue (bf16 out,
  deterministic), then XLA's down matmul;
- `mlp:fused_r{R}_*`: the MLP in one kernel, atomics on the first R rows (8: every padded
  row, as the engine runs it; 1: one stream's real row, what the atomics cost);
- `o:xla`: the engine's combine kernel, then XLA's o matmul; `o:fused_r{R}_*`: one kernel.

Method: a chain over NL layers' distinct weights (well over L2), each layer's output feeding
the next layer's input through the same small fusion in every variant, dispatched back to
back (`bench_common.back_to_back`); us per layer = time / NL. The copy and read ceilings are
measured in the same process.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import back_to_back  # noqa: E402  (the probes' timing method)
from pallas_kernels.layer_ops.atomic_mlp import TILE_ROWS, swiglu_mlp, swiglu_tile  # noqa: E402
from pallas_kernels.layer_ops.atomic_out_proj import merge_out_proj  # noqa: E402
from pallas_kernels.paged_attention.combine import combine_splits, combine_splits_kernel  # noqa: E402

ROWS = 8           # one stream's decode step is padded to 8 rows


def xla_mlp(x: jax.Array, w_gu: jax.Array, w_down: jax.Array) -> jax.Array:
    """The engine's MLP at bf16: `down(silu(gate(x)) * up(x))`, float32 out."""
    inter = w_down.shape[0]
    gu = jnp.dot(x, w_gu)
    h = jax.nn.silu(gu[:, :inter]) * gu[:, inter:]
    return jnp.dot(h, w_down).astype(jnp.float32)


def gu_swiglu(x, w_gu, w_down, *, ti, bk, warps, stages, interpret=False):
    """A Pallas gate/up kernel with SwiGLU in its epilogue (bf16 out), then XLA's down matmul."""
    rows, hidden = x.shape
    inter = w_down.shape[0]
    xp = jnp.pad(x, ((0, TILE_ROWS - rows), (0, 0)))

    def kernel(x_ref, wg_ref, wu_ref, h_ref):
        h_ref[...] = swiglu_tile(x_ref, wg_ref, wu_ref, block_k=bk)

    n_tiles = inter // ti
    h = pl.pallas_call(
        kernel, grid=(n_tiles,),
        in_specs=[pl.BlockSpec((TILE_ROWS, hidden), lambda j: (0, 0)),
                  pl.BlockSpec((hidden, ti), lambda j: (0, j)),
                  pl.BlockSpec((hidden, ti), lambda j: (0, j + n_tiles))],
        out_specs=pl.BlockSpec((TILE_ROWS, ti), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((TILE_ROWS, inter), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret, name=f"gu_swiglu_ti{ti}_bk{bk}")(xp, w_gu, w_gu)
    return jnp.dot(h[:rows], w_down).astype(jnp.float32)


def fused_mlp(x, w_gu, w_down, *, atomic_rows, ti, bk, bn, warps, stages, interpret=False):
    """The library's one-kernel MLP (`atomic_mlp.swiglu_mlp`), atomics on `atomic_rows` rows."""
    return swiglu_mlp(x, w_gu, w_down, tile_inter=ti, block_k=bk, block_n=bn, num_warps=warps,
                      num_stages=stages, added_rows=atomic_rows, interpret=interpret)


def xla_out_proj(o_part, lse, w_o):
    """The engine's attention output side: the split combine (its Pallas kernel on the GPU,
    `combine.combine_splits` elsewhere), bf16, then XLA's o matmul, float32 out."""
    rows, _, heads, head_dim = o_part.shape
    if jax.devices()[0].platform == "gpu":
        attn = combine_splits_kernel(o_part, lse, out_dtype=jnp.bfloat16)
    else:
        attn = combine_splits(o_part, lse).astype(jnp.bfloat16)
    return jnp.dot(attn.reshape(rows, heads * head_dim), w_o).astype(jnp.float32)


def fused_out_proj(o_part, lse, w_o, *, atomic_rows, chunks, bn, warps, stages, interpret=False):
    """The library's split combine + o projection (`atomic_out_proj.merge_out_proj`); with
    `atomic_rows` below the step's rows only those rows are passed (the rest come out 0)."""
    rows = o_part.shape[0]
    out = merge_out_proj(o_part[:atomic_rows], lse[:atomic_rows], w_o, chunks=chunks,
                         block_n=bn, num_warps=warps, num_stages=stages, interpret=interpret)
    return out if atomic_rows == rows else jnp.pad(out, ((0, rows - atomic_rows), (0, 0)))


def chain(mlp, real_rows: int):
    """x -> NL layers of `mlp`, each output added to its input (the same small fusion in every
    variant); only the first `real_rows` rows carry on (the others are a padded step's)."""
    @jax.jit
    def run(x, layers):
        keep = (jnp.arange(x.shape[0]) < real_rows)[:, None]
        for w_gu, w_down in layers:
            y = mlp(x, w_gu, w_down)
            x = jnp.where(keep, x.astype(jnp.float32) + y, 0.0).astype(x.dtype)
        return x
    return run


def chain_out_proj(out_proj, real_rows: int):
    """Split partials -> NL layers of `out_proj`; each layer's partials are its own plus a
    small multiple of the last output (the same small fusion in every variant)."""
    @jax.jit
    def run(layers):
        y = None
        for o_part, lse, w_o in layers:
            if y is not None:
                rows, _, heads, head_dim = o_part.shape
                keep = (jnp.arange(rows) < real_rows)[:, None]
                nudge = jnp.where(keep, y, 0.0).reshape(rows, 1, heads, head_dim)
                o_part = o_part + 1e-3 * nudge
            y = out_proj(o_part, lse, w_o)
        return y[:real_rows]
    return run


def variants(smoke: bool):
    """(part, label, function, real rows) for every variant: the tilings swept at all the
    padded rows, the first two also with one row's atomics."""
    out = [("mlp", "xla", xla_mlp, ROWS)]
    tilings = ([(16, 16, 16)] if smoke else
               [(128, 64, 128), (128, 64, 256), (128, 128, 128), (64, 64, 256), (64, 128, 128)])
    stages = (2,) if smoke else (3, 4)
    for ti, bk, _ in tilings[:2]:
        out.append(("mlp", f"gu_swiglu_ti{ti}_bk{bk}_s{stages[0]}", functools.partial(
            gu_swiglu, ti=ti, bk=bk, warps=4, stages=stages[0], interpret=smoke), ROWS))
    for ti, bk, bn in tilings:
        for st in stages:
            out.append(("mlp", f"fused_r{ROWS}_ti{ti}_bk{bk}_bn{bn}_s{st}", functools.partial(
                fused_mlp, atomic_rows=ROWS, ti=ti, bk=bk, bn=bn, warps=4, stages=st,
                interpret=smoke), ROWS))
    for ti, bk, bn in tilings[:2]:
        out.append(("mlp", f"fused_r1_ti{ti}_bk{bk}_bn{bn}_s{stages[0]}", functools.partial(
            fused_mlp, atomic_rows=1, ti=ti, bk=bk, bn=bn, warps=4, stages=stages[0],
            interpret=smoke), 1))
    out.append(("o", "xla", xla_out_proj, ROWS))
    o_tilings = [(2, 16)] if smoke else [(4, 128), (4, 256), (8, 128), (2, 256)]
    for chunks, bn in o_tilings:
        for st in stages:
            out.append(("o", f"fused_r{ROWS}_c{chunks}_bn{bn}_s{st}", functools.partial(
                fused_out_proj, atomic_rows=ROWS, chunks=chunks, bn=bn, warps=4, stages=st,
                interpret=smoke), ROWS))
    chunks, bn = o_tilings[0]
    out.append(("o", f"fused_r1_c{chunks}_bn{bn}_s{stages[0]}", functools.partial(
        fused_out_proj, atomic_rows=1, chunks=chunks, bn=bn, warps=4, stages=stages[0],
        interpret=smoke), 1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out_dir", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, no timing")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--parts", default="mlp,o", help="mlp, o or both")
    args = parser.parse_args()
    parts = args.parts.split(",")
    hidden, inter, heads, head_dim, splits = ((64, 96, 4, 16, 4) if args.smoke
                                              else (4096, 14336, 32, 128, 4))
    res = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "method": __doc__,
           "hidden": hidden, "intermediate": inter, "layers": args.layers, "variants": {}}
    if not args.smoke:
        n = 1 << 30
        a = jnp.ones((n,), jnp.bfloat16)
        res["read_tbps"] = 2 * n / back_to_back(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), a) / 1e12
        res["copy_tbps"] = 4 * n / back_to_back(jax.jit(lambda a: a + 1), a) / 1e12
        del a
        print("ceilings read %.2f copy %.2f TB/s" % (res["read_tbps"], res["copy_tbps"]), flush=True)
    key = jax.random.key(0)

    def weight(k, shape, fan_in):
        return (jax.random.normal(k, shape, jnp.float32) * fan_in ** -0.5).astype(jnp.bfloat16)
    inputs, nbytes = {}, {}
    if "mlp" in parts:
        layers = []
        for i in range(args.layers):
            kg, kd = jax.random.split(jax.random.fold_in(key, i))
            layers.append((weight(kg, (hidden, 2 * inter), hidden), weight(kd, (inter, hidden), inter)))
        x = jax.random.normal(jax.random.fold_in(key, 999), (ROWS, hidden), jnp.float32).astype(jnp.bfloat16)
        inputs["mlp"], nbytes["mlp"] = (x, layers), 3 * hidden * inter * 2
    if "o" in parts:
        # 4x the layers: the o weight is a seventh of the MLP's
        o_layers = []
        for i in range(4 * args.layers):
            kp, kl, kw = jax.random.split(jax.random.fold_in(key, 10_000 + i), 3)
            lse = jax.random.normal(kl, (ROWS, splits, heads), jnp.float32) * 2.0
            lse = lse.at[:, splits - 1].set(-jnp.inf)     # an empty split, as at short contexts
            o_layers.append((jax.random.normal(kp, (ROWS, splits, heads, head_dim), jnp.float32),
                             lse, weight(kw, (heads * head_dim, hidden), heads * head_dim)))
        inputs["o"], nbytes["o"] = (o_layers,), heads * head_dim * hidden * 2
    refs = {}
    for part, label, fn, real in variants(args.smoke):
        if part not in parts:
            continue
        make = chain if part == "mlp" else chain_out_proj
        n_layers = args.layers if part == "mlp" else 4 * args.layers
        run = make(fn, real)
        try:
            got = jax.block_until_ready(run(*inputs[part]))
            if (part, real) not in refs:
                refs[part, real] = make(xla_mlp if part == "mlp" else xla_out_proj, real)(*inputs[part])
            want = refs[part, real].astype(jnp.float32)
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / (jnp.max(jnp.abs(want)) + 1e-6))
            row = {"rel_err": err}
            if err > 3e-2:
                row["error"] = f"mismatch against XLA: relative error {err:.3g}"
            elif not args.smoke:
                t = back_to_back(run, *inputs[part]) / n_layers
                row.update(us=t * 1e6, tbps=nbytes[part] / t / 1e12)
        except Exception as e:  # noqa: BLE001  (a tiling that does not build is a result too)
            row = {"error": repr(e)[:300]}
        res["variants"][f"{part}:{label}"] = row
        print(part, label, row, flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "atomic_matmuls.json"), "w") as f:
        json.dump(res, f, indent=1)
    bad = [k for k, v in res["variants"].items() if "error" in v and "mismatch" in v["error"]]
    if not args.smoke:
        print("\n| variant | us per layer | TB/s | / xla |\n| --- | --- | --- | --- |")
        for k, v in res["variants"].items():
            if "us" in v:
                base = res["variants"][k.split(":")[0] + ":xla"].get("us", float("nan"))
                print(f"| {k} | {v['us']:.2f} | {v['tbps']:.2f} | {v['us'] / base:.3f} |")
    if bad:
        raise SystemExit(f"variants that disagree with XLA: {bad}")


if __name__ == "__main__":
    main()

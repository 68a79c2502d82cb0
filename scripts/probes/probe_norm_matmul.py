"""Probe: RMSNorm fused into the one-stream q/k/v and gate/up matmuls, against the unfused form.

The unfused form is what the fused-kernel path runs for these rows: the norm kernel
(`pallas_kernels.layer_ops.add_rms_norm`), XLA's matmul and, for gate/up, XLA's SwiGLU. Two
fused Pallas (Triton) forms, each over a sweep of tilings, use `norm(x) @ W = rsqrt(mean(x^2) +
eps) * ((x * scale) @ W)` per row, so the row factor goes on the float32 accumulator at the end
(and with `swiglu` the program reads matching gate and up columns and writes silu(gate) * up):
- `in_loop`: the whole norm inside the kernel: each K step scales its x tile, adds to the sum
  of squares, and repeats the 8 rows in registers to the 16 a tensor-core dot takes;
- `prescaled`: XLA writes `x * scale` padded to 16 rows (one small fusion), and the kernel's K
  loop is a plain GEMV over it; the sum of squares is a prologue over raw x.
Each is checked against the jnp reference on the device first (a miss fails the run), then
timed.

    PYTHONPATH=. python3 scripts/probes/probe_norm_matmul.py --out_dir DIR

Method: as `probe_thin_matmuls.py`. Each shape runs over NW distinct weight matrices (together
well over L2) in one jit, each product feeding the next one's input (so nothing is shared or
simplified away, as in the model); the jit is dispatched REPS times back to back, then one
wait; time per matrix = wall / (REPS * NW), median of 5. Both forms carry the same small
add per matrix that chains them.
"""
import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.layer_ops import add_rms_norm, add_rms_norm_reference

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),   # the probes, scripts/
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from bench_common import back_to_back  # noqa: E402  (the probes' timing method)

ROWS = 8
HIDDEN = 4096
SHAPES = {"qkv": (6144, False), "gate_up": (2 * 14336, True)}
EPS = 1e-5
MAX_ROWS = 16
TILINGS = {   # (block_n, block_k, num_warps, num_stages)
    "qkv": [(bn, bk, 4, st) for bn in (32, 64, 128) for bk in (64, 128, 256) for st in (3, 5)
            if bn * bk <= 16384],
    "gate_up": [(bn, bk, 4, st) for bn in (32, 64) for bk in (64, 128, 256) for st in (3, 4)
                if bn * bk <= 16384],
}


def reference(x, scale, w, *, swiglu):
    """The unfused form in jnp: the norm's reference (float32, rounded to scale's dtype), the
    matmul rounded to w's dtype, and with `swiglu` `silu(gate) * up` of the product's halves."""
    normed = add_rms_norm_reference(x, None, scale, EPS)[1]
    y = jnp.dot(normed, w, preferred_element_type=jnp.float32).astype(w.dtype)
    if not swiglu:
        return y
    gate, up = jnp.split(y, 2, axis=-1)
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(w.dtype)


def _epilogue(accs, inv, swiglu, dtype):
    if swiglu:
        gate = (accs[0] * inv).astype(dtype).astype(jnp.float32)
        up = (accs[1] * inv).astype(dtype).astype(jnp.float32)
        return (gate * jax.nn.sigmoid(gate) * up).astype(dtype)
    return (accs[0] * inv).astype(dtype)


def _in_loop_kernel(x_ref, scale_ref, *refs, rows: int, k: int, block_k: int, eps: float,
                    swiglu: bool):
    """Each K step scales its x tile, adds to the sum of squares, and repeats the rows in
    registers to the dot's 16 (tile row t holds x row t // repeat; rows divides 16). (Gathering
    the repeated rows from memory instead ran at a third of the read bandwidth.)"""
    w_refs, o_ref = refs[:-1], refs[-1]
    block_n = o_ref.shape[-1]
    repeat = MAX_ROWS // rows

    def body(step, carry):
        k0 = pl.multiple_of(step * block_k, block_k)
        xf = x_ref[:, pl.ds(k0, block_k)].astype(jnp.float32)
        scaled = (xf * scale_ref[pl.ds(k0, block_k)].astype(jnp.float32)[None, :]).astype(
            w_refs[0].dtype)
        if repeat > 1:
            scaled = jnp.broadcast_to(scaled[:, None, :], (rows, repeat, block_k)).reshape(
                MAX_ROWS, block_k)
        sum_sq, *accs = carry
        accs = [acc + plgpu.dot(scaled, w_ref[pl.ds(k0, block_k), :]) for acc, w_ref in zip(accs, w_refs)]
        return (sum_sq + jnp.sum(xf * xf, axis=1), *accs)

    zeros = jnp.zeros((MAX_ROWS, block_n), jnp.float32)
    sum_sq, *accs = lax.fori_loop(0, k // block_k, body,
                                  (jnp.zeros((rows,), jnp.float32),) + (zeros,) * len(w_refs))
    if repeat > 1:   # the repeats of a row hold the same values: keep one
        accs = [jnp.max(acc.reshape(rows, repeat, block_n), axis=1) for acc in accs]
    o_ref[...] = _epilogue(accs, lax.rsqrt(sum_sq / k + eps)[:, None], swiglu, o_ref.dtype)


def _prescaled_kernel(x_ref, xs_ref, *refs, rows: int, k: int, block_k: int, eps: float,
                      swiglu: bool):
    """xs_ref: `x * scale` padded to 16 rows by XLA; x_ref: raw x for the sum of squares."""
    w_refs, o_ref = refs[:-1], refs[-1]
    block_n = o_ref.shape[-1]

    def squares(step, sum_sq):
        xf = x_ref[:, pl.ds(pl.multiple_of(step * block_k, block_k), block_k)].astype(jnp.float32)
        return sum_sq + jnp.sum(xf * xf, axis=1)
    sum_sq = lax.fori_loop(0, k // block_k, squares, jnp.zeros((rows,), jnp.float32))

    def body(step, accs):
        k0 = pl.multiple_of(step * block_k, block_k)
        xs = xs_ref[:, pl.ds(k0, block_k)]
        return tuple(acc + plgpu.dot(xs, w_ref[pl.ds(k0, block_k), :]) for acc, w_ref in zip(accs, w_refs))
    zeros = jnp.zeros((MAX_ROWS, block_n), jnp.float32)
    accs = lax.fori_loop(0, k // block_k, body, (zeros,) * len(w_refs))
    if rows < MAX_ROWS:   # padding rows are zeros: summing the row groups keeps the real rows
        accs = [jnp.sum(acc.reshape(MAX_ROWS // rows, rows, block_n), axis=0) for acc in accs]
    o_ref[...] = _epilogue(accs, lax.rsqrt(sum_sq / k + eps)[:, None], swiglu, o_ref.dtype)


def fused(x, scale, w, *, swiglu, variant, block_n, block_k, num_warps, num_stages,
          interpret=False):
    """One of the fused forms (module docstring) -> `[rows, N]` (`[rows, N / 2]` with swiglu)."""
    rows, k = x.shape
    n_out = w.shape[1] // 2 if swiglu else w.shape[1]
    w_specs = [pl.BlockSpec((k, block_n), lambda j: (0, j))]
    if swiglu:
        w_specs.append(pl.BlockSpec((k, block_n), lambda j: (0, j + n_out // block_n)))
    if variant == "in_loop":
        kernel, lead = _in_loop_kernel, [x, scale]
        lead_specs = [pl.BlockSpec((rows, k), lambda j: (0, 0)), pl.BlockSpec((k,), lambda j: (0,))]
    else:
        xs = jnp.pad((x.astype(jnp.float32) * scale.astype(jnp.float32)).astype(w.dtype),
                     ((0, MAX_ROWS - rows), (0, 0)))
        kernel, lead = _prescaled_kernel, [x, xs]
        lead_specs = [pl.BlockSpec((rows, k), lambda j: (0, 0)),
                      pl.BlockSpec((MAX_ROWS, k), lambda j: (0, 0))]
    return pl.pallas_call(
        functools.partial(kernel, rows=rows, k=k, block_k=block_k, eps=EPS, swiglu=swiglu),
        grid=(n_out // block_n,), in_specs=lead_specs + w_specs,
        out_specs=pl.BlockSpec((rows, block_n), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((rows, n_out), w.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"norm_matmul_{variant}")(*lead, *([w] * len(w_specs)))


def unfused(x, scale, w, swiglu):
    normed = add_rms_norm(x, None, scale, eps=EPS)[1]
    y = jnp.dot(normed, w)
    if swiglu:
        gate, up = jnp.split(y, 2, axis=-1)
        y = jax.nn.silu(gate) * up
    return y


def chain(f):
    @jax.jit
    def run(x, scale, ws):
        for w in ws:
            x = (x + f(x, scale, w)[:, :HIDDEN]).astype(x.dtype)
        return x
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out_dir", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    res = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "rows": ROWS,
           "method": __doc__, "shapes": {}}
    key = jax.random.key(0)
    misses = []
    for name, (n, swiglu) in SHAPES.items():
        nbytes = HIDDEN * n * 2
        nw = max(2, -(-int(2.0e8) // nbytes))
        ws = [(jax.random.normal(jax.random.fold_in(key, i), (HIDDEN, n), jnp.float32) * 0.02
               ).astype(jnp.bfloat16) for i in range(nw)]
        x = (jax.random.normal(key, (ROWS, HIDDEN), jnp.float32) * 2).astype(jnp.bfloat16)
        scale = (1 + 0.1 * jax.random.normal(jax.random.fold_in(key, 99), (HIDDEN,))).astype(jnp.bfloat16)
        want = np.asarray(reference(x, scale, ws[0], swiglu=swiglu), np.float32)
        mag = float(np.max(np.abs(want)))
        timings = {}
        t = back_to_back(chain(lambda x, s, w: unfused(x, s, w, swiglu)), x, scale, ws) / nw
        timings["unfused"] = {"us": t * 1e6, "tbps": nbytes / t / 1e12}
        print(name, "unfused", timings["unfused"], flush=True)
        for variant in ("prescaled", "in_loop"):
            for bn, bk, warps, stages in TILINGS[name]:
                label = f"{variant}_bn{bn}_bk{bk}_w{warps}_s{stages}"
                f = functools.partial(fused, swiglu=swiglu, variant=variant, block_n=bn,
                                      block_k=bk, num_warps=warps, num_stages=stages)
                try:
                    got = np.asarray(f(x, scale, ws[0]), np.float32)
                    err = float(np.max(np.abs(got - want))) / mag
                    t = back_to_back(chain(lambda x, s, w: f(x, s, w)), x, scale, ws) / nw
                    timings[label] = {"us": t * 1e6, "tbps": nbytes / t / 1e12, "rel_err": err}
                    if err > 2 ** -6:
                        misses.append(f"{name} {label}: relative error {err:.3g}")
                except Exception as e:  # noqa: BLE001  (a tiling Triton cannot compile)
                    timings[label] = {"error": repr(e)[:300]}
                print(name, label, timings[label], flush=True)
        res["shapes"][name] = timings
        del ws
    lines = ["| matmul | unfused (norm kernel + XLA) us | fused form | fastest tiling | us | / unfused |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, timings in res["shapes"].items():
        for variant in ("prescaled", "in_loop"):
            timed = {k: v for k, v in timings.items() if k.startswith(variant) and "us" in v}
            best = min(timed, key=lambda k: timed[k]["us"])
            base = timings["unfused"]["us"]
            lines.append(f"| {name} | {base:.1f} | {variant} | {best[len(variant) + 1:]} | "
                         f"{timed[best]['us']:.1f} | {timed[best]['us'] / base:.3f} |")
    res["table"] = "\n".join(lines)
    print(res["table"])
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "norm_matmul.json"), "w") as f:
        json.dump(res, f, indent=1)
    if misses:
        raise SystemExit("compiled kernel differs from its reference: " + "; ".join(misses))


if __name__ == "__main__":
    main()

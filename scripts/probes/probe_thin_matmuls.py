"""Probe: the decode step's weight matmuls at 8 rows, XLA against Pallas (Triton) GEMV kernels.

Whether a hand-written Pallas GEMV reads the weights as fast as XLA's matmuls at one stream's
8 padded rows: if it does, the small kernels around each matmul (norm, activation, residual
add, XLA's split-K reductions) can move into its prologue and epilogue without losing
bandwidth.

    PYTHONPATH=. python3 scripts/probes/probe_thin_matmuls.py all --out_dir DIR   # XLA and Pallas
    XLA_FLAGS=--xla_gpu_exhaustive_tiling_search=true \
        PYTHONPATH=. python3 scripts/probes/probe_thin_matmuls.py xla --out_dir DIR

Method: each shape is timed over NW distinct weight matrices (together well over L2) in one jit
whose output is the sum of the full products (so no column is dropped by the simplifier);
that jit is dispatched REPS times back to back, then one wait; time per matrix = wall /
(REPS * NW). Read-bandwidth ceiling measured in the same process the same way.
"""
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),   # the probes, scripts/
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from bench_common import back_to_back  # noqa: E402  (the probes' timing method)

M = 8
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
REPS = 20


def gemv(x, w, *, bn, bk, warps, stages, splits=1, transposed=False):
    """y = x @ w (w `[K, N]`) or x @ w.T (`transposed`: w `[N, K]`, K contiguous): one program
    per `bn` output columns, x padded to the 16 rows a tensor-core dot needs. With `splits` > 1
    a second grid axis splits K and XLA sums the float32 partials."""
    m, k = x.shape
    n = w.shape[0] if transposed else w.shape[1]
    mp = 16
    kc = k // splits
    xp = jnp.pad(x, ((0, mp - m), (0, 0)))

    def kernel(x_ref, w_ref, o_ref):
        first = pl.program_id(1) * kc if splits > 1 else 0

        def body(i, acc):
            k0 = pl.multiple_of(first + i * bk, bk)
            w_tile = w_ref[:, pl.ds(k0, bk)] if transposed else w_ref[pl.ds(k0, bk), :]
            return acc + plgpu.dot(x_ref[:, pl.ds(k0, bk)], w_tile, trans_b=transposed)
        acc = lax.fori_loop(0, kc // bk, body, jnp.zeros((mp, bn), jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)

    w_spec = (pl.BlockSpec((bn, k), lambda j, *_: (j, 0)) if transposed
              else pl.BlockSpec((k, bn), lambda j, *_: (0, j)))
    if splits > 1:
        grid, out_dtype = (n // bn, splits), jnp.float32
        out_spec = pl.BlockSpec((None, mp, bn), lambda j, s: (s, 0, j))
        out_shape = (splits, mp, n)
    else:
        grid, out_dtype = (n // bn,), x.dtype
        out_spec = pl.BlockSpec((mp, bn), lambda j: (0, j))
        out_shape = (mp, n)
    out = pl.pallas_call(
        kernel, grid=grid,
        in_specs=[pl.BlockSpec((mp, k), lambda j, *_: (0, 0)), w_spec],
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        name=f"gemv_{'nk' if transposed else 'kn'}_sk{splits}_{bn}_{bk}")(xp, w)
    if splits > 1:
        out = out.sum(0).astype(x.dtype)
    return out[:m]


def chain(f):
    @jax.jit
    def run(x, ws):
        acc = None
        for w in ws:
            y = f(x, w).astype(jnp.float32)
            acc = y if acc is None else acc + y
        return acc
    return run


def table(res: dict) -> str:
    """Markdown: per shape, XLA's time, the fastest Pallas variant, and XLA on the transposed layout."""
    lines = [f"Read ceiling (XLA sum, back to back): {res['read_tbps']:.2f} TB/s", "",
             "| matmul (K x N) | XLA us (TB/s) | fastest Pallas variant | us (TB/s) | XLA, W transposed, us |",
             "| --- | --- | --- | --- | --- |"]
    for name, rows in res["shapes"].items():
        k, n = SHAPES[name]
        xla = rows["xla_kn"]
        pallas = {lab: r for lab, r in rows.items() if lab.startswith("pl_") and "us" in r}
        best = min(pallas, key=lambda lab: pallas[lab]["us"]) if pallas else None
        nk = rows.get("xla_nk", {}).get("us")
        lines.append(f"| {name} ({k} x {n}) | {xla['us']:.1f} ({xla['tbps']:.2f}) | {best or '-'} | "
                     + (f"{pallas[best]['us']:.1f} ({pallas[best]['tbps']:.2f})" if best else "-")
                     + f" | {'-' if nk is None else f'{nk:.1f}'} |")
    return "\n".join(lines)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--out_dir")]
    out_dir = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--out_dir=")),
                   os.environ.get("OUT", "."))
    mode = args[0] if args else "all"
    res = {"flags": os.environ.get("XLA_FLAGS", ""), "mode": mode, "jax": jax.__version__,
           "device": jax.devices()[0].device_kind, "method": __doc__, "shapes": {}}
    n = 1 << 30
    a = jnp.ones((n,), jnp.bfloat16)
    t = back_to_back(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), a)
    res["read_tbps"] = 2 * n / t / 1e12
    t = back_to_back(jax.jit(lambda a: a + 1), a)
    res["copy_tbps"] = 4 * n / t / 1e12
    del a
    print("ceilings", res["read_tbps"], res["copy_tbps"], flush=True)
    key = jax.random.key(0)
    for name, (k, n_) in SHAPES.items():
        nbytes = k * n_ * 2
        nw = max(2, -(-int(2.0e8) // nbytes))
        ws = [(jax.random.normal(jax.random.fold_in(key, i), (k, n_), jnp.float32) * 0.02).astype(jnp.bfloat16)
              for i in range(nw)]
        x = jax.random.normal(key, (M, k), jnp.float32).astype(jnp.bfloat16)
        ref = chain(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
        want = ref(x, ws)
        out = {}

        def record(label, fn, args):
            try:
                got = fn(*args)
                err = float(jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-6))
                t = back_to_back(fn, *args) / nw
                out[label] = {"us": t * 1e6, "tbps": nbytes / t / 1e12, "rel_err": err}
            except Exception as e:  # noqa: BLE001
                out[label] = {"error": repr(e)[:200]}
            print(name, label, out[label], flush=True)

        record("xla_kn", ref, (x, ws))
        if mode == "all":
            for bn in (32, 64, 128):
                for bk in (64, 128, 256):
                    for st in (3, 5):
                        if n_ % bn == 0 and k % bk == 0 and bn * bk <= 16384:
                            record(f"pl_kn_bn{bn}_bk{bk}_s{st}", chain(functools.partial(
                                gemv, bn=bn, bk=bk, warps=4, stages=st)), (x, ws))
            for splits in (2, 4):
                for bn in (64, 128):
                    record(f"pl_kn_sk{splits}_bn{bn}_bk128_s4", chain(functools.partial(
                        gemv, bn=bn, bk=128, splits=splits, warps=4, stages=4)), (x, ws))
            wts = [jax.block_until_ready(jnp.array(w.T)) for w in ws]
            record("xla_nk", chain(lambda x, w: lax.dot_general(
                x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(x.dtype)), (x, wts))
            for bn in (16, 32, 64):
                for bk in (128, 256):
                    for st in (3, 5):
                        record(f"pl_nk_bn{bn}_bk{bk}_s{st}", chain(functools.partial(
                            gemv, bn=bn, bk=bk, warps=4, stages=st, transposed=True)), (x, wts))
            del wts
        res["shapes"][name] = out
        del ws
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"thin_matmuls_{mode}.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(table(res))


if __name__ == "__main__":
    main()

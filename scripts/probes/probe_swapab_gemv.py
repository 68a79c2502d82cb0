"""Probe: one stream's thin weight matmuls as a Mosaic GPU kernel with the weight as wgmma's A.

An earlier Mosaic GPU matmul (commit 985f98b, results/one_stream.md "Thin matmuls in Mosaic
GPU") gave wgmma the 8 activation rows as A, padded to the 64 rows wgmma's M takes, and the
weight as B: the tensor cores then do 8x the useful work, and with one warpgroup waiting on
each product the stream of weight copies stalls behind them. Here the product is turned
around, `y^T = W^T x^T`: the weight tile `[64 features, tile_k]` is A, the rows `[8, tile_k]`
are B (N = 8), and the accumulator `[64, 8]` is written as `y^T`. Each program owns 64
output features over the whole of K (no split-K reduction), and starts its weight copies
before `griddepcontrol.wait` (PDL).

    PYTHONPATH=. python3 scripts/probes/probe_swapab_gemv.py --out_dir DIR

Method as `probe_thin_matmuls.py`: each shape over distinct weights (well over L2), the sum of
the products returned, dispatched back to back; every variant checked against XLA's first.
"""
from __future__ import annotations

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),   # the probes, scripts/
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from bench_common import back_to_back  # noqa: E402
from probe_thin_matmuls import chain  # noqa: E402  (the same summed chain of products)
from pallas_kernels.paged_attention.mosaic_decode import (  # noqa: E402
    _plgpu, _tile_transforms, _transposed, interpret_params)

ROWS = 8
FEATURES = 64          # wgmma's M: output features per program
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "down": (14336, 4096), "gate_up": (4096, 28672)}


def _kernel(x_ref, w_ref, o_ref, x_smem, w_smem, o_smem, bars, *, tile_k: int, num_stages: int,
            splits: int, pdl: bool, interpret: bool):
    plgpu = _plgpu()
    j = lax.axis_index("n")
    s = lax.axis_index("s")
    steps = x_ref.shape[1] // tile_k // splits
    first_step = s * steps
    features = pl.ds(j * FEATURES, FEATURES)

    def issue_w(i, slot):
        plgpu.copy_gmem_to_smem(w_ref.at[features, pl.ds((first_step + i) * tile_k, tile_k)],
                                w_smem.at[slot], bars.at[slot])

    def issue_x(i, slot):
        plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds((first_step + i) * tile_k, tile_k)],
                                x_smem.at[slot], bars.at[slot])

    first = min(num_stages, steps)
    for i in range(first):                        # the weights need nothing from before
        issue_w(i, i)
    if pdl and not interpret:
        plgpu.griddepcontrol_wait()
    for i in range(first):
        issue_x(i, i)

    def refill(i, slot):
        @pl.when(i + num_stages < steps)
        def _():
            issue_w(i + num_stages, slot)
            issue_x(i + num_stages, slot)

    def run_steps(step, carry):
        groups, rest = divmod(steps, num_stages)

        def group(g, carry):
            for slot in range(num_stages):
                carry = step(g * num_stages + slot, slot, carry)
            return carry
        carry = lax.fori_loop(0, groups, group, carry)
        for slot in range(rest):
            carry = step(groups * num_stages + slot, slot, carry)
        return carry

    if interpret:
        def step(i, slot, acc):
            plgpu.barrier_wait(bars.at[slot])
            acc = acc + lax.dot_general(w_smem[slot], x_smem[slot], (((1,), (1,)), ((), ())),
                                        preferred_element_type=jnp.float32)
            refill(i, slot)
            return acc
        acc = run_steps(step, jnp.zeros((FEATURES, ROWS), jnp.float32))
    else:
        def compute(acc_ref):
            def step(i, slot, carry):
                plgpu.barrier_wait(bars.at[slot])
                plgpu.wgmma(acc_ref, w_smem.at[slot], _transposed(x_smem.at[slot]))
                plgpu.wgmma_wait(0)
                refill(i, slot)
                return carry
            run_steps(step, 0)
            return acc_ref[...]
        acc = pl.run_scoped(compute, plgpu.ACC((FEATURES, ROWS), jnp.float32))

    o_smem[...] = acc
    plgpu.commit_smem()
    if splits == 1:
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[features])
    else:
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[s, features])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("tile_k", "num_stages", "splits", "pdl", "interpret"))
def swapab_matmul_t(x: jax.Array, w_t: jax.Array, *, tile_k: int = 128, num_stages: int = 8,
                    splits: int = 1, pdl: bool = True, interpret: bool = False) -> jax.Array:
    """`(x [8, K] @ w_t [N, K].T).T` -> `[N, 8]` float32 (`[splits, N, 8]` partial sums with
    `splits` > 1)."""
    plgpu = _plgpu()
    rows, k = x.shape
    n = w_t.shape[0]
    assert rows == ROWS and n % FEATURES == 0 and k % (tile_k * splits) == 0, (x.shape, w_t.shape)
    tile = _tile_transforms(x.dtype)
    scratch = [plgpu.SMEM((num_stages, ROWS, tile_k), x.dtype, transforms=tile),
               plgpu.SMEM((num_stages, FEATURES, tile_k), w_t.dtype, transforms=tile),
               plgpu.SMEM((FEATURES, ROWS), jnp.float32),
               plgpu.Barrier(num_arrivals=2, num_barriers=num_stages)]
    out_shape = (n, ROWS) if splits == 1 else (splits, n, ROWS)
    kernel = functools.partial(_kernel, tile_k=tile_k, num_stages=num_stages, splits=splits,
                               pdl=pdl, interpret=interpret)
    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(out_shape, jnp.float32), scratch_types=scratch,
        grid=(n // FEATURES, splits), grid_names=("n", "s"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpret else None)
    return call(x, w_t)


def _rows_major(y_t: jax.Array) -> jax.Array:
    return (y_t if y_t.ndim == 2 else y_t.sum(0)).T


def main():
    out_dir = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--out_dir=")),
                   os.environ.get("OUT", "."))
    interpret = "--interpret" in sys.argv
    shapes = next((a.split("=", 1)[1].split(",") for a in sys.argv[1:]
                   if a.startswith("--shapes=")), list(SHAPES))
    res = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "shapes": {}}
    if not interpret:
        n = 1 << 30
        a = jnp.ones((n,), jnp.bfloat16)
        res["read_tbps"] = 2 * n / back_to_back(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), a) / 1e12
        del a
        print("read ceiling TB/s", round(res["read_tbps"], 2), flush=True)
    key = jax.random.key(0)
    for name in shapes:
        k, n_ = SHAPES[name]
        if interpret:
            k, n_ = 512, 128
        nbytes = k * n_ * 2
        nw = 2 if interpret else max(2, -(-int(2.0e8) // nbytes))
        ws = [(jax.random.normal(jax.random.fold_in(key, i), (k, n_), jnp.float32) * 0.02
               ).astype(jnp.bfloat16) for i in range(nw)]
        wts = [jax.block_until_ready(jnp.array(w.T)) for w in ws]
        x = jax.random.normal(key, (ROWS, k), jnp.float32).astype(jnp.bfloat16)
        ref = chain(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
        want = ref(x, ws)
        out = {}

        def record(label, fn, args):
            try:
                got = fn(*args)
                err = float(jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-6))
                if err > 2e-2:
                    raise AssertionError(f"relative error {err:.3g} against XLA")
                entry = {"rel_err": err}
                if not interpret:
                    t = back_to_back(fn, *args) / nw
                    entry.update(us=round(t * 1e6, 2), tbps=round(nbytes / t / 1e12, 3))
                out[label] = entry
            except Exception as e:  # noqa: BLE001
                out[label] = {"error": repr(e)[:400]}
            print(name, label, out[label], flush=True)

        if not interpret:
            record("xla", ref, (x, ws))
        variants = [(128, 8, 1, True), (128, 8, 1, False), (256, 4, 1, True), (128, 12, 1, True),
                    (64, 16, 1, True), (128, 8, 2, True)]
        if interpret:
            variants = [(128, 2, 1, True), (64, 3, 2, True)]
        for tile_k, stages, splits, pdl in variants:
            if k % (tile_k * splits):
                continue
            fn = functools.partial(swapab_matmul_t, tile_k=tile_k, num_stages=stages,
                                   splits=splits, pdl=pdl, interpret=interpret)
            record(f"swapab_k{tile_k}_s{stages}_split{splits}{'' if pdl else '_nopdl'}",
                   chain(lambda x, w, fn=fn: _rows_major(fn(x, w))), (x, wts))
        if not interpret:
            record("xla_again", ref, (x, ws))
        res["shapes"][name] = out
        del ws, wts
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "swapab_gemv.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

"""Thin matmul for one-stream decode in Pallas Mosaic GPU, launched early by PDL.

`y = x @ w` for a few rows of x (one stream's step: 1-8 tokens) against a weight stored
transposed, `w_t [N, K]` (K contiguous). At 8 rows a decode step's matmuls only stream their
weight from HBM; what they lose to the roofline is the first microsecond of each launch,
before the first bytes arrive, and XLA's split-K reduction kernel after three of the four.

Why it is shaped this way:
- Programmatic dependent launch (PDL): the kernel calls `griddepcontrol.wait` (which makes
  XLA launch it with PDL), so it may start while the kernel before it drains. Everything that
  does not depend on that kernel runs before the wait: zeroing the activation tiles and
  issuing the first `num_stages` weight copies. Only the activation copies wait.
- One CUDA block (one warpgroup) per `tile_n` output columns over the whole of K: no split-K,
  so no partial sums and no reduction kernel; `tile_n` is chosen so that N / tile_n is about
  the SM count (48 columns for q/k/v, 32 for o and down).
- wgmma needs 64 rows of A. The stages' x rows lie next to each other in one shared buffer
  (stage s at row s * rows) and stage s's A operand is the 64 rows from there: the rows past
  its own belong to later stages (or are padding), and their products land in output rows
  that are never stored. So the activation takes `rows` of shared memory per stage, not 64,
  and the room goes to more weight stages in flight. The weight tile `[tile_n, tile_k]`
  is wgmma's B operand read K-major, the layout tensor cores take without a transpose.

Mosaic GPU interprets on the CPU only from JAX 0.12 and cannot run wgmma there: in interpret
mode the product is a plain dot on the shared-memory tiles and PDL is left out, so the copies,
barriers and tiling are still the compiled kernel's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.paged_attention.mosaic_decode import (_cdiv, _plgpu, _tile_transforms,
                                                          _transposed, interpret_params)

WGMMA_ROWS = 64


def thin_matmul_reference(x: jax.Array, w_t: jax.Array) -> jax.Array:
    """`x @ w_t.T` in float32, rounded to x's dtype."""
    return jnp.dot(x.astype(jnp.float32), w_t.astype(jnp.float32).T).astype(x.dtype)


def unsupported(x: jax.Array, w_t: jax.Array, tile_n: int, tile_k: int) -> str:
    """Why the kernel cannot take these operands ("" when it can)."""
    m, k = x.shape
    n, k2 = w_t.shape
    if k != k2:
        return f"x has {k} columns, w_t {k2}"
    if x.dtype != w_t.dtype or jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16),
                                                          jnp.dtype(jnp.float16)):
        return f"dtypes {x.dtype} / {w_t.dtype} (both bfloat16 or both float16)"
    if m > WGMMA_ROWS:
        return f"{m} rows (at most {WGMMA_ROWS})"
    if tile_k % 64 or k % tile_k:
        return f"tile_k {tile_k} must be a multiple of 64 dividing K={k}"
    if tile_n % 8 or tile_n > 256 or n % tile_n:
        return f"tile_n {tile_n} must be a multiple of 8, at most 256, dividing N={n}"
    return ""


def _kernel(x_ref, w_ref, o_ref, x_smem, b_smem, o_smem, bars, free, *, rows: int, tile_n: int,
            tile_k: int, num_stages: int, pdl: bool, release_early: bool, interpret: bool,
            warp_specialized: bool):
    plgpu = _plgpu()
    j = lax.axis_index("n")
    steps = x_ref.shape[1] // tile_k
    columns = pl.ds(j * tile_n, tile_n)

    def issue_w(i, slot):
        plgpu.copy_gmem_to_smem(w_ref.at[columns, pl.ds(i * tile_k, tile_k)], b_smem.at[slot],
                                bars.at[slot])

    def issue_x(i, slot):
        plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(i * tile_k, tile_k)],
                                x_smem.at[pl.ds(slot * rows, rows)], bars.at[slot])

    def start():
        """Independent of the kernel before: start the weight stream. Then wait for the kernel
        before (PDL) and fetch the activation. (The activation buffer is never cleared: rows
        that no copy fills only reach output rows that are never stored.)"""
        for i in range(first):
            issue_w(i, i)
        if pdl and not interpret:
            plgpu.griddepcontrol_wait()
            if release_early:
                plgpu.griddepcontrol_launch_dependents()
        for i in range(first):
            issue_x(i, i)

    first = min(num_stages, steps)

    def refill(i, slot):
        if warp_specialized:       # the producer warpgroup refills
            plgpu.barrier_arrive(free.at[slot])
            return

        @pl.when(i + num_stages < steps)
        def _():
            issue_w(i + num_stages, slot)
            issue_x(i + num_stages, slot)

    def a_tile(slot):
        """Stage `slot`'s wgmma A operand: its x rows and the 64 - rows after them, whose
        products land in output rows that are never stored."""
        return x_smem.at[pl.ds(slot * rows, WGMMA_ROWS)]

    def run_steps(step, carry):
        """`carry = step(i, slot, carry)` for every K step, the loop unrolled over the stages
        so each stage's slices of shared memory are static."""
        groups, rest = divmod(steps, num_stages)

        def group(g, carry):
            for slot in range(num_stages):
                carry = step(g * num_stages + slot, slot, carry)
            return carry
        carry = lax.fori_loop(0, groups, group, carry)
        for slot in range(rest):
            carry = step(groups * num_stages + slot, slot, carry)
        return carry

    def consume():
        if interpret:
            def step(i, slot, acc):
                plgpu.barrier_wait(bars.at[slot])
                acc = acc + lax.dot_general(a_tile(slot)[...], b_smem[slot],
                                            (((1,), (1,)), ((), ())),
                                            preferred_element_type=jnp.float32)
                refill(i, slot)
                return acc
            acc = run_steps(step, jnp.zeros((WGMMA_ROWS, tile_n), jnp.float32))
        else:
            def compute(acc_ref):
                def step(i, slot, carry):
                    plgpu.barrier_wait(bars.at[slot])
                    plgpu.wgmma(acc_ref, a_tile(slot), _transposed(b_smem.at[slot]))
                    plgpu.wgmma_wait(0)
                    refill(i, slot)
                    return carry
                run_steps(step, 0)
                return acc_ref[...]
            acc = pl.run_scoped(compute, plgpu.ACC((WGMMA_ROWS, tile_n), jnp.float32))
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows)], o_ref.at[:, columns])
        plgpu.wait_smem_to_gmem(0)

    if not warp_specialized:
        start()
        consume()
        return

    wg = lax.axis_index("wg")

    @pl.when(wg == 1)
    def _producer():
        start()
        groups, rest = divmod(max(steps - num_stages, 0), num_stages)

        def refill_group(g, carry):
            for slot in range(num_stages):
                i = num_stages + g * num_stages + slot
                plgpu.barrier_wait(free.at[slot])
                issue_w(i, slot)
                issue_x(i, slot)
            return carry
        lax.fori_loop(0, groups, refill_group, 0)
        for slot in range(rest):
            i = num_stages + groups * num_stages + slot
            plgpu.barrier_wait(free.at[slot])
            issue_w(i, slot)
            issue_x(i, slot)

    @pl.when(wg == 0)
    def _consumer():
        consume()


@functools.partial(jax.jit, static_argnames=("tile_n", "tile_k", "num_stages", "pdl",
                                             "release_early", "warp_specialized", "interpret"))
def thin_matmul(x: jax.Array, w_t: jax.Array, *, tile_n: int, tile_k: int = 128,
                num_stages: int = 6, pdl: bool = True, release_early: bool = False,
                warp_specialized: bool = False, interpret: bool = False) -> jax.Array:
    """`x [m, K] @ w_t[N, K].T -> [m, N]` in x's dtype, for m <= 64 (see the module doc).

    `pdl`: wait for the kernel before with `griddepcontrol.wait` after the weight stream has
    started (XLA then launches this one early); `release_early`: also let the kernel after
    start early (only useful when that one waits too)."""
    why = unsupported(x, w_t, tile_n, tile_k)
    if why:
        raise ValueError(f"thin_matmul: {why}")
    plgpu = _plgpu()
    m, k = x.shape
    n = w_t.shape[0]
    rows = _cdiv(m, 8) * 8
    if rows != m:
        x = jnp.pad(x, ((0, rows - m), (0, 0)))
    tile = _tile_transforms(x.dtype)
    scratch = [
        # stage s's x rows at s * rows; each stage's A operand reads 64 rows from there
        plgpu.SMEM((num_stages * rows + WGMMA_ROWS - rows, tile_k), x.dtype, transforms=tile),
        plgpu.SMEM((num_stages, tile_n, tile_k), w_t.dtype, transforms=tile),
        plgpu.SMEM((WGMMA_ROWS, tile_n), x.dtype),
        plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),      # stage free (warp specialized)
    ]
    kernel = functools.partial(_kernel, rows=rows, tile_n=tile_n, tile_k=tile_k,
                               num_stages=num_stages, pdl=pdl, release_early=release_early,
                               interpret=interpret, warp_specialized=warp_specialized)
    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((rows, n), x.dtype), scratch_types=scratch,
        grid=(n // tile_n,), grid_names=("n",),
        **(dict(num_threads=2, thread_name="wg") if warp_specialized else {}),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpret else None)
    out = call(x, w_t)
    return out[:m] if rows != m else out

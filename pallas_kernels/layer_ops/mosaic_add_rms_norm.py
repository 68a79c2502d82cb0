"""Residual add + RMSNorm in Pallas Mosaic GPU (Hopper), launched early by XLA through PDL.

Same contract as `add_rms_norm.add_rms_norm` (Triton). Why a second kernel: at one stream
a decode layer runs two add + norm kernels of about 2.3 us each between XLA's matmuls, and
a Triton custom call takes no part in programmatic dependent launch (PDL), so each starts
only after the kernel before it has ended. A Mosaic GPU kernel that calls
`griddepcontrol.wait` is launched by XLA with PDL: it may start while the split-K reduction
before it drains, copy the norm's scale (which no kernel writes) meanwhile, and wait only
before it reads the rows.

One block per row; the row travels as a `[hidden / 128, 128]` box (TMA boxes hold at most
256 elements a side).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

LANES = 128


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu


def supported(hidden: int) -> bool:
    """Rows as `[hidden / 128, 128]` boxes: a multiple of 128, at most 256 boxes' rows."""
    return hidden % LANES == 0 and hidden // LANES <= 256


def _kernel(x_ref, r_ref, scale_ref, total_ref, normed_ref, x_smem, r_smem, s_smem, t_smem,
            n_smem, scale_bar, rows_bar, *, eps: float, hidden: int, pdl: bool,
            release: bool):
    plgpu = _plgpu()
    row = lax.axis_index("row")
    plgpu.copy_gmem_to_smem(scale_ref, s_smem, scale_bar.at[0])    # a weight: before the wait
    if pdl:
        plgpu.griddepcontrol_wait()                          # the rows: the kernel before
    if release:   # the next kernel may launch now; its own wait still orders its reads
        plgpu.griddepcontrol_launch_dependents()
    plgpu.copy_gmem_to_smem(x_ref.at[row], x_smem, rows_bar.at[0])
    if r_ref is not None:
        plgpu.copy_gmem_to_smem(r_ref.at[row], r_smem, rows_bar.at[0])
    plgpu.barrier_wait(rows_bar.at[0])
    total = x_smem[...]
    if r_ref is not None:
        total = (total.astype(jnp.float32) + r_smem[...].astype(jnp.float32)).astype(total.dtype)
        t_smem[...] = total
    tf = total.astype(jnp.float32)
    inv = lax.rsqrt(jnp.sum(tf * tf) / hidden + eps)
    plgpu.barrier_wait(scale_bar.at[0])
    n_smem[...] = (tf * inv * s_smem[...].astype(jnp.float32)).astype(n_smem.dtype)
    plgpu.commit_smem()
    if r_ref is not None:
        plgpu.copy_smem_to_gmem(t_smem, total_ref.at[row])
    plgpu.copy_smem_to_gmem(n_smem, normed_ref.at[row])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("eps", "pdl", "release", "interpret"))
def mosaic_add_rms_norm(x: jax.Array, residual: jax.Array | None, scale: jax.Array, *,
                        eps: float, pdl: bool = True, release: bool = True,
                        interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """`add_rms_norm_reference` as one Mosaic GPU launch (one block per row).

    x, residual: `[..., hidden]` (residual None: no add); scale: `[hidden]`; `hidden` a
    multiple of 128 (`supported`). `pdl`: wait for the kernel before with
    `griddepcontrol.wait`, which lets XLA launch this one early. `release`: let the kernel
    after this one launch once every block has started (`griddepcontrol.launch_dependents`).
    `interpret`: Mosaic GPU's
    CPU interpret mode (JAX >= 0.12; PDL off there).
    """
    from pallas_kernels.paged_attention.mosaic_decode import interpret_params
    plgpu = _plgpu()
    hidden = x.shape[-1]
    if not supported(hidden):
        raise ValueError(f"mosaic_add_rms_norm: hidden width {hidden} is not a multiple of "
                         f"{LANES} up to {256 * LANES}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"mosaic_add_rms_norm: residual {residual.shape} != x {x.shape}")
    lead = x.shape[:-1]
    box = (hidden // LANES, LANES)
    rows = x.reshape(-1, *box)
    n = rows.shape[0]
    has_residual = residual is not None
    normed_type = jax.ShapeDtypeStruct((n, *box), scale.dtype)
    out_type = ((jax.ShapeDtypeStruct((n, *box), x.dtype), normed_type) if has_residual
                else (normed_type,))
    scratch = [plgpu.SMEM(box, x.dtype), plgpu.SMEM(box, x.dtype), plgpu.SMEM(box, scale.dtype),
               plgpu.SMEM(box, x.dtype), plgpu.SMEM(box, scale.dtype),
               plgpu.Barrier(num_barriers=1),
               plgpu.Barrier(num_arrivals=1 + has_residual, num_barriers=1)]
    kernel = functools.partial(_kernel, eps=float(eps), hidden=hidden,
                               pdl=pdl and not interpret, release=release and not interpret)
    if has_residual:
        body = kernel
    else:
        def body(x_ref, scale_ref, normed_ref, *scr):
            kernel(x_ref, None, scale_ref, None, normed_ref, *scr)
    call = plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(n,),
                        grid_names=("row",),
                        interpret=interpret_params() if interpret else None)
    args = (rows, residual.reshape(-1, *box)) if has_residual else (rows,)
    outs = call(*args, scale.reshape(box))
    if not has_residual:
        return x, outs[0].reshape(*lead, hidden)
    total, normed = outs
    return total.reshape(*lead, hidden), normed.reshape(*lead, hidden)

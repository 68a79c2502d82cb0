"""The transposed weight layout of one-stream decoding, and the matmul that reads it.

At a few rows a decode step's matmuls only stream their weights; XLA's kernels lose the
first microsecond of each launch and add a split-K reduction kernel after three of a layer's
four. `pallas_kernels.layer_ops.mosaic_gemv.thin_matmul` starts its weight stream before the
kernel ahead of it has finished (programmatic dependent launch) and needs no reduction, but
it reads weights stored `[out, in]` (K contiguous, wgmma's B operand without a transpose).

`transpose_projections` stores a layer's four projection kernels that way, as `kernel_t`
(replacing `kernel`; fused q/k/v and gate/up, o and down). `project` then runs the thin
kernel for steps of at most `THIN_MAX_ROWS` tokens on a Hopper GPU and XLA's matmul on the
transposed operand otherwise (larger batches, the CPU, interpret mode).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Params = Any

THIN_MAX_ROWS = 16
# Per layer: the block holding each projection and the projections stored transposed.
TRANSPOSED: dict[str, tuple[str, ...]] = {"self_attn": ("qkv_proj", "o_proj"),
                                          "mlp": ("gate_up_proj", "down_proj")}
SM_COUNT = 132       # H100 / H200
TILE_K = 128
NUM_STAGES = 6
# Experiment knobs (`scripts/diagnose_variants.py` replaces them in a fresh process).
ENABLED = True       # transpose the weights where the thin kernel runs
PDL = True           # the kernel waits for the one before with griddepcontrol.wait
RELEASE_EARLY = False


def wanted(platform: str, tensor_parallel: bool) -> bool:
    """Whether an engine should serve from the transposed layout: one Hopper GPU whose JAX
    has the thin kernel (larger steps then run XLA's matmul on the same layout)."""
    return ENABLED and platform == "gpu" and not tensor_parallel and thin_kernel_available()


def is_transposed(params: Params) -> bool:
    """Whether `params` holds the projections as `kernel_t` (layer 0 decides)."""
    return "kernel_t" in params.get("layers_0", {}).get("self_attn", {}).get("qkv_proj", {})


def transpose_projections(params: Params) -> Params:
    """Fused 2-D layout -> the same tree with each projection's `kernel [in, out]` replaced
    by `kernel_t [out, in]`. One kernel at a time, so at most one extra copy is alive."""
    if is_transposed(params):
        return params
    out = dict(params)
    for name, layer in params.items():
        if not name.startswith("layers_"):
            continue
        layer = dict(layer)
        for block, projections in TRANSPOSED.items():
            sub = dict(layer[block])
            for proj in projections:
                kernel = sub[proj]["kernel"]
                if kernel.ndim != 2:
                    raise ValueError(f"{name}/{block}/{proj}: only the 2-D fused layout "
                                     f"transposes, got a kernel of shape {kernel.shape}")
                sub[proj] = {"kernel_t": _transpose(kernel)}
            layer[block] = sub
        out[name] = layer
    return out


@jax.jit
def _transpose(kernel: jax.Array) -> jax.Array:
    return kernel.T


# The fastest tiling of each Llama-3-8B projection on an H200 (`scripts/probe_pdl_gemv.py`).
MEASURED_TILINGS: dict[tuple[int, int], tuple[int, int, int]] = {
    (6144, 4096): (48, 128, 6), (4096, 4096): (32, 128, 6),
    (28672, 4096): (112, 64, 6), (4096, 14336): (32, 128, 6)}


def tiling(n: int, k: int) -> tuple[int, int, int] | None:
    """`(tile_n, tile_k, num_stages)` for an `[n, k]` weight: the measured one, else the
    widest multiple of 8 that divides n into at least the SM count of blocks (no split-K),
    or None when no tiling fits the kernel."""
    if (n, k) in MEASURED_TILINGS:
        return MEASURED_TILINGS[(n, k)]
    if k % TILE_K:
        return None
    for tile_n in range(64, 7, -8):
        if n % tile_n == 0 and n // tile_n >= SM_COUNT - 8:
            return tile_n, TILE_K, NUM_STAGES
    return None


def thin_kernel_available() -> bool:
    """Whether this process runs the thin Mosaic GPU kernel: a Hopper GPU with a JAX whose
    Mosaic GPU has programmatic dependent launch."""
    if jax.default_backend() != "gpu":
        return False
    cc = str(getattr(jax.devices()[0], "compute_capability", ""))
    if not cc.startswith("9"):
        return False
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError:
        return False
    return hasattr(plgpu, "griddepcontrol_wait")


def project(x: jax.Array, kernel_t: jax.Array, dtype: Any) -> jax.Array:
    """`x [..., in] @ kernel_t.T -> [..., out]` in `dtype`: the thin kernel for a few rows on
    Hopper, else XLA's matmul with the weight's contracting axis last."""
    x = x.astype(dtype)
    kernel_t = kernel_t.astype(dtype)
    lead = x.shape[:-1]
    rows = 1
    for d in lead:
        rows *= d
    n, k = kernel_t.shape
    tiles = tiling(n, k)
    if (rows <= THIN_MAX_ROWS and tiles is not None
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and thin_kernel_available()):
        from pallas_kernels.layer_ops.mosaic_gemv import thin_matmul
        tile_n, tile_k, stages, *ws = tiles
        y = thin_matmul(x.reshape(rows, k), kernel_t, tile_n=tile_n, tile_k=tile_k,
                        num_stages=stages, pdl=PDL, release_early=RELEASE_EARLY,
                        warp_specialized=bool(ws and ws[0]))
        return y.reshape(*lead, n)
    return jax.lax.dot_general(x, kernel_t, (((x.ndim - 1,), (1,)), ((), ())))

"""SwiGLU on the fused gate/up projection's output: `silu(gate) * up` in one pass.

XLA fuses this elementwise step by itself; the kernel exists so that, at one stream, the
launch between the gate/up and the down matmul can also warm L2 with the down projection's
weight (`l2_prefetch`), which an XLA fusion cannot do. Math as XLA runs the model's
`flax.linen.silu(gate) * up` = `gate * (1 / (1 + exp(-gate))) * up`: each operation in float32,
rounded to the activation dtype after it (only the exponential's own last bits differ).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.layer_ops import l2_prefetch

MAX_BLOCK = 2048


def swiglu_reference(gate_up: jax.Array) -> jax.Array:
    """`[..., 2 I]` (gate columns, then up columns) -> `[..., I]` (jnp)."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(gate) * up


def block_width(intermediate: int) -> int:
    """Columns per program: the largest power of two dividing the width, at most MAX_BLOCK."""
    return min(intermediate & -intermediate, MAX_BLOCK)


def _swiglu(gate_ref, up_ref, out_ref):
    dtype = out_ref.dtype
    rounded = lambda v: v.astype(dtype).astype(jnp.float32)
    g = gate_ref[...].astype(jnp.float32)
    sigmoid = rounded(1.0 / rounded(1.0 + rounded(jnp.exp(-g))))
    out_ref[...] = (rounded(g * sigmoid) * up_ref[...].astype(jnp.float32)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "prefetch_bytes"))
def swiglu(gate_up: jax.Array, *, interpret: bool = False, prefetch: jax.Array | None = None,
           prefetch_bytes: int = 0) -> jax.Array:
    """`swiglu_reference` as one Pallas launch (one program per row and column block).

    `prefetch`: the next matmul's weight, of which extra programs bring up to
    `prefetch_bytes` into L2 (`l2_prefetch`).
    """
    *lead, width = gate_up.shape
    if width % 2:
        raise ValueError(f"swiglu: the gate/up width {width} is not even")
    inter = width // 2
    rows = gate_up.reshape(-1, width)
    n = rows.shape[0]
    bw = block_width(inter)
    blocks = inter // bw
    work = n * blocks
    plan = l2_prefetch.kernel_plan(prefetch, prefetch_bytes, interpret, work)

    def at(i, half):
        i = jnp.minimum(i, work - 1)   # prefetch programs (i >= work) touch no block
        return i // blocks, half * blocks + i % blocks

    in_specs = [pl.BlockSpec((None, bw), lambda i: at(i, 0)),
                pl.BlockSpec((None, bw), lambda i: at(i, 1))]
    args = [rows, rows]
    if plan is not None:
        in_specs.insert(0, l2_prefetch.whole(prefetch))
        args.insert(0, prefetch)
    out = pl.pallas_call(
        l2_prefetch.with_prefetch_programs(_swiglu, work, plan),
        grid=(work + l2_prefetch.extra_rows(plan),),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bw), lambda i: at(i, 0)),
        out_shape=jax.ShapeDtypeStruct((n, inter), gate_up.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="paxkv_swiglu",
    )(*args)
    return out.reshape(*lead, inter)

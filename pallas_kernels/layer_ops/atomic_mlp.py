"""A decode step's whole SwiGLU MLP as one kernel: `down(silu(gate(x)) * up(x))`, float32 out.

At one stream XLA runs the MLP as four kernels: the gate/up matmul, the activation, the down
matmul split over K, and that split's reduction; two of them are matmuls that each ramp up
and drain their weight stream, two are latency-bound launches. Here program j owns the
intermediate features `[j * tile, (j + 1) * tile)`: it reads those gate and up columns over
all of K, applies SwiGLU in registers, multiplies the result by the same rows of the down
weight and adds its share of every output into a zeroed float32 buffer with atomic adds. No
program waits for another, so one weight stream runs from the first gate column to the last
down row. The price: atomics, and an output whose float rounding order, hence last bits,
varies from run to run on a GPU (interpret mode adds in program order).

Rounding follows the unfused network: gate and up are rounded to the activation dtype, the
activation and product are formed in float32 and rounded once, the down product accumulates
in float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention.paging import is_power_of_two

TILE_ROWS = 16   # the fewest rows a tensor-core dot takes; steps of more rows do not fit


def swiglu_mlp_reference(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """x `[R, hidden]`, w_gate_up `[hidden, 2 * inter]` (gate columns first), w_down
    `[inter, hidden]` -> `[R, hidden]` float32."""
    inter = w_down.shape[0]
    gate_up = jnp.dot(x, w_gate_up, preferred_element_type=jnp.float32).astype(x.dtype)
    gate = gate_up[:, :inter].astype(jnp.float32)
    up = gate_up[:, inter:].astype(jnp.float32)
    h = (gate * jax.nn.sigmoid(gate) * up).astype(x.dtype)
    return jnp.dot(h, w_down, preferred_element_type=jnp.float32)


def _pow2_tile(n: int, most: int) -> int:
    """The largest power of two that divides n, at most `most` (0 below a dot's 16)."""
    tile = most
    while tile >= 16 and n % tile:
        tile //= 2
    return tile if tile >= 16 else 0


def default_tiles(hidden: int, inter: int) -> tuple[int, int, int]:
    """(tile_inter, block_k, block_n): 128 intermediate features per program (112 programs
    at Llama-3-8B), 64-deep gate/up steps, 128-wide down steps; smaller powers of two where
    the axes need them, 0 where none fits."""
    return _pow2_tile(inter, 128), _pow2_tile(hidden, 64), _pow2_tile(hidden, 128)


def supported(rows: int, hidden: int, inter: int) -> bool:
    """Shapes the kernel takes at its default tiles: at most `TILE_ROWS` rows, axes that
    power-of-two tiles of at least 16 divide."""
    return rows <= TILE_ROWS and all(default_tiles(hidden, inter))


def swiglu_tile(x_ref, gate_ref, up_ref, *, block_k: int) -> jax.Array:
    """SwiGLU of the intermediate features whose gate and up columns `gate_ref` and `up_ref`
    hold (`[hidden, tile]` each), for all `TILE_ROWS` rows of `x_ref`, in x's dtype."""
    hidden, tile_inter = gate_ref.shape

    def step(i, carry):
        gate, up = carry
        k0 = pl.multiple_of(i * block_k, block_k)
        x = x_ref[:, pl.ds(k0, block_k)]
        gate = gate + plgpu.dot(x, gate_ref[pl.ds(k0, block_k), :])
        up = up + plgpu.dot(x, up_ref[pl.ds(k0, block_k), :])
        return gate, up

    zeros = jnp.zeros((TILE_ROWS, tile_inter), jnp.float32)
    gate, up = lax.fori_loop(0, hidden // block_k, step, (zeros, zeros))
    gate = gate.astype(x_ref.dtype).astype(jnp.float32)
    up = up.astype(x_ref.dtype).astype(jnp.float32)
    return (gate * jax.nn.sigmoid(gate) * up).astype(x_ref.dtype)


def _kernel(x_ref, gate_ref, up_ref, down_ref, _, out_ref, *, rows: int, block_k: int,
            block_n: int, interpret: bool):
    hidden = x_ref.shape[1]
    h = swiglu_tile(x_ref, gate_ref, up_ref, block_k=block_k)
    r = jnp.arange(TILE_ROWS, dtype=jnp.int32)[:, None]
    row_mask = jnp.broadcast_to(r < rows, (TILE_ROWS, block_n))

    def down_step(n, carry):
        n0 = pl.multiple_of(n * block_n, block_n)
        part = plgpu.dot(h, down_ref[:, pl.ds(n0, block_n)])
        cols = n0 + jnp.arange(block_n, dtype=jnp.int32)[None, :]
        if interpret:   # interpret mode has no masked atomics: the padding rows add zeros
            plgpu.atomic_add(out_ref, (r, cols), jnp.where(row_mask, part, 0.0))
        else:
            plgpu.atomic_add(out_ref, (r, cols), part, mask=row_mask)
        return carry

    lax.fori_loop(0, hidden // block_n, down_step, 0)


@functools.partial(jax.jit, static_argnames=("tile_inter", "block_k", "block_n", "num_warps",
                                             "num_stages", "added_rows", "interpret"))
def swiglu_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, *,
               tile_inter: int | None = None, block_k: int | None = None,
               block_n: int | None = None, num_warps: int = 4, num_stages: int = 3,
               added_rows: int | None = None, interpret: bool = False) -> jax.Array:
    """`swiglu_mlp_reference` as one Pallas launch of `inter / tile_inter` programs.

    `block_k`: the gate/up loop's step over the hidden axis; `block_n`: the down loop's step
    over the output columns; None: `default_tiles`. `added_rows`: only the first rows'
    products are added (the others come out 0), to measure what the atomics cost. Rows at
    most `TILE_ROWS`, tiles powers of two that divide their axes (ValueError otherwise).
    """
    rows, hidden = x.shape
    inter = w_down.shape[0]
    if w_gate_up.shape != (hidden, 2 * inter) or w_down.shape != (inter, hidden):
        raise ValueError(f"swiglu_mlp: w_gate_up {w_gate_up.shape} and w_down {w_down.shape} do "
                         f"not fit x {x.shape}")
    defaults = default_tiles(hidden, inter)
    tile_inter, block_k, block_n = (given or default for given, default in
                                    zip((tile_inter, block_k, block_n), defaults))
    fits = all(t >= 16 and is_power_of_two(t) for t in (tile_inter, block_k, block_n))
    if (rows > TILE_ROWS or not fits or inter % tile_inter or hidden % block_k
            or hidden % block_n):
        raise ValueError(f"swiglu_mlp: rows {rows} (at most {TILE_ROWS}), hidden {hidden}, "
                         f"intermediate {inter}: tiles {tile_inter}/{block_k}/{block_n} must be "
                         f"powers of two >= 16 that divide their axes")
    tiles = inter // tile_inter
    padded = jnp.pad(x, ((0, TILE_ROWS - rows), (0, 0)))
    zeros = jnp.zeros((TILE_ROWS, hidden), jnp.float32)
    whole = lambda j: (0, 0)   # noqa: E731
    out = pl.pallas_call(
        functools.partial(_kernel, rows=rows if added_rows is None else min(added_rows, rows),
                          block_k=block_k, block_n=block_n,
                          interpret=interpret),
        grid=(tiles,),
        in_specs=[pl.BlockSpec((TILE_ROWS, hidden), whole),
                  pl.BlockSpec((hidden, tile_inter), lambda j: (0, j)),
                  pl.BlockSpec((hidden, tile_inter), lambda j: (0, j + tiles)),
                  pl.BlockSpec((tile_inter, hidden), lambda j: (j, 0)),
                  pl.BlockSpec((TILE_ROWS, hidden), whole)],
        out_specs=pl.BlockSpec((TILE_ROWS, hidden), whole),
        out_shape=jax.ShapeDtypeStruct((TILE_ROWS, hidden), jnp.float32),
        input_output_aliases={4: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paxkv_swiglu_mlp_t{tile_inter}",
    )(padded, w_gate_up, w_gate_up, w_down, zeros)
    return out[:rows]

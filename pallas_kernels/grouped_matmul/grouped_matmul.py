"""The MoE grouped matmul: rows sorted into runs, one expert's weight matrix per run.

`x [M, K]` holds the (token, expert) pairs of a MoE layer sorted by expert, so expert e owns
the `group_sizes[e]` consecutive rows after the runs of experts 0..e-1. Each run is multiplied
by `weights[e] [K, N]`. XLA's `ragged_dot` reads every expert's weights whatever the routing
chose (311 us for Mixtral's up-projection at one token against an 80 us floor for the two it
needs, issue #54), so a decode step of a small batch pays for all of them.

Here the work is a list of row tiles: a run of n rows becomes `cdiv(n, block_m)` tiles of
its expert, and an expert with no rows has none. One program computes one tile times one
`block_n` column block of its expert's matrix, looping over K in `block_k` steps with float32
accumulation. Only the experts that own rows are read, and the tile list is built on the
device from `group_sizes` (no host sync): its static length is the most tiles any routing
can need, `cdiv(M, block_m) + E`, and programs past the real count return at once.

Every load and store indexes with arrays on every axis (row and column index vectors), the
form that lowers to Triton pointer tensors and also runs in interpret mode.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.arith import cdiv
from pallas_kernels.paged_attention.paging import is_power_of_two


def grouped_matmul_reference(x: jax.Array, weights: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """jnp: each row times its run's expert matrix, float32 accumulation, -> x's dtype.
    Rows past `sum(group_sizes)` are 0."""
    m = x.shape[0]
    ends = jnp.cumsum(group_sizes)
    expert = jnp.searchsorted(ends, jnp.arange(m), side="right")        # E past the runs
    out = jnp.zeros((m, weights.shape[-1]), jnp.float32)
    for e in range(weights.shape[0]):
        part = jnp.dot(x, weights[e], preferred_element_type=jnp.float32)
        out = jnp.where((expert == e)[:, None], part, out)
    return out.astype(x.dtype)


def tile_list(group_sizes: jax.Array, num_rows: int, block_m: int
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Row tiles of the runs -> (expert, first row, end row) per tile, each `[cdiv(M, bm) + E]`;
    tiles past the real count have end == first (no rows)."""
    e = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    run_start = jnp.cumsum(sizes) - sizes
    tiles = (sizes + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles)                      # exclusive end of each expert's tiles
    n = cdiv(num_rows, block_m) + e
    t = jnp.arange(n, dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), e - 1).astype(jnp.int32)
    j = t - (tile_end[expert] - tiles[expert])       # the tile's index within its run
    first = run_start[expert] + j * block_m
    end = jnp.minimum(first + block_m, run_start[expert] + sizes[expert])
    live = t < tile_end[-1]
    return expert, jnp.where(live, first, 0), jnp.where(live, end, 0)


def _kernel(expert_ref, first_ref, end_ref, x_ref, w_ref, o_ref, *, block_m: int,
            block_n: int, block_k: int, k_dim: int, n_dim: int):
    t, nb = pl.program_id(0), pl.program_id(1)
    first, end = first_ref[t], end_ref[t]

    @pl.when(end > first)
    def _():
        e = expert_ref[t]
        rows = first + jnp.arange(block_m, dtype=jnp.int32)    # distinct: stores mask them
        row_ok = rows < end
        rows_in = jnp.where(row_ok, rows, first)              # masked rows read a real row
        cols = nb * block_n + jnp.arange(block_n, dtype=jnp.int32)
        col_ok = cols < n_dim
        cols_in = jnp.where(col_ok, cols, 0)
        ks = jnp.arange(block_k, dtype=jnp.int32)

        def step(i, acc):
            kk = i * block_k + ks
            xs = plgpu.load(x_ref.at[rows_in[:, None], kk[None, :]])
            ws = plgpu.load(w_ref.at[e, kk[:, None], cols_in[None, :]])
            return acc + lax.dot_general(xs, ws, (((1,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, k_dim // block_k, step,
                            jnp.zeros((block_m, block_n), jnp.float32))
        plgpu.store(o_ref.at[rows[:, None], cols[None, :]], acc.astype(o_ref.dtype),
                    mask=row_ok[:, None] & col_ok[None, :])


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def grouped_matmul(x: jax.Array, weights: jax.Array, group_sizes: jax.Array, *,
                   block_m: int = 16, block_n: int = 128, block_k: int = 64,
                   num_warps: int = 4, num_stages: int = 4,
                   interpret: bool = False) -> jax.Array:
    """`x [M, K]` rows sorted by expert, `weights [E, K, N]`, `group_sizes [E]` int ->
    `[M, N]` in x's dtype (float32 accumulation), rows past `sum(group_sizes)` 0.

    Tiles: `block_m` rows (>= 16, a power of two), `block_n` columns, `block_k`-deep steps
    (K must be a multiple). Only experts with rows have their weights read.
    """
    m, k_dim = x.shape
    e, wk, n_dim = weights.shape
    if wk != k_dim:
        raise ValueError(f"grouped_matmul: x has K={k_dim} but weights are {weights.shape}")
    if group_sizes.shape != (e,):
        raise ValueError(f"grouped_matmul: group_sizes must be [{e}], got {group_sizes.shape}")
    for name, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if not is_power_of_two(v) or v < 16:
            raise ValueError(f"grouped_matmul: {name} must be a power of two >= 16, got {v}")
    if k_dim % block_k:
        raise ValueError(f"grouped_matmul: K={k_dim} is not a multiple of block_k={block_k}")
    expert, first, end = tile_list(group_sizes, m, block_m)
    num_tiles = expert.shape[0]
    out = pl.pallas_call(
        functools.partial(_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                          k_dim=k_dim, n_dim=n_dim),
        grid=(num_tiles, cdiv(n_dim, block_n)),
        in_specs=[pl.BlockSpec((num_tiles,), lambda t, n: (0,))] * 3 + [
            pl.BlockSpec((m, k_dim), lambda t, n: (0, 0)),
            pl.BlockSpec((e, k_dim, n_dim), lambda t, n: (0, 0, 0))],
        out_specs=pl.BlockSpec((m, n_dim), lambda t, n: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, n_dim), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="paxkv_grouped_matmul",
    )(expert, first, end, x, weights)
    # Rows past the runs are never written by a program: give them the reference's zeros.
    live = jnp.arange(m) < jnp.sum(group_sizes)
    return jnp.where(live[:, None], out, jnp.zeros((), out.dtype))

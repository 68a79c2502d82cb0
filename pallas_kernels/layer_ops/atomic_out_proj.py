"""Split decode attention's combine and the o projection as one kernel, float32 out.

Split-K decode attention leaves per (row, split, query head) a normalized partial output and
its base-2 log-sum-exp. At one stream XLA then runs the combine kernel, the o matmul split
over K and that split's reduction: three launches around 33.5 MB of weight at Llama-3-8B.
Here program (h, c) merges query head h's splits for every row in registers, multiplies the
merged `[rows, head_dim]` by the head's `head_dim` rows of `w_o` over output chunk c, and adds
the product into a zeroed float32 output with atomic adds (one add per head per element). As
with `atomic_mlp`, the float rounding order of those adds varies from run to run on a GPU.

Rounding follows the unfused path: the merged attention output is rounded to the weight's
dtype before the product, which accumulates in float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.layer_ops.atomic_mlp import TILE_ROWS
from pallas_kernels.paged_attention.combine import combine_splits
from pallas_kernels.paged_attention.paging import is_power_of_two

PROGRAMS = 128   # about one per SM of an H100/H200


def merge_out_proj_reference(o_part: jax.Array, lse: jax.Array, w_o: jax.Array) -> jax.Array:
    """o_part `[R, S, Hq, d]` float32, lse `[R, S, Hq]` base 2, w_o `[Hq * d, hidden]` ->
    `[R, hidden]` float32."""
    rows, _, heads, head_dim = o_part.shape
    attn = combine_splits(o_part, lse).astype(w_o.dtype).reshape(rows, heads * head_dim)
    return jnp.dot(attn, w_o, preferred_element_type=jnp.float32)


def default_tiles(heads: int, hidden: int) -> tuple[int, int]:
    """(chunks, block_n): output chunks per head so about `PROGRAMS` programs run, each
    stepping 128 columns (less where the hidden width needs it); (0, 0) where no
    power-of-two step of at least 16 divides the width."""
    block_n = 128
    while block_n >= 16 and hidden % block_n:
        block_n //= 2
    if block_n < 16:
        return 0, 0
    chunks = 1
    while heads * chunks * 2 <= PROGRAMS and hidden % (chunks * 2 * block_n) == 0:
        chunks *= 2
    return chunks, block_n


def supported(rows: int, heads: int, head_dim: int, hidden: int) -> bool:
    """At most `TILE_ROWS` rows, a power-of-two head_dim of at least 16, a hidden width the
    default tiles divide."""
    return (rows <= TILE_ROWS and head_dim >= 16 and is_power_of_two(head_dim)
            and all(default_tiles(heads, hidden)))


def _kernel(lse_ref, part_ref, w_ref, _, out_ref, *, rows: int, num_splits: int, width: int,
            block_n: int, interpret: bool):
    head_dim = w_ref.shape[0]
    r = jnp.arange(TILE_ROWS, dtype=jnp.int32)[:, None]
    d = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    in_rows = r < rows
    # the merge of `combine.combine_splits` (empty splits: lse -inf, weight 0)
    lses = [plgpu.load(lse_ref.at[r[:, 0], s], mask=in_rows[:, 0], other=-jnp.inf)
            for s in range(num_splits)]
    top = functools.reduce(jnp.maximum, lses)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    num = den = None
    for s in range(num_splits):
        weight = jnp.exp2(lses[s] - top)
        part = plgpu.load(part_ref.at[r, s, d], mask=jnp.broadcast_to(in_rows, (TILE_ROWS, head_dim)),
                          other=0.0) * weight[:, None]
        num = part if num is None else num + part
        den = weight if den is None else den + weight
    attn = (num / jnp.where(den > 0, den, 1.0)[:, None]).astype(w_ref.dtype)

    row_mask = jnp.broadcast_to(in_rows, (TILE_ROWS, block_n))
    first = pl.program_id(1) * width

    def step(n, carry):
        n0 = pl.multiple_of(n * block_n, block_n)
        prod = plgpu.dot(attn, w_ref[:, pl.ds(n0, block_n)])
        cols = first + n0 + jnp.arange(block_n, dtype=jnp.int32)[None, :]
        if interpret:   # interpret mode has no masked atomics: the padding rows add zeros
            plgpu.atomic_add(out_ref, (r, cols), jnp.where(row_mask, prod, 0.0))
        else:
            plgpu.atomic_add(out_ref, (r, cols), prod, mask=row_mask)
        return carry

    lax.fori_loop(0, width // block_n, step, 0)


@functools.partial(jax.jit, static_argnames=("chunks", "block_n", "num_warps", "num_stages",
                                             "interpret"))
def merge_out_proj(o_part: jax.Array, lse: jax.Array, w_o: jax.Array, *,
                   chunks: int | None = None, block_n: int | None = None, num_warps: int = 4,
                   num_stages: int = 3, interpret: bool = False) -> jax.Array:
    """`merge_out_proj_reference` as one Pallas launch of `heads * chunks` programs.

    `chunks`: output chunks per head; `block_n`: the loop's step over a chunk's columns;
    None: `default_tiles`. Rows at most `TILE_ROWS`; shapes as `supported` requires
    (ValueError otherwise).
    """
    rows, num_splits, heads, head_dim = o_part.shape
    hidden = w_o.shape[1]
    if lse.shape != (rows, num_splits, heads) or w_o.shape[0] != heads * head_dim:
        raise ValueError(f"merge_out_proj: o_part {o_part.shape}, lse {lse.shape} and w_o "
                         f"{w_o.shape} do not fit")
    default_chunks, default_block_n = default_tiles(heads, hidden)
    chunks, block_n = chunks or default_chunks, block_n or default_block_n
    if (rows > TILE_ROWS or not supported(rows, heads, head_dim, hidden) or chunks < 1
            or hidden % (chunks * block_n) or not is_power_of_two(block_n) or block_n < 16):
        raise ValueError(f"merge_out_proj: rows {rows} (at most {TILE_ROWS}), head_dim "
                         f"{head_dim}, hidden {hidden}: chunks {chunks} x block_n {block_n} must "
                         f"divide the width in power-of-two steps >= 16")
    width = hidden // chunks
    zeros = jnp.zeros((TILE_ROWS, hidden), jnp.float32)
    whole = lambda h, c: (0, 0)   # noqa: E731
    out = pl.pallas_call(
        functools.partial(_kernel, rows=rows, num_splits=num_splits, width=width,
                          block_n=block_n, interpret=interpret),
        grid=(heads, chunks),
        in_specs=[pl.BlockSpec((rows, num_splits, None), lambda h, c: (0, 0, h)),
                  pl.BlockSpec((rows, num_splits, None, head_dim), lambda h, c: (0, 0, h, 0)),
                  pl.BlockSpec((head_dim, width), lambda h, c: (h, c)),
                  pl.BlockSpec((TILE_ROWS, hidden), whole)],
        out_specs=pl.BlockSpec((TILE_ROWS, hidden), whole),
        out_shape=jax.ShapeDtypeStruct((TILE_ROWS, hidden), jnp.float32),
        input_output_aliases={3: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paxkv_merge_out_proj_c{chunks}",
    )(lse.astype(jnp.float32), o_part.astype(jnp.float32), w_o, zeros)
    return out[:rows]

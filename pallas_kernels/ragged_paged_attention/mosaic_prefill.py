"""Ragged paged attention (prefill, chunked prefill, mixed) for Hopper in Pallas Mosaic GPU.

Same contract as the Triton kernel in `ragged_paged_attention.py` for bf16 / fp16 pages in
the blocks-first layout; `ragged_paged_attention(..., backend="mosaic")` reaches it.

Structure: `_prefill_kernel` (one CUDA block = one 64-row query tile of one sequence x one KV
head; a producer warpgroup beside it when warp specialized) -> `_consume` (the compute
warpgroup) -> `prefill` (work list, query tiles in, output rows back, scratch, grid).

Why it is shaped this way:
- Work list as in the Triton kernel (`build_work_list`): tiles never straddle two sequences,
  padding tokens form one pseudo-sequence with no keys (its rows come out zero). A jnp
  prologue resolves each item to three numbers, its sequence, the position of its first
  query and the keys it may see (`kv_end`), so the kernel does no ragged arithmetic.
- GQA packing as in the Triton kernel: a tile's rows are `block_q` tokens x the `group`
  query heads of one KV head (row = token * group + head), `block_q = 64 // group`, so the
  64 rows are wgmma's M and each K/V page is read once per tile.
- The query tiles are gathered by XLA into `[items, kv_heads, 64, d]` before the kernel and
  the output rows scattered back after it: every TMA box is then whole and in bounds, and no
  block writes rows of another sequence's tile. It costs one extra pass over q and over the
  output, small against the causal products of a prefill; reading q by TMA straight from
  `[T, q_heads, d]` (a `[block_q, group, d]` box) is the obvious next step once measured.
- Pages arrive by TMA as in the decode kernel (`mosaic_decode`): each loop step copies
  `pages_per_compute_block` pages of the KV head (`[block_size, d]` boxes) into one swizzled
  stage of K and of V, `num_stages` steps ahead; optionally a producer warpgroup issues them.
- `S = Q K^T` and `O += P V` are wgmma with fp32 accumulators; base-2 online softmax.
- Two loops, as in the Triton kernel: key blocks entirely at or before the tile's first
  query need no mask; only the causal diagonal (one or two blocks) is masked, and there V
  rows past `kv_end` are zeroed in shared memory (stale or non-finite bytes would otherwise
  turn `0 * NaN` into NaN in the PV product). Masked rows that see no key yet are guarded.

Not measured on an H200 yet, so `backend="auto"` keeps Triton (`tuning.PREFILL_WINNERS` is
empty). 8-bit pages are not supported (`unsupported` says so; auto takes Triton).

On the CPU (JAX >= 0.12 interpret mode, which cannot run wgmma) the two products are plain
dots on the shared-memory tiles, as in the decode kernel; copies, barriers and masks are the
compiled kernel's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.arith import cdiv
from pallas_kernels.paged_attention import mosaic_decode
from pallas_kernels.ragged_paged_attention.work_list import build_work_list
from pallas_kernels.paged_attention.mosaic_decode import (
    LOG2E,
    Q_TILE_ROWS,
    _page_copier,
    _pipeline_scratch,
    _plgpu,
    _run_pipeline,
    _tile_ops,
    interpret_params,
)

WARP_SPECIALIZED = mosaic_decode.WARP_SPECIALIZED


def default_block_q(group: int) -> int:
    """Query tokens per tile: as many as fill the 64 wgmma rows."""
    return max(1, Q_TILE_ROWS // group)


def default_pages_per_compute_block(block_size: int, head_dim: int) -> int:
    """Pages per key block: 128 tokens (a multiple of wgmma's 64), 64 above head_dim 128
    (two stages of 128 x 256 K and V tiles would not fit beside the query and output tiles,
    and the logits and the accumulator would not fit the registers); at least one page."""
    return max(1, (128 if head_dim <= 128 else 64) // block_size)


def fit_num_stages(requested: int | None, block_k: int, head_dim: int, itemsize: int) -> int:
    """Pipeline depth: `requested`, else 2, lowered until the K/V stages and the query and
    output tiles (both in the pages' dtype) fit `mosaic_decode.SHARED_MEMORY_BUDGET`."""
    if requested is not None:
        return requested
    fixed = 2 * Q_TILE_ROWS * head_dim * itemsize
    stages = 2
    while (stages > 1 and stages * 2 * block_k * head_dim * itemsize + fixed
           > mosaic_decode.SHARED_MEMORY_BUDGET):
        stages -= 1
    return stages


def unsupported(q, k_pages, k_scale, pages_per_compute_block: int, block_q: int | None,
                interpret: bool) -> str:
    """Why this kernel cannot take these inputs ("" when it can)."""
    group = q.shape[1] // k_pages.shape[2]
    if block_q is not None and not 1 <= block_q * group <= Q_TILE_ROWS:
        return (f"block_q {block_q} x group {group} rows (1..{Q_TILE_ROWS}: one wgmma tile; "
                f"default {default_block_q(group)})")
    return mosaic_decode.unsupported(q, k_pages, k_scale, "blocks_first",
                                     pages_per_compute_block, interpret)


def _prefill_kernel(seq_ref, pos_ref, end_ref, table_ref, q_ref, k_ref, v_ref, o_ref, q_smem,
                    k_smem, v_smem, o_smem, q_bar, k_bar, v_bar, k_free, v_free, *,
                    block_size: int, pages_per_compute_block: int, num_stages: int, group: int,
                    scale: float, warp_specialized: bool, interpret: bool):
    w = lax.axis_index("w")
    h = lax.axis_index("h")
    ppcb = pages_per_compute_block
    block_k = block_size * ppcb
    seq = seq_ref[w]
    first_pos = pos_ref[w]                 # position of the tile's first query
    kv_end = end_ref[w]                    # keys [0, kv_end) may be visible
    width = table_ref.shape[1]
    num_iters = cdiv(kv_end, block_k)
    num_full = jnp.clip(first_pos + 1, 0, kv_end) // block_k

    def page_ids(step):
        """Pool pages of loop step `step` (clamped into the table: a step past the end is
        never issued, but its ids may be read early)."""
        return [table_ref[seq, jnp.minimum(step * ppcb + j, width - 1)] for j in range(ppcb)]

    issue = _page_copier(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, h, block_size)
    consume = functools.partial(
        _consume, w, h, first_pos, kv_end, num_iters, num_full, page_ids, issue, q_ref, o_ref,
        q_smem, k_smem, v_smem, o_smem, q_bar, k_bar, v_bar, block_k=block_k,
        num_stages=num_stages, group=group, scale=scale, interpret=interpret)
    _run_pipeline(consume, issue, page_ids, k_free, v_free, num_stages=num_stages,
                  num_iters=num_iters, warp_specialized=warp_specialized)


def _consume(w, h, first_pos, kv_end, num_iters, num_full, page_ids, issue, q_ref, o_ref,
             q_smem, k_smem, v_smem, o_smem, q_bar, k_bar, v_bar, k_free, v_free, *,
             block_k: int, num_stages: int, group: int, scale: float, interpret: bool):
    """The compute warpgroup: online softmax over the tile's key blocks, then the output.

    Without a producer warpgroup (`k_free is None`) it also refills each stage itself once
    both products have read it."""
    plgpu = _plgpu()
    head_dim = q_smem.shape[-1]
    dtype = q_smem.dtype
    producer = k_free is not None

    plgpu.copy_gmem_to_smem(q_ref.at[w, h], q_smem, q_bar.at[0])
    plgpu.barrier_wait(q_bar.at[0])
    qk_scale = scale * LOG2E
    logits, add_pv, iota, init = _tile_ops(q_smem, k_smem, v_smem, block_k, interpret)

    def step(i, carry, masked: bool):
        acc, m, l = carry
        slot = lax.rem(i, num_stages)
        if not producer:
            next_pages = page_ids(i + num_stages)
        plgpu.barrier_wait(k_bar.at[slot])
        x = logits(slot) * qk_scale
        if producer:
            plgpu.barrier_arrive(k_free.at[slot])
        start = i * block_k
        if masked:                                       # the causal diagonal
            shape = (Q_TILE_ROWS, block_k)
            k_pos = iota(shape, 1) + start
            q_pos = lax.div(iota(shape, 0), jnp.int32(group)) + first_pos
            x = jnp.where((k_pos <= q_pos) & (k_pos < kv_end), x, -jnp.inf)
        m_new = jnp.maximum(m, x.max(axis=1))
        if masked:                                       # a row may see no key yet
            m_new = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(x - lax.broadcast_in_dim(m_new, x.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        plgpu.barrier_wait(v_bar.at[slot])
        if masked:                                       # zero V rows past kv_end
            v_tile = v_smem[slot]
            if not interpret:
                v_tile = plgpu.layout_cast(v_tile, plgpu.Layout.WGMMA)
            rows = iota(v_tile.shape, 0) + start
            v_smem[slot] = jnp.where(rows < kv_end, v_tile, jnp.zeros((), dtype))
            plgpu.commit_smem()
        acc = add_pv(acc, p.astype(dtype), slot)
        if producer:
            plgpu.barrier_arrive(v_free.at[slot])
        else:
            plgpu.commit_smem()                          # every thread is done with the slot

            @pl.when(i + num_stages < num_iters)
            def _():
                issue(next_pages, slot)
        return acc, m_new, l

    carry = (init((Q_TILE_ROWS, head_dim), 0.0), init((Q_TILE_ROWS,), -jnp.inf),
             init((Q_TILE_ROWS,), 0.0))
    carry = lax.fori_loop(0, num_full, functools.partial(step, masked=False), carry)
    acc, _, l = lax.fori_loop(num_full, num_iters, functools.partial(step, masked=True), carry)

    has_keys = l > 0                                     # padding and unused items: zeros
    inv = jnp.where(has_keys, 1.0 / jnp.where(has_keys, l, 1.0), 0.0)
    o_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[w, h])
    plgpu.wait_smem_to_gmem(0)


def work_items(cu_q_lens, context_lens, num_tokens: int, block_q: int):
    """Per grid item: sequence (clamped; the padding pseudo-sequence is `S`), position of its
    first query, keys it may see (0 for unused items), first token; and per token: its item
    and row block within the item. All int32, from `build_work_list`'s order."""
    cu, work_seq, work_tile = build_work_list(cu_q_lens, num_tokens, block_q)
    num_seqs = context_lens.shape[0]
    lens = jnp.concatenate([context_lens.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
    used = work_seq >= 0
    seq = jnp.maximum(work_seq, 0)
    q_len = cu[seq + 1] - cu[seq]
    tile_start = cu[seq] + work_tile * block_q
    first_pos = lens[seq] - q_len + work_tile * block_q
    n_tok = jnp.minimum(block_q, cu[seq + 1] - tile_start)
    kv_end = jnp.where(used, jnp.clip(first_pos + n_tok, 0, lens[seq]), 0)

    t = jnp.arange(num_tokens, dtype=jnp.int32)
    tok_seq = jnp.minimum(jnp.searchsorted(cu[1:], t, side="right"), num_seqs).astype(jnp.int32)
    tiles = cdiv(jnp.maximum(cu[1:] - cu[:-1], 0), block_q)
    ends = jnp.cumsum(tiles)
    offset = t - cu[tok_seq]
    tok_item = ends[tok_seq] - 1 - offset // block_q    # last tile of a sequence first
    return (seq.astype(jnp.int32), first_pos.astype(jnp.int32), kv_end.astype(jnp.int32),
            tile_start.astype(jnp.int32), tok_item.astype(jnp.int32),
            (offset % block_q).astype(jnp.int32))


def prefill(q, k_pages, v_pages, block_tables, context_lens, cu_q_lens, *, scale: float,
            block_q: int, pages_per_compute_block: int, num_stages: int,
            warp_specialized: bool = WARP_SPECIALIZED, interpret: bool = False):
    """`[T, q_heads, d]` causal attention over blocks-first bf16 / fp16 pages (checked by the
    caller: `unsupported` is empty); rows past `cu_q_lens[-1]` are zeros."""
    plgpu = _plgpu()
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    rows = block_q * group
    if rows > Q_TILE_ROWS:
        raise ValueError(f"mosaic prefill packs at most {Q_TILE_ROWS} rows a tile, got "
                         f"block_q {block_q} x group {group}")
    dtype = k_pages.dtype
    seq, first_pos, kv_end, tile_start, tok_item, tok_row = work_items(
        cu_q_lens, context_lens, num_tokens, block_q)
    num_items = seq.shape[0]

    # Query tiles [items, kv_heads, 64, d]: row = token * group + head; rows past the tile's
    # tokens (the next sequence's, or clamped) are real numbers and are never written back.
    tok = jnp.minimum(tile_start[:, None] + jnp.arange(block_q, dtype=jnp.int32), num_tokens - 1)
    q_tiles = q.reshape(num_tokens, num_kv_heads, group, head_dim)[tok]
    q_tiles = q_tiles.transpose(0, 2, 1, 3, 4).reshape(num_items, num_kv_heads, rows, head_dim)
    if rows < Q_TILE_ROWS:
        q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, Q_TILE_ROWS - rows), (0, 0)))

    table = jnp.pad(block_tables, ((0, 1), (0, 0)))     # the padding pseudo-sequence's row
    block_k = block_size * pages_per_compute_block
    scratch = _pipeline_scratch(dtype, dtype, head_dim, block_k, num_stages,
                                pages_per_compute_block)
    kernel = functools.partial(
        _prefill_kernel, block_size=block_size, pages_per_compute_block=pages_per_compute_block,
        num_stages=num_stages, group=group, scale=scale, warp_specialized=warp_specialized,
        interpret=interpret)
    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(q_tiles.shape, dtype), scratch_types=scratch,
        grid=(num_items, num_kv_heads), grid_names=("w", "h"),
        **(dict(num_threads=2, thread_name="wg") if warp_specialized else {}),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpret else None)
    o_tiles = call(seq, first_pos, kv_end, table, q_tiles, k_pages, v_pages)

    # Back to [T, q_heads, d]: token t is row block `tok_row` of item `tok_item`.
    o_tiles = o_tiles[:, :, :rows].reshape(num_items, num_kv_heads, block_q, group, head_dim)
    out = o_tiles[tok_item, :, tok_row]                  # [T, kv_heads, group, d]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)

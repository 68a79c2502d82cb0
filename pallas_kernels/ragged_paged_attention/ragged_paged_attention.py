"""Ragged paged attention (prefill, chunked prefill, mixed batches) in Pallas (Triton lowering).

The new tokens of many sequences are concatenated, `q: [T, q_heads, d]`, delimited by
`cu_q_lens`. Query `i` of sequence `s` sits at position `context_lens[s] - q_len_s + i` and
attends to every key at a position `<=` its own; the new tokens' K/V are already in the
pages (the model writes before it attends), so cached context and the causal part of the
chunk are read the same way, through the block table.

A Mosaic GPU (Hopper) variant in `mosaic_prefill.py` sits behind the same
`ragged_paged_attention(..., backend=...)`.

Structure: `_ragged_kernel` (one program = one tile of `block_q` query tokens of one
sequence x one KV head) -> `_ragged_call` (work list, grid, BlockSpecs) ->
`ragged_paged_attention` (public, jitted, static tuning arguments).

Why it is shaped this way:
- Work list: tiles never straddle two sequences. A small jnp prologue turns `cu_q_lens` into
  a list of (sequence, tile) items, at most `cdiv(T, block_q) + S + 1` of them (a static
  grid); unused items exit at once. Tiles of one sequence run last-first, so the longest
  (causal) tiles start early.
- Padding tokens past `cu_q_lens[-1]` form one extra pseudo-sequence with no keys: its
  tiles write zeros, so every output row is written and finite without a memset.
- GQA packing: a tile's rows are `block_q` tokens x the `group` query heads of one KV head
  (row = token * group + head), so each K/V page is read once per tile, and the dots are
  `[block_q * group, d] x [d, block_k]`, tall enough for the tensor cores.
- Two loops: key blocks entirely at or before the tile's first query need no mask; only the
  last one or two blocks (the causal diagonal) are masked.
- Sliding windows (`window`): a query sees keys at positions > its own - window. A tile
  starts at the key block of its first query's window, so blocks before it are never read
  (the block table may hold the null block there); the blocks the window's edge cuts
  through are masked like the diagonal.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.arith import cdiv
from pallas_kernels.paged_attention import paging, tuning
from pallas_kernels.ragged_paged_attention import mosaic_prefill
from pallas_kernels.ragged_paged_attention.work_list import build_work_list

LOG2E = 1.4426950408889634


def _ragged_kernel(work_seq_ref, work_tile_ref, cu_ref, lens_ref, table_ref, q_ref, k_ref,
                   v_ref, *refs, block_size: int, pages_per_compute_block: int, block_q: int,
                   group: int, scale: float, quantized: bool, window: int | None = None):
    if quantized:
        ks_ref, vs_ref, o_ref = refs
    else:
        ks_ref = vs_ref = None
        (o_ref,) = refs
    w, h = pl.program_id(0), pl.program_id(1)
    num_tokens, _, head_dim = q_ref.shape
    rows = paging.tile_rows(block_q * group)
    block_k = block_size * pages_per_compute_block
    seq = work_seq_ref[w]

    @pl.when(seq >= 0)
    def _():
        tile = work_tile_ref[w]
        seq_start = cu_ref[seq]
        q_end = cu_ref[seq + 1]
        q_len = q_end - seq_start
        ctx = lens_ref[seq]
        tile_start = seq_start + tile * block_q
        first_pos = ctx - q_len + tile * block_q         # position of the tile's first token

        r = jnp.arange(rows, dtype=jnp.int32)
        tok = tile_start + r // group
        head = h * group + r % group
        row_valid = (tok < q_end) & (r < block_q * group)
        q_pos = first_pos + r // group
        cols = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
        tok_c = jnp.minimum(tok, num_tokens - 1)
        q = q_ref[tok_c[:, None], head[:, None], cols]      # [rows, d]
        compute_dtype = q.dtype
        precision = paging.dot_precision(compute_dtype)
        qk_scale = scale * LOG2E

        n_tok = jnp.minimum(block_q, q_end - tile_start)
        kv_end = jnp.clip(first_pos + n_tok, 0, ctx)         # keys the tile may see
        n_full = jnp.clip(first_pos + 1, 0, kv_end) // block_k
        n_all = cdiv(kv_end, block_k)

        def step(kb, carry, masked: bool):
            page0 = kb * pages_per_compute_block
            slots = paging.token_slots(table_ref, seq, page0, block_k, block_size)
            k_pos = kb * block_k + jnp.arange(block_k, dtype=jnp.int32)
            in_range = None
            if masked:   # keys no query of the tile may see are not even loaded
                in_range = k_pos < kv_end
                if window is not None:
                    in_range &= k_pos > first_pos - window
            s = paging.key_logits(q, k_ref, ks_ref, slots, in_range, precision) * qk_scale
            if masked:
                visible = (k_pos[None, :] <= q_pos[:, None]) & in_range[None, :]
                if window is not None:
                    visible &= k_pos[None, :] > q_pos[:, None] - window
                s = jnp.where(visible, s, -jnp.inf)
            # rows of the causal diagonal may see nothing yet: guard them
            return paging.softmax_step(carry, s, v_ref, vs_ref, slots, in_range, compute_dtype,
                                       precision, guard_empty_rows=True)

        init = paging.init_softmax_state(rows, head_dim)
        first_block = unmasked_from = 0
        if window is not None:
            # Blocks before the first query's window are skipped; those before the last
            # query's window starts are masked, the rest up to the diagonal are not.
            last_pos = first_pos + n_tok - 1
            first_block = jnp.maximum(first_pos - window + 1, 0) // block_k
            unmasked_from = jnp.maximum(
                first_block, jnp.minimum(cdiv(jnp.maximum(last_pos - window + 1, 0), block_k),
                                         n_full))
            init = lax.fori_loop(first_block, unmasked_from, functools.partial(step, masked=True),
                                 init)
        carry = lax.fori_loop(unmasked_from, n_full, functools.partial(step, masked=False), init)
        acc, _, l = lax.fori_loop(jnp.maximum(n_full, unmasked_from), n_all,
                                  functools.partial(step, masked=True), carry)

        out = paging.normalize(acc, l)
        plgpu.store(o_ref.at[tok[:, None], head[:, None], cols], out.astype(o_ref.dtype),
                    mask=jnp.broadcast_to(row_valid[:, None], (rows, head_dim)))


def _ragged_call(q, k_tok, v_tok, ks_tok, vs_tok, block_tables, context_lens, cu_q_lens, *,
                 block_size, num_kv_heads, block_q, pages_per_compute_block, scale, num_warps,
                 num_stages, interpret, window=None):
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    quantized = ks_tok is not None
    num_seqs = context_lens.shape[0]
    cu, work_seq, work_tile = build_work_list(cu_q_lens, num_tokens, block_q)
    lens = jnp.concatenate([context_lens, jnp.zeros((1,), jnp.int32)])   # pseudo-seq: no keys
    table = jnp.pad(block_tables, ((0, 1), (0, 0)))
    width = table.shape[1]
    pad = (-width) % pages_per_compute_block
    if pad:
        table = jnp.pad(table, ((0, 0), (0, pad)))
    num_items = work_seq.shape[0]
    pool_tokens = k_tok.shape[0]

    def full(shape):
        return pl.BlockSpec(shape, lambda w, h: (0,) * len(shape))

    kv_spec = pl.BlockSpec((pool_tokens, None, head_dim), lambda w, h: (0, h, 0))
    in_specs = [full((num_items,)), full((num_items,)), full((num_seqs + 2,)),
                full((num_seqs + 1,)), full(table.shape), full(q.shape), kv_spec, kv_spec]
    args = [work_seq, work_tile, cu, lens, table, q, k_tok, v_tok]
    if quantized:
        scale_spec = pl.BlockSpec((pool_tokens, None), lambda w, h: (0, h))
        in_specs += [scale_spec, scale_spec]
        args += [ks_tok, vs_tok]
    kernel = functools.partial(
        _ragged_kernel, block_size=block_size, pages_per_compute_block=pages_per_compute_block,
        block_q=block_q, group=group, scale=scale, quantized=quantized, window=window)
    return pl.pallas_call(
        kernel,
        grid=(num_items, num_kv_heads),
        in_specs=in_specs,
        out_specs=full(q.shape),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=(f"paxkv_ragged_paged_bq{block_q}_bs{block_size}_ppcb{pages_per_compute_block}"
              + ("" if window is None else f"_w{window}")),
    )(*args)


def default_block_q(group: int) -> int:
    """Query tokens per tile: about 128 rows of (token, head) pairs."""
    return max(1, 128 // group)


def _check_inputs(q, k_pages, v_pages, block_tables, context_lens, cu_q_lens, k_scale,
                  v_scale):
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, q_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must be equal 4-D shapes, got {k_pages.shape} "
                         f"and {v_pages.shape}")
    _, block_size, num_kv_heads, head_dim = k_pages.shape
    _, num_heads, q_dim = q.shape
    paging.check_heads(num_heads, q_dim, num_kv_heads, head_dim, block_size)
    if block_tables.ndim != 2 or block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be int32 [num_seqs, max_blocks], got "
                         f"{block_tables.dtype}{list(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    if context_lens.shape != (num_seqs,) or context_lens.dtype != jnp.int32:
        raise ValueError(f"context_lens must be int32 [num_seqs={num_seqs}], got "
                         f"{context_lens.dtype}{list(context_lens.shape)}")
    if cu_q_lens.shape != (num_seqs + 1,) or cu_q_lens.dtype != jnp.int32:
        raise ValueError(f"cu_q_lens must be int32 [num_seqs + 1={num_seqs + 1}], got "
                         f"{cu_q_lens.dtype}{list(cu_q_lens.shape)}")
    paging.check_scales(k_pages, k_scale, v_scale)
    return head_dim, num_heads, num_kv_heads, block_size


@functools.partial(jax.jit, static_argnames=(
    "scale", "window", "block_q", "pages_per_compute_block", "num_warps", "num_stages",
    "backend", "warp_specialized", "interpret"))
def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           block_tables: jax.Array, context_lens: jax.Array,
                           cu_q_lens: jax.Array, k_scale: jax.Array | None = None,
                           v_scale: jax.Array | None = None, *, scale: float | None = None,
                           window: int | None = None, block_q: int | None = None,
                           pages_per_compute_block: int | None = None, num_warps: int = 4,
                           num_stages: int | None = None, backend: str = "auto",
                           warp_specialized: bool | None = None,
                           interpret: bool = False) -> jax.Array:
    """Causal attention of a ragged batch of new tokens over their sequences' paged KV.

    Args:
      q: `[T, q_heads, head_dim]`, the new tokens of all sequences concatenated.
      k_pages, v_pages: one layer's pages `[num_blocks, block_size, kv_heads, head_dim]`,
        already holding these tokens' K/V.
      block_tables: int32 `[S, max_blocks]`; context_lens: int32 `[S]` (keys after the
        write); cu_q_lens: int32 `[S + 1]`, `cu_q_lens[0] == 0`, nondecreasing.
      k_scale, v_scale: optional per-token scales `[num_blocks, block_size, kv_heads]`.
      scale: softmax scale (default `head_dim ** -0.5`).
      window: sliding window: a query sees keys at positions > its own - window; key blocks
        before a tile's first window are not read.
      block_q: query tokens per tile (default `128 // group` for Triton, `64 // group` for
        Mosaic GPU, whose tile is one 64-row wgmma; at least 1).
      pages_per_compute_block: pages per key block (default ~64 tokens for Triton, ~128 for
        Mosaic GPU up to head_dim 128, where it must make a multiple of 64 tokens).
      num_warps, num_stages: launch parameters (Triton's stages default to 3, Mosaic GPU's to
        2, fewer where the K/V tiles would not fit in shared memory, as with 128- or 256-token
        pages); the Mosaic GPU kernel uses only the stages.
      backend: "triton" (Pallas' Triton lowering; every page dtype), "mosaic" (Pallas Mosaic
        GPU, Hopper: TMA + wgmma; bf16/fp16 pages, head_dim a multiple of 64) or "auto" (per
        shape from the measured winners in `tuning.PREFILL_WINNERS`; Triton elsewhere, and
        always in interpret mode).
      warp_specialized: Mosaic GPU only: one producer warpgroup issuing the TMA copies
        beside the compute warpgroup (default `mosaic_prefill.WARP_SPECIALIZED`).
      interpret: Pallas interpret mode (CPU tests; Mosaic GPU needs JAX >= 0.12).
    Returns:
      `[T, q_heads, head_dim]` in `q.dtype`; rows past `cu_q_lens[-1]` are zeros.
    """
    head_dim, num_heads, num_kv_heads, block_size = _check_inputs(
        q, k_pages, v_pages, block_tables, context_lens, cu_q_lens, k_scale, v_scale)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    group = num_heads // num_kv_heads
    if scale is None:
        scale = head_dim ** -0.5
    if backend not in tuning.BACKENDS:
        raise ValueError(f"backend must be one of {tuning.BACKENDS}, got {backend!r}")
    mosaic_ppcb = pages_per_compute_block or mosaic_prefill.default_pages_per_compute_block(
        block_size, head_dim)
    mosaic_bq = block_q or None
    backend = tuning.resolve_backend(
        backend, interpret,
        lambda: tuning.prefill_backend(k_pages.dtype, block_tables.shape[0],
                                       block_tables.shape[1] * block_size),
        lambda: ("it has no sliding window" if window is not None else
                 mosaic_prefill.unsupported(q, k_pages, k_scale, mosaic_ppcb, mosaic_bq, interpret)))
    if backend == "mosaic":
        return mosaic_prefill.prefill(
            q, k_pages, v_pages, block_tables, context_lens, cu_q_lens, scale=float(scale),
            block_q=block_q or mosaic_prefill.default_block_q(group),
            pages_per_compute_block=mosaic_ppcb,
            num_stages=mosaic_prefill.fit_num_stages(num_stages, block_size * mosaic_ppcb,
                                                     head_dim, jnp.dtype(k_pages.dtype).itemsize),
            warp_specialized=(mosaic_prefill.WARP_SPECIALIZED if warp_specialized is None
                              else warp_specialized),
            interpret=interpret)

    bq = block_q or default_block_q(group)
    if bq < 1:
        raise ValueError(f"block_q must be >= 1, got {bq}")
    ppcb = pages_per_compute_block or max(1, 64 // block_size)
    if block_size * ppcb < 16 or not paging.is_power_of_two(ppcb):
        raise ValueError(f"pages_per_compute_block must be a power of two with "
                         f"block_size * pages_per_compute_block >= 16, got {ppcb}")

    num_stages = paging.fit_num_stages(
        num_stages, 3, block_k=block_size * ppcb, head_dim=head_dim,
        kv_itemsize=jnp.dtype(k_pages.dtype).itemsize,
        rows=paging.tile_rows(bq * group), q_itemsize=jnp.dtype(q.dtype).itemsize)

    def to_tok(x):
        return None if x is None else x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])

    return _ragged_call(
        q, to_tok(k_pages), to_tok(v_pages), to_tok(k_scale), to_tok(v_scale), block_tables,
        context_lens, cu_q_lens, block_size=block_size, num_kv_heads=num_kv_heads,
        block_q=bq, pages_per_compute_block=ppcb, scale=float(scale), num_warps=num_warps,
        num_stages=num_stages, interpret=interpret, window=window)

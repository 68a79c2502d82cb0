"""Decode paged attention for GPUs in Pallas: one query token per sequence.

The Triton-lowered kernel lives here; a Mosaic GPU (Hopper) variant in `mosaic_decode.py`
sits behind the same `paged_attention(..., backend=...)`.

Structure: `_decode_kernel` (one program = one sequence x one KV head x one split of its
pages) -> `_decode_call` (grid, BlockSpecs, pallas_call) -> `paged_attention` (public,
jitted, static tuning arguments, split combine).

Why it is shaped this way:
- GQA packing: the `group` query heads that share a KV head live in one program as rows of
  a `[rows, d]` tile (rows = group padded up to the 16 a tensor-core dot needs), so every
  K/V page of that head is read from memory exactly once per sequence.
- Several pages per loop step (`pages_per_compute_block`): one step gathers
  `block_k = pages_per_compute_block * block_size` tokens through the block table, enough
  bytes in flight per program to approach the memory bandwidth.
- Split-K (flash-decoding): with few sequences or long contexts the `batch x kv_heads`
  programs cannot fill the GPU, so each sequence's pages (up to its length, not the table's
  width) are cut into `num_splits` ranges processed in parallel; each writes a normalized
  partial output and its log-sum-exp, and a small combine kernel (`combine.py`) rescales and
  sums them.
- fp32 softmax state and accumulators in base 2 (`exp2`, log2(e) folded into the scale).
- Masked loads: tokens past the context length are neither read nor counted, so stale or
  non-finite page contents past the end never reach the output.
- Sliding windows (`window`): only keys at positions > query - window count. The splits
  share the pages from the window's first (rounded down to a loop step) to the last, so
  pages before the window are never read: the sequence's block table may hold the null
  block there (the engine frees them). Every step is masked then. With fp8 pages (which need
  a select per element to mask) all loop steps but the one that reaches past the length run
  unmasked, and only that last step masks.
- 8-bit pages (fp8 e4m3/e5m2, int8) are converted once, straight to the dots' dtype
  (`dot_dtype`: codes are exact in bf16 and fp16; fp8 codes default to fp16, one
  instruction per pair on Hopper), and their per-token scales are applied outside the dots:
  the K scale to the logits, the V scale to the probabilities.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.arith import cdiv
from pallas_kernels.paged_attention import mosaic_decode, paging, tuning
from pallas_kernels.paged_attention.combine import combine_splits_kernel

LOG2E = 1.4426950408889634
LAYOUTS = ("blocks_first", "heads_first")


def _split_full_steps(page_dtype) -> bool:
    """Whether the loop runs its full steps unmasked apart from the masked last one.

    Measured on an H200: it pays for fp8 pages, whose masked steps need a select per
    element (Triton cannot fill fp8 loads), taking them from 1.18-1.26x to 0.96-1.07x the
    bf16 time; for bf16 and int8 pages (masked loads that fill 0 for free) the second loop
    cost 3-7% at batch >= 64, so they keep one masked loop.
    """
    dtype = jnp.dtype(page_dtype)
    return dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def _decode_kernel(lens_ref, table_ref, q_ref, *refs, block_size: int,
                   pages_per_compute_block: int, group: int,
                   rows: int, scale: float, quantized: bool, num_splits: int, dot_dtype,
                   rope_heads: tuple[int, int] | None = None, window: int | None = None):
    """One (sequence, kv head, split): online softmax over that split's pages.

    With `rope_heads` (q heads, kv heads) `q_ref` holds the step's packed, unrotated q/k/v
    heads and the program also rotates them and writes the new token's K/V
    (`rope_paged_attention`)."""
    if rope_heads is not None:
        cos_ref, sin_ref, slot_ref, *refs = refs
    k_ref, v_ref, *refs = refs
    if quantized:
        ks_ref, vs_ref, *out_refs = refs
    else:
        ks_ref = vs_ref = None
        out_refs = refs
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim = q_ref.shape[-1]
    block_k = block_size * pages_per_compute_block
    length = lens_ref[b]

    r = jnp.arange(rows, dtype=jnp.int32)
    cols = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    q_rows = h * group + jnp.minimum(r, group - 1)     # padding rows repeat the last head
    qk_scale = scale * LOG2E
    if rope_heads is None:
        q = q_ref[q_rows[:, None], cols]
        page_length = length
    else:
        q, k_new, v_new = _rotated_heads(q_ref, cos_ref, sin_ref, q_rows, h, *rope_heads)
        # The new token (the sequence's last, at `length - 1`) comes from registers, not
        # from its page, which split 0 writes while the other programs read theirs.
        page_length = jnp.maximum(length - 1, 0)
        with_new = (s == 0) & (length > 0)
    if dot_dtype is not None and jnp.dtype(dot_dtype) != q.dtype:
        # The softmax scale is folded into the query before it is rounded to `dot_dtype`
        # (it shrinks the values, far from float16's overflow).
        q = (q.astype(jnp.float32) * qk_scale).astype(dot_dtype)
        qk_scale = 1.0
    compute_dtype = q.dtype
    precision = paging.dot_precision(compute_dtype)

    # The splits share the sequence's own pages, not the table's width: at one stream with a
    # 2,048-token table a 512-token context otherwise fell into 2 of its 8 splits, 2 loop
    # steps each. Whole loop steps per split, so no step crosses into the next split, and
    # never more pages than the table's padding gives each split (`paged_attention`).
    length_pages = cdiv(page_length, block_size)
    # With a window, the query (at `length - 1`) sees keys from `window_start` on; the
    # splits start at its page, rounded down to a whole loop step so every step's pages stay
    # inside the table's padded width.
    window_start = 0 if window is None else jnp.maximum(length - window, 0)
    window_page = (window_start // block_size) // pages_per_compute_block * pages_per_compute_block
    live_pages = jnp.maximum(length_pages - window_page, 0)
    splits_used = num_splits
    if rope_heads is not None:
        # One stream's fused kernel: at most 4 splits hold pages until each would get
        # `ROPE_DECODE_STEPS_PER_SPLIT` loop steps (short contexts, as tuned), then up to the
        # grid's count: the context decides, not the table's width (`max_model_len` on a GPU).
        splits_used = jnp.minimum(num_splits,
                                  rope_decode_max_splits(live_pages, pages_per_compute_block))
    split_pages = (cdiv(cdiv(live_pages, splits_used), pages_per_compute_block)
                   * pages_per_compute_block)
    first_page = window_page + s * split_pages
    last_page = jnp.minimum(length_pages, first_page + split_pages)
    num_iters = cdiv(jnp.maximum(last_page - first_page, 0), pages_per_compute_block)

    # Only a step that reaches past `length` needs masks: every step before it holds
    # `block_k` tokens of the sequence. Where that pays (`_split_full_steps`), those steps
    # load K/V codes and scales unmasked and skip the logit select, and at most one masked
    # step per split follows (none when `length` is a multiple of `block_k`).
    num_full = jnp.minimum(jnp.maximum(page_length - first_page * block_size, 0) // block_k,
                           num_iters)

    def step(i, carry, masked: bool):
        page0 = first_page + i * pages_per_compute_block
        slots = paging.token_slots(table_ref, None, page0, block_k, block_size)
        valid = None
        if masked:
            tok = page0 * block_size + jnp.arange(block_k, dtype=jnp.int32)
            valid = tok < page_length
            if window is not None:
                valid &= tok >= window_start
        logits = paging.key_logits(q, k_ref, ks_ref, slots, valid, precision)
        if qk_scale != 1.0:
            logits = logits * qk_scale
        if masked:
            logits = jnp.where(valid[None, :], logits, -jnp.inf)
        # without a window every step has a token, so the running max is finite: no guard
        return paging.softmax_step(carry, logits, v_ref, vs_ref, slots, valid, compute_dtype,
                                   precision, guard_empty_rows=window is not None)

    carry = paging.init_softmax_state(rows, head_dim)
    if rope_heads is not None:   # split 0 starts from the new token: max = its logit, sum 1
        new_logit = jnp.sum(q.astype(jnp.float32) * k_new.astype(jnp.float32), axis=1) * qk_scale
        carry = (jnp.where(with_new, jnp.broadcast_to(v_new.astype(jnp.float32), (rows, head_dim)),
                           carry[0]),
                 jnp.where(with_new, new_logit, carry[1]),
                 jnp.where(with_new, 1.0, carry[2]))
    if _split_full_steps(k_ref.dtype) and window is None:
        carry = lax.fori_loop(0, num_full, functools.partial(step, masked=False), carry)
    else:
        num_full = 0
    acc, m, l = lax.fori_loop(num_full, num_iters, functools.partial(step, masked=True), carry)

    has_keys = l > 0
    out = paging.normalize(acc, l)
    out_rows = h * group + r                            # distinct; masked past the group
    row_mask = r < group
    o_ref = out_refs[0]
    plgpu.store(o_ref.at[out_rows[:, None], cols], out.astype(o_ref.dtype),
                mask=jnp.broadcast_to(row_mask[:, None], (rows, head_dim)))
    if num_splits > 1:
        lse_ref = out_refs[1]
        lse = jnp.where(has_keys, m + jnp.log(jnp.where(has_keys, l, 1.0)) * LOG2E, -jnp.inf)
        plgpu.store(lse_ref.at[out_rows], lse, mask=row_mask)
    if rope_heads is not None:
        k_out_ref, v_out_ref = out_refs[-2:]
        slot = slot_ref[b]

        @pl.when(with_new & (slot >= 0) & (slot < k_out_ref.shape[0]))
        def _():
            k_out_ref[pl.ds(slot, 1), :] = k_new.astype(k_out_ref.dtype)
            v_out_ref[pl.ds(slot, 1), :] = v_new.astype(v_out_ref.dtype)


def _rotated_heads(qkv_ref, cos_ref, sin_ref, q_rows, h, q_heads: int, kv_heads: int):
    """From one token's packed heads `[Hq + 2 Hkv, d]`: the rotated query rows `q_rows`, the
    rotated key and the value of KV head `h` (`[1, d]` each), in the input dtype.

    Rotate-half RoPE as `paxkv.model.rope.apply_rope` (float32 math, rounded after): column
    j pairs with column (j + d/2) mod d, the first half taking the partner with a minus.
    """
    head_dim = qkv_ref.shape[-1]
    half = head_dim // 2
    cols = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    partner = (cols + half) % head_dim
    sign = jnp.where(cols < half, -1.0, 1.0)
    cos = cos_ref[cols % half]
    sin = sign * sin_ref[cols % half]

    def rotate(head_rows):
        x = qkv_ref[head_rows, cols].astype(jnp.float32)
        x_partner = qkv_ref[head_rows, partner].astype(jnp.float32)
        return (x * cos + x_partner * sin).astype(qkv_ref.dtype)

    kv_row = jnp.zeros((1, 1), jnp.int32) + (q_heads + h)
    return rotate(q_rows[:, None]), rotate(kv_row), qkv_ref[kv_row + kv_heads, cols]


# Most splits of the fused RoPE + KV-write decode kernel (`rope_paged_attention`) at short
# contexts, where every program rotates its query rows and key before its first page: at one
# Llama-3-8B stream on an H200 (JAX 0.11.2, results/one_stream.md; 200-640-token contexts in
# a 2,048-token table) 8 splits ran 227.5-228.2 tok/s, 4 splits 238.8-239.6, 2 splits
# 236.3-238.8, 1 split 233.9-234.3.
ROPE_DECODE_MAX_SPLITS = 4
# Past that, the cap follows the table's width: a split gets at least this many loop steps
# of pages. With 4 splits, 8 KV heads were 32 programs on 132 SMs, and a 100k-token context
# read its KV at 1.01 TB/s (H100) against 2.53 TB/s with `paged_attention`'s own split count.
ROPE_DECODE_STEPS_PER_SPLIT = 4


def rope_decode_max_splits(max_pages, pages_per_compute_block: int):
    """The fused decode kernel's split cap over `max_pages` pages: 4 while each split would
    get fewer than 4 loop steps (one stream at short context), more past that, so long
    contexts fill the GPU as `paged_attention` does. An int for a table's width (the grid);
    traced for a sequence's own pages inside the kernel (the splits that hold pages)."""
    long_cap = max_pages // (ROPE_DECODE_STEPS_PER_SPLIT * pages_per_compute_block)
    if isinstance(long_cap, int):
        return max(ROPE_DECODE_MAX_SPLITS, long_cap)
    return jnp.maximum(ROPE_DECODE_MAX_SPLITS, long_cap)


def choose_num_splits(batch: int, num_kv_heads: int, max_pages: int,
                      pages_per_compute_block: int, num_sms: int = 132,
                      programs_per_sm: int = 4, max_splits: int | None = None) -> int:
    """Split count so `batch * kv_heads * splits` fills the GPU a few programs deep
    (rounded up to a power of two), while each split keeps at least two loop steps of
    pages, and at most `max_splits`. Measured on an H200: B=32/ctx 1024 -> 4, B=64/2048
    -> 2, B>=128 -> 1."""
    programs = batch * num_kv_heads
    want = cdiv(num_sms * programs_per_sm, max(programs, 1))
    cap = max(1, max_pages // (2 * pages_per_compute_block))
    if max_splits is not None:
        cap = max(1, min(cap, max_splits))
    splits = 1
    while splits < want and splits * 2 <= cap:
        splits *= 2
    return splits


def default_pages_per_compute_block(block_size: int) -> int:
    """About 128 tokens per loop step (and at least the 16 a dot needs)."""
    return max(1, 128 // block_size, 16 // block_size)


def _pages_to_tokens(pages: jax.Array, layout: str) -> jax.Array:
    """`[nb, bs, H, d]` -> `[nb*bs, H, d]` or `[H, nb, bs, d]` -> `[H, nb*bs, d]` (a bitcast)."""
    if layout == "blocks_first":
        nb, bs = pages.shape[:2]
        return pages.reshape(nb * bs, *pages.shape[2:])
    h, nb, bs = pages.shape[:3]
    return pages.reshape(h, nb * bs, *pages.shape[3:])


def _decode_call(q, k_tok, v_tok, ks_tok, vs_tok, block_tables, lengths, *, layout, block_size,
                 num_kv_heads, pages_per_compute_block, num_splits, scale,
                 num_warps, num_stages, dot_dtype, interpret, rope=None, window=None):
    """-> attention output `[B, Hq, d]`; with `rope` (cos, sin, slot_mapping: `q` is then the
    packed q/k/v heads, `rope_paged_attention`) -> (output, k_tok, v_tok)."""
    batch, packed_heads, head_dim = q.shape
    num_heads = packed_heads - 2 * num_kv_heads if rope is not None else packed_heads
    group = num_heads // num_kv_heads
    rows = paging.tile_rows(group)
    quantized = ks_tok is not None
    width = block_tables.shape[1]
    num_tokens = k_tok.shape[0] if layout == "blocks_first" else k_tok.shape[1]

    if layout == "blocks_first":
        kv_spec = pl.BlockSpec((num_tokens, None, head_dim), lambda b, h, s: (0, h, 0))
        scale_spec = pl.BlockSpec((num_tokens, None), lambda b, h, s: (0, h))
    else:
        kv_spec = pl.BlockSpec((None, num_tokens, head_dim), lambda b, h, s: (h, 0, 0))
        scale_spec = pl.BlockSpec((None, num_tokens), lambda b, h, s: (h, 0))
    in_specs = [
        pl.BlockSpec((batch,), lambda b, h, s: (0,)),
        pl.BlockSpec((None, width), lambda b, h, s: (b, 0)),
        pl.BlockSpec((None, packed_heads, head_dim), lambda b, h, s: (b, 0, 0)),
    ]
    args = [lengths, block_tables, q]
    if rope is not None:
        cos, sin, slot_mapping = rope
        half_spec = pl.BlockSpec((None, head_dim // 2), lambda b, h, s: (b, 0))
        in_specs += [half_spec, half_spec, pl.BlockSpec((batch,), lambda b, h, s: (0,))]
        args += [cos.astype(jnp.float32), sin.astype(jnp.float32), slot_mapping.astype(jnp.int32)]
    kv_input = len(args)
    in_specs += [kv_spec, kv_spec]
    args += [k_tok, v_tok]
    if quantized:
        in_specs += [scale_spec, scale_spec]
        args += [ks_tok, vs_tok]

    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((batch, num_heads, head_dim), q.dtype)]
        out_specs = [pl.BlockSpec((None, num_heads, head_dim), lambda b, h, s: (b, 0, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((batch, num_splits, num_heads, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((batch, num_splits, num_heads), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, num_heads, head_dim), lambda b, h, s: (b, s, 0, 0)),
                     pl.BlockSpec((None, None, num_heads), lambda b, h, s: (b, s, 0))]

    aliases = {}
    if rope is not None:    # the pages are written in place: aliased to two more outputs
        aliases = {kv_input: len(out_shape), kv_input + 1: len(out_shape) + 1}
        out_shape += [jax.ShapeDtypeStruct(k_tok.shape, k_tok.dtype),
                      jax.ShapeDtypeStruct(v_tok.shape, v_tok.dtype)]
        out_specs += [kv_spec, kv_spec]

    kernel = functools.partial(
        _decode_kernel, block_size=block_size, pages_per_compute_block=pages_per_compute_block,
        group=group, rows=rows, scale=scale,
        quantized=quantized, num_splits=num_splits, dot_dtype=dot_dtype,
        rope_heads=None if rope is None else (num_heads, num_kv_heads), window=window)
    prefix = "paxkv_paged_decode" if rope is None else "paxkv_rope_paged_decode"
    if window is not None:
        prefix += f"_w{window}"
    outs = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"{prefix}_bs{block_size}_ppcb{pages_per_compute_block}_s{num_splits}",
    )(*args)
    if num_splits == 1:
        out = outs[0]
    else:
        out = combine_splits_kernel(outs[0], outs[1], out_dtype=q.dtype, interpret=interpret)
    return out if rope is None else (out, outs[-2], outs[-1])


def _pages_per_compute_block(requested: int | None, block_size: int) -> int:
    ppcb = requested or default_pages_per_compute_block(block_size)
    if block_size * ppcb < 16 or not paging.is_power_of_two(ppcb):
        raise ValueError(f"pages_per_compute_block must be a power of two with "
                         f"block_size * pages_per_compute_block >= 16, got {ppcb}")
    return ppcb


def _split_plan(block_tables, batch: int, num_kv_heads: int, ppcb: int,
                num_splits: int | None, max_splits: int | None = None,
                window_pages: int | None = None) -> tuple[int, int, jax.Array]:
    """-> (splits, pages per split, block tables padded with the null block to cover them);
    `num_splits` None: `choose_num_splits` up to `max_splits`, for contexts of at most
    `window_pages` pages where a window bounds them."""
    max_pages = block_tables.shape[1]
    if num_splits is None and window_pages is not None:
        num_splits = choose_num_splits(batch, num_kv_heads, min(max_pages, window_pages), ppcb,
                                       max_splits=max_splits)
    splits = num_splits or choose_num_splits(batch, num_kv_heads, max_pages, ppcb,
                                             max_splits=max_splits)
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {splits}")
    pages_per_split = cdiv(cdiv(max_pages, splits), ppcb) * ppcb
    splits = cdiv(max_pages, pages_per_split)          # drop splits that would be empty
    width = splits * pages_per_split
    if width > max_pages:                               # pad with the null block
        block_tables = jnp.pad(block_tables, ((0, 0), (0, width - max_pages)))
    return splits, pages_per_split, block_tables


def _check_inputs(q, k_pages, v_pages, block_tables, context_lens, k_scale, v_scale, layout):
    if layout not in LAYOUTS:
        raise ValueError(f"pages_layout must be one of {LAYOUTS}, got {layout!r}")
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must be equal 4-D shapes, got {k_pages.shape} "
                         f"and {v_pages.shape}")
    if layout == "blocks_first":
        num_blocks, block_size, num_kv_heads, head_dim = k_pages.shape
    else:
        num_kv_heads, num_blocks, block_size, head_dim = k_pages.shape
    batch, num_heads, q_dim = q.shape
    paging.check_heads(num_heads, q_dim, num_kv_heads, head_dim, block_size)
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [batch={batch}, max_blocks], got "
                         f"{block_tables.shape}")
    if block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    if context_lens.shape != (batch,) or context_lens.dtype != jnp.int32:
        raise ValueError(f"context_lens must be int32 [batch={batch}], got "
                         f"{context_lens.dtype}{list(context_lens.shape)}")
    paging.check_scales(k_pages, k_scale, v_scale)
    return batch, num_heads, head_dim, num_kv_heads, block_size


@functools.partial(jax.jit, static_argnames=(
    "scale", "window", "pages_per_compute_block", "num_splits", "num_warps", "num_stages",
    "pages_layout", "backend", "dot_dtype", "warp_specialized", "interpret"))
def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    block_tables: jax.Array, context_lens: jax.Array,
                    k_scale: jax.Array | None = None, v_scale: jax.Array | None = None, *,
                    scale: float | None = None, window: int | None = None,
                    pages_per_compute_block: int | None = None,
                    num_splits: int | None = None, num_warps: int = 4, num_stages: int | None = None,
                    pages_layout: str = "blocks_first", backend: str = "auto",
                    dot_dtype: str | None = None, warp_specialized: bool | None = None,
                    interpret: bool = False) -> jax.Array:
    """Decode attention of one query token per sequence over its paged KV cache.

    Args:
      q: `[batch, q_heads, head_dim]`, the new token of each sequence.
      k_pages, v_pages: one layer's pool pages, `[num_blocks, block_size, kv_heads, head_dim]`
        ("blocks_first", the KV pool's layout) or `[kv_heads, num_blocks, block_size,
        head_dim]` ("heads_first").
      block_tables: int32 `[batch, max_blocks]`, physical page of each logical page.
      context_lens: int32 `[batch]`, keys to attend to (0 -> output 0).
      k_scale, v_scale: optional per-token dequantization scales shaped like the pages
        without `head_dim` (quantized fp8/int8 pools).
      scale: softmax scale (default `head_dim ** -0.5`).
      window: sliding window: only keys at positions > query - window (the query is the
        sequence's last token, at `context_lens - 1`); pages before the window are not read.
      pages_per_compute_block: pages gathered per loop step (default ~128 tokens).
      num_splits: split-K count (default from batch, heads and `max_blocks`, or the window).
      num_warps, num_stages: launch parameters (stages default to 2, fewer where the K/V
        tiles would not fit in shared memory); the Mosaic GPU kernel uses only the stages.
      pages_layout: "blocks_first" or "heads_first" (Triton only).
      backend: "triton" (Pallas' Triton lowering; every page dtype and layout), "mosaic"
        (Pallas Mosaic GPU, Hopper: TMA + wgmma; bf16/fp16 pages, blocks-first) or "auto"
        (per shape from the measured winners in `tuning.DECODE_WINNERS`; Triton elsewhere,
        and always in interpret mode).
      dot_dtype: dtype of the Triton kernel's dot operands ("bfloat16", "float16"; default
        the query's; for 8-bit pages `tuning.default_dot_dtype`). 8-bit codes are exact in
        both.
      warp_specialized: Mosaic GPU only: one producer warpgroup issuing the TMA copies
        beside the compute warpgroup (default `mosaic_decode.WARP_SPECIALIZED`).
      interpret: run in Pallas interpret mode (CPU tests; Mosaic GPU needs JAX >= 0.12).
    Returns:
      `[batch, q_heads, head_dim]` in `q.dtype`.
    """
    batch, _, head_dim, num_kv_heads, block_size = _check_inputs(
        q, k_pages, v_pages, block_tables, context_lens, k_scale, v_scale, pages_layout)
    if scale is None:
        scale = head_dim ** -0.5
    if backend not in tuning.BACKENDS:
        raise ValueError(f"backend must be one of {tuning.BACKENDS}, got {backend!r}")
    ppcb = _pages_per_compute_block(pages_per_compute_block, block_size)
    max_pages = block_tables.shape[1]
    _check_window(window)
    backend = tuning.resolve_backend(
        backend, interpret, lambda: tuning.decode_backend(k_pages.dtype, batch, max_pages * block_size),
        lambda: ("it has no sliding window" if window is not None else
                 mosaic_decode.unsupported(q, k_pages, k_scale, pages_layout, ppcb, interpret)))
    splits, pages_per_split, block_tables = _split_plan(
        block_tables, batch, num_kv_heads, ppcb, num_splits,
        window_pages=None if window is None else cdiv(window, block_size) + ppcb)

    if backend == "mosaic":
        return mosaic_decode.decode(
            q, k_pages, v_pages, block_tables, context_lens, scale=float(scale),
            pages_per_compute_block=ppcb, pages_per_split=pages_per_split, num_splits=splits,
            num_stages=mosaic_decode.fit_num_stages(num_stages, block_size * ppcb, head_dim,
                                                    jnp.dtype(k_pages.dtype).itemsize),
            warp_specialized=(mosaic_decode.WARP_SPECIALIZED if warp_specialized is None
                              else warp_specialized),
            interpret=interpret)

    num_stages = paging.fit_num_stages(
        num_stages, 2, block_k=block_size * ppcb, head_dim=head_dim,
        kv_itemsize=jnp.dtype(k_pages.dtype).itemsize,
        rows=paging.tile_rows(q.shape[1] // num_kv_heads),
        q_itemsize=jnp.dtype(q.dtype).itemsize)

    def to_tok(x):
        return None if x is None else _pages_to_tokens(x, pages_layout)

    if dot_dtype is None:
        dot_dtype = tuning.default_dot_dtype(k_pages.dtype, q.dtype)
    return _decode_call(
        q, to_tok(k_pages), to_tok(v_pages), to_tok(k_scale), to_tok(v_scale), block_tables,
        context_lens, layout=pages_layout, block_size=block_size, num_kv_heads=num_kv_heads,
        pages_per_compute_block=ppcb, num_splits=splits,
        scale=float(scale), num_warps=num_warps, num_stages=num_stages,
        dot_dtype=None if dot_dtype is None else jnp.dtype(dot_dtype), interpret=interpret,
        window=window)


def _check_window(window: int | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")


@functools.partial(jax.jit, static_argnames=(
    "scale", "window", "pages_per_compute_block", "num_splits", "num_warps", "num_stages",
    "interpret"))
def rope_paged_attention(qkv: jax.Array, cos: jax.Array, sin: jax.Array,
                         slot_mapping: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                         block_tables: jax.Array, context_lens: jax.Array, *,
                         scale: float | None = None, window: int | None = None,
                         pages_per_compute_block: int | None = None,
                         num_splits: int | None = None, num_warps: int = 4,
                         num_stages: int | None = None,
                         interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A decode step's RoPE, KV-page write and attention in one launch (Triton lowering).

    Run apart, `layer_ops.rope_kv_write` and `paged_attention` are two of a one-stream layer's
    thirteen kernels; here each attention program rotates its query rows and its KV head's
    new key itself, split 0 of each (sequence, KV head) writes the new key and value into the
    pages, and the new token enters the online softmax from registers (split 0 starts its state
    from it), so no program reads a slot that another is writing.

    Args:
      qkv: `[batch, q_heads + 2 kv_heads, head_dim]`, each sequence's new token's unrotated
        q/k/v heads as the fused projection lays them out (`layer_ops.rope_kv_write`).
      cos, sin: float32 `[batch, head_dim // 2]` at the new tokens' positions.
      slot_mapping: int32 `[batch]`, the new token's pool slot (`block * block_size + offset`).
      k_pages, v_pages: one layer's unquantized blocks-first pages (aliased to the outputs).
      block_tables, context_lens: as `paged_attention`; `context_lens` counts the new token,
        the sequence's last (0: a padding row, output 0, nothing written).
      scale, window, pages_per_compute_block, num_warps, num_stages: as `paged_attention`.
      num_splits: as `paged_attention`, its default at most `rope_decode_max_splits`.
    Returns:
      (`[batch, q_heads, head_dim]` in `qkv.dtype`, k_pages, v_pages).
    """
    if qkv.ndim != 3 or k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"rope_paged_attention: qkv must be [batch, heads, head_dim] and the "
                         f"pages equal 4-D shapes, got {qkv.shape}, {k_pages.shape}, "
                         f"{v_pages.shape}")
    num_blocks, block_size, num_kv_heads, head_dim = k_pages.shape
    batch, packed_heads, _ = qkv.shape
    num_heads = packed_heads - 2 * num_kv_heads
    if num_heads < 1:
        raise ValueError(f"rope_paged_attention: qkv {qkv.shape} does not hold q heads and the "
                         f"{num_kv_heads} k and v heads of the pages")
    q_shape = jax.ShapeDtypeStruct((batch, num_heads, qkv.shape[-1]), qkv.dtype)
    _check_inputs(q_shape, k_pages, v_pages, block_tables, context_lens, None, None,
                  "blocks_first")
    if cos.shape != (batch, head_dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [batch={batch}, head_dim // 2={head_dim // 2}], "
                         f"got {cos.shape} and {sin.shape}")
    if slot_mapping.shape != (batch,):
        raise ValueError(f"slot_mapping must be [batch={batch}], got {slot_mapping.shape}")
    if scale is None:
        scale = head_dim ** -0.5
    ppcb = _pages_per_compute_block(pages_per_compute_block, block_size)
    _check_window(window)
    splits, _, block_tables = _split_plan(
        block_tables, batch, num_kv_heads, ppcb, num_splits,
        max_splits=rope_decode_max_splits(block_tables.shape[1], ppcb),
        window_pages=None if window is None else cdiv(window, block_size) + ppcb)
    num_stages = paging.fit_num_stages(
        num_stages, 2, block_k=block_size * ppcb, head_dim=head_dim,
        kv_itemsize=jnp.dtype(k_pages.dtype).itemsize,
        rows=paging.tile_rows(num_heads // num_kv_heads), q_itemsize=jnp.dtype(qkv.dtype).itemsize)
    out, k_tok, v_tok = _decode_call(
        qkv, _pages_to_tokens(k_pages, "blocks_first"), _pages_to_tokens(v_pages, "blocks_first"),
        None, None, block_tables, context_lens, layout="blocks_first", block_size=block_size,
        num_kv_heads=num_kv_heads, pages_per_compute_block=ppcb, num_splits=splits,
        scale=float(scale), num_warps=num_warps, num_stages=num_stages, dot_dtype=None,
        interpret=interpret, rope=(cos, sin, slot_mapping), window=window)
    return out, k_tok.reshape(k_pages.shape), v_tok.reshape(v_pages.shape)

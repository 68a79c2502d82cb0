"""Decode paged attention for Hopper in Pallas Mosaic GPU: TMA page copies and wgmma.

Same contract as the Triton kernel in `paged_attention.py` (bf16 / fp16 pages, blocks-first
pool layout); `paged_attention(..., backend="mosaic")` reaches it.

Structure: `_decode_kernel` (one CUDA block = one warpgroup = one sequence x one KV head x
one split of its pages) -> `decode` (scratch, barriers, grid, split combine).

Why it is shaped this way:
- Pages arrive by TMA: each loop step copies `pages_per_compute_block` pages of one KV head
  (`[block_size, head_dim]` boxes, strided by the pool's heads) into one swizzled shared
  memory tile per K and V, `num_stages` steps ahead of the step being computed. All copies
  of a step arrive on one barrier (one arrival per page).
- GQA packing as in the Triton kernel: the group's query heads are rows of a 64-row tile (the
  smallest wgmma M); rows past the group are zeros and are never written out.
- `S = Q K^T` and `O += P V` are wgmma with fp32 accumulators; P goes to the tensor cores
  from registers in the dots' dtype; the softmax runs in base 2 (`exp2`), as in Triton.
- Only the step that reaches past the sequence's length is masked: its logits past the length
  become -inf, and its V rows past the length are zeroed in shared memory, since stale or
  non-finite bytes there would otherwise turn `0 * NaN` into NaN in the PV product.
- Split-K writes normalized partials and base-2 LSEs that `combine_splits` merges.

Measured on an H200 (results/kernels.md, "Decode backends"): correct at every shape, at
1.02-1.34x the Triton kernel's time, so `backend="auto"` keeps Triton. The likely cost is the
64-row wgmma tile: a KV head has 4 query heads, so the softmax (exp2, max, sum and the
accumulator rescale) runs on 16x the rows that matter, where Triton's tile has 16 rows.

Mosaic GPU has an interpret mode on the CPU only from JAX 0.12, and it cannot run wgmma;
there the two products are plain dots on the shared-memory tiles (`_INTERPRET_DOTS`), so the
copies, barriers, masks and splits are still the compiled kernel's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.arith import cdiv

LOG2E = 1.4426950408889634
Q_TILE_ROWS = 64          # wgmma's M
# A producer warpgroup issuing the copies beat one warpgroup doing both at every measured
# shape (1.02-1.34x against 1.05-1.45x the Triton kernel's time; results/kernels.md).
WARP_SPECIALIZED = True
SWIZZLE = 128             # bytes


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu


def _transposed(ref):
    """`ref.T` for wgmma's B operand (the name changed between JAX 0.11 and 0.12)."""
    if hasattr(ref, "transpose"):
        return ref.transpose((1, 0))
    return _plgpu().transpose_ref(ref, (1, 0))


def _tile_transforms(dtype) -> tuple:
    plgpu = _plgpu()
    cols = SWIZZLE // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(SWIZZLE))


def interpret_params():
    """Mosaic GPU's CPU interpret mode (JAX >= 0.12), or None where this JAX has none."""
    plgpu = _plgpu()
    params = getattr(plgpu, "InterpretGPUParams", None)
    return None if params is None else params()


def _page_copier(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, h, block_size: int):
    """`issue(pages, slot, kv)`: TMA one loop step's K and/or V pages of KV head `h` (one
    `[block_size, d]` box each) into stage `slot`, all arriving on that stage's barrier."""
    plgpu = _plgpu()

    def issue(pages, slot, kv=("k", "v")):
        for j, page in enumerate(pages):
            rows = pl.ds(j * block_size, block_size)
            if "k" in kv:
                plgpu.copy_gmem_to_smem(k_ref.at[page, :, h], k_smem.at[slot, rows],
                                        k_bar.at[slot])
            if "v" in kv:
                plgpu.copy_gmem_to_smem(v_ref.at[page, :, h], v_smem.at[slot, rows],
                                        v_bar.at[slot])
    return issue


def _run_pipeline(consume, issue, page_ids, k_free, v_free, *, num_stages: int, num_iters,
                  warp_specialized: bool) -> None:
    """Fill the first `num_stages` stages and run `consume(k_free, v_free)`, the compute
    warpgroup. Warp specialized, a producer warpgroup refills each stage once the consumer
    has freed it; otherwise `consume(None, None)` refills the stages itself."""
    plgpu = _plgpu()

    def prologue():
        for i in range(num_stages):                      # fill the pipeline
            @pl.when(i < num_iters)
            def _():
                issue(page_ids(i), i)

    if not warp_specialized:
        prologue()
        consume(None, None)
        return

    wg = lax.axis_index("wg")

    @pl.when(wg == 1)
    def _producer():
        prologue()

        def refill(i, carry):
            slot = lax.rem(i, num_stages)
            pages = page_ids(i)
            plgpu.barrier_wait(k_free.at[slot])          # the consumer is done with K
            issue(pages, slot, ("k",))
            plgpu.barrier_wait(v_free.at[slot])
            issue(pages, slot, ("v",))
            return carry

        lax.fori_loop(num_stages, jnp.maximum(num_iters, num_stages), refill, 0)

    @pl.when(wg == 0)
    def _consumer():
        consume(k_free, v_free)


def _tile_ops(q_smem, k_smem, v_smem, block_k: int, interpret: bool):
    """The compute warpgroup's tile operations: `logits(slot)` (S = Q K^T), `add_pv(acc, p,
    slot)` (O += P V), `iota(shape, axis)` and `init(shape, value)` in wgmma's register
    layouts; plain dots and default layouts in interpret mode, which cannot run wgmma."""
    plgpu = _plgpu()

    def logits(slot):
        if interpret:
            return lax.dot_general(q_smem[...], k_smem[slot], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, _transposed(k_smem.at[slot]))
            return acc_ref[...]
        return pl.run_scoped(qk, plgpu.ACC((Q_TILE_ROWS, block_k), jnp.float32))

    def add_pv(acc, p, slot):
        if interpret:
            return acc + lax.dot_general(p, v_smem[slot], (((1,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32)

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p, v_smem.at[slot])
        return pl.run_state(pv)(plgpu.ACC.init(acc))

    def iota(shape, axis):
        if interpret:
            return lax.broadcasted_iota(jnp.int32, shape, axis)
        return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)

    def init(shape, value):
        x = jnp.full(shape, value, jnp.float32)
        if interpret:
            return x
        layout = plgpu.Layout.WGMMA if len(shape) == 2 else plgpu.Layout.WGMMA.reduce(1)
        return plgpu.layout_cast(x, layout)

    return logits, add_pv, iota, init


def _pipeline_scratch(dtype, o_dtype, head_dim: int, block_k: int, num_stages: int,
                      pages_per_compute_block: int, extra=()) -> list:
    """Shared memory and barriers in the kernels' argument order: the query tile, the K and V
    stages, the output tile, `extra`, then the query barrier, one barrier per K / V stage
    (one arrival per page) and the stages' "free" barriers (warp specialized)."""
    plgpu = _plgpu()
    tile = _tile_transforms(dtype)
    return [
        plgpu.SMEM((Q_TILE_ROWS, head_dim), dtype, transforms=tile),
        plgpu.SMEM((num_stages, block_k, head_dim), dtype, transforms=tile),
        plgpu.SMEM((num_stages, block_k, head_dim), dtype, transforms=tile),
        plgpu.SMEM((Q_TILE_ROWS, head_dim), o_dtype, transforms=_tile_transforms(o_dtype)),
        *extra,
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=pages_per_compute_block, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=pages_per_compute_block, num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),          # K stage free (warp specialized)
        plgpu.Barrier(num_barriers=num_stages),          # V stage free
    ]


def _decode_kernel(lens_ref, table_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem, k_smem,
                   v_smem, o_smem, lse_smem, q_bar, k_bar, v_bar, k_free, v_free, *,
                   block_size: int, pages_per_compute_block: int, pages_per_split: int,
                   num_stages: int, q_rows: int, scale: float, warp_specialized: bool,
                   interpret: bool):
    b = lax.axis_index("b")
    h = lax.axis_index("h")
    s = lax.axis_index("s")
    ppcb = pages_per_compute_block
    block_k = block_size * ppcb
    length = lens_ref[b]
    width = table_ref.shape[1]

    first_page = s * pages_per_split
    last_page = jnp.minimum(cdiv(length, block_size), first_page + pages_per_split)
    num_iters = cdiv(jnp.maximum(last_page - first_page, 0), ppcb)
    first_token = first_page * block_size
    num_full = jnp.minimum(jnp.maximum(length - first_token, 0) // block_k, num_iters)

    def page_ids(step):
        """Pool pages of loop step `step` (clamped into the table: a step past the end is
        never issued, but its ids may be read early)."""
        return [table_ref[b, jnp.minimum(first_page + step * ppcb + j, width - 1)]
                for j in range(ppcb)]

    issue = _page_copier(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, h, block_size)
    consume = functools.partial(
        _consume, b, h, s, length, num_iters, num_full, first_token, page_ids, issue, q_ref,
        o_ref, lse_ref, q_smem, k_smem, v_smem, o_smem, lse_smem, q_bar, k_bar, v_bar,
        block_k=block_k, num_stages=num_stages, q_rows=q_rows, scale=scale, interpret=interpret)
    _run_pipeline(consume, issue, page_ids, k_free, v_free, num_stages=num_stages,
                  num_iters=num_iters, warp_specialized=warp_specialized)


def _consume(b, h, s, length, num_iters, num_full, first_token, page_ids, issue, q_ref, o_ref,
             lse_ref, q_smem, k_smem, v_smem, o_smem, lse_smem, q_bar, k_bar, v_bar, k_free,
             v_free, *, block_k: int, num_stages: int, q_rows: int, scale: float,
             interpret: bool):
    """The compute warpgroup: online softmax over the split's steps, then the output.

    Without a producer warpgroup (`k_free is None`) it also refills each stage itself once
    both products have read it; the step's page ids are loaded at its start, so their
    latency hides behind the products."""
    plgpu = _plgpu()
    head_dim = q_smem.shape[-1]
    dtype = q_smem.dtype
    producer = k_free is not None

    # Query rows past the group stay zero (finite logits, never stored).
    q_smem[...] = jnp.zeros(q_smem.shape, dtype)
    plgpu.commit_smem()
    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem.at[pl.ds(0, q_rows)], q_bar.at[0])
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
        start = first_token + i * block_k
        if masked:
            cols = iota((Q_TILE_ROWS, block_k), 1) + start
            x = jnp.where(cols < length, x, -jnp.inf)
        # every step holds a visible key, so the running max is finite
        m_new = jnp.maximum(m, x.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(x - lax.broadcast_in_dim(m_new, x.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        plgpu.barrier_wait(v_bar.at[slot])
        if masked:                                       # zero V rows past the length
            v_tile = v_smem[slot]
            if not interpret:
                v_tile = plgpu.layout_cast(v_tile, plgpu.Layout.WGMMA)
            rows = iota(v_tile.shape, 0) + start
            v_smem[slot] = jnp.where(rows < length, v_tile, jnp.zeros((), dtype))
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
    acc, m, l = lax.fori_loop(num_full, num_iters, functools.partial(step, masked=True), carry)

    has_keys = l > 0
    inv = jnp.where(has_keys, 1.0 / jnp.where(has_keys, l, 1.0), 0.0)
    o_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(o_smem.dtype)
    if lse_ref is not None:
        lse_smem[...] = jnp.where(has_keys, m + jnp.log(jnp.where(has_keys, l, 1.0)) * LOG2E,
                                  -jnp.inf)
    plgpu.commit_smem()
    if lse_ref is None:
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, q_rows)], o_ref.at[b, h])
    else:
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, q_rows)], o_ref.at[b, s, h])
        plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, q_rows)], lse_ref.at[b, s, h])
    plgpu.wait_smem_to_gmem(0)


# Shared memory a Hopper block may use is 227 KiB; keep a margin for barriers and alignment.
SHARED_MEMORY_BUDGET = 220 * 1024


def fit_num_stages(requested: int | None, block_k: int, head_dim: int, itemsize: int) -> int:
    """Pipeline depth: `requested`, else 2, lowered until the K/V stages, the query tile and
    the float32 output tile fit `SHARED_MEMORY_BUDGET`."""
    if requested is not None:
        return requested
    fixed = Q_TILE_ROWS * head_dim * (itemsize + 4) + Q_TILE_ROWS * 4
    stages = 2
    while stages > 1 and stages * 2 * block_k * head_dim * itemsize + fixed > SHARED_MEMORY_BUDGET:
        stages -= 1
    return stages


def unsupported(q, k_pages, k_scale, pages_layout: str, pages_per_compute_block: int,
                interpret: bool) -> str:
    """Why this kernel cannot take these inputs ("" when it can)."""
    if pages_layout != "blocks_first":
        return f"pages_layout {pages_layout!r} (only 'blocks_first')"
    if k_scale is not None or jnp.dtype(k_pages.dtype) not in (jnp.dtype(jnp.bfloat16),
                                                               jnp.dtype(jnp.float16)):
        return f"page dtype {jnp.dtype(k_pages.dtype).name} (only bfloat16 / float16 pages)"
    if q.dtype != k_pages.dtype:
        return f"q dtype {q.dtype} differs from the pages' {k_pages.dtype}"
    head_dim = q.shape[-1]
    if head_dim % 64:
        return f"head_dim {head_dim} (a multiple of 64)"
    group = q.shape[1] // k_pages.shape[2]
    if group > Q_TILE_ROWS:
        return f"{group} query heads per KV head (at most {Q_TILE_ROWS})"
    if (k_pages.shape[1] * pages_per_compute_block) % 64:
        return "block_size * pages_per_compute_block must be a multiple of 64 (wgmma tiles)"
    if interpret and interpret_params() is None:
        return f"no Mosaic GPU interpret mode in JAX {jax.__version__} (needs >= 0.12)"
    return ""


def query_rows(group: int) -> int:
    """Rows of the query copy per KV head: the group rounded up to 8 (a TMA box of whole
    swizzle tiles), at most the 64-row tile."""
    rows = cdiv(group, 8) * 8
    if rows > Q_TILE_ROWS:
        raise ValueError(f"mosaic decode packs at most {Q_TILE_ROWS} query heads per KV head, "
                         f"got {group}")
    return rows


def decode(q, k_pages, v_pages, block_tables, context_lens, *, scale: float,
           pages_per_compute_block: int, pages_per_split: int, num_splits: int,
           num_stages: int, warp_specialized: bool = False, interpret: bool = False):
    """q `[B, Hq, d]` over blocks-first pages; returns `(o [B, Hq, d] f32 or q.dtype)`.

    `block_tables` is already padded to `num_splits * pages_per_split` columns.
    """
    from pallas_kernels.paged_attention.combine import combine_splits
    plgpu = _plgpu()
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    rows = query_rows(group)
    dtype = k_pages.dtype
    if q.dtype != dtype:
        raise ValueError(f"mosaic decode needs q in the pages' dtype, got {q.dtype} and {dtype}")
    q4 = q.reshape(batch, num_kv_heads, group, head_dim)
    if rows != group:
        q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    block_k = block_size * pages_per_compute_block
    split = num_splits > 1
    o_dtype = jnp.float32 if split else dtype
    if split:
        out_type = (jax.ShapeDtypeStruct((batch, num_splits, num_kv_heads, rows, head_dim),
                                         o_dtype),
                    jax.ShapeDtypeStruct((batch, num_splits, num_kv_heads, rows), jnp.float32))
    else:
        out_type = jax.ShapeDtypeStruct((batch, num_kv_heads, rows, head_dim), o_dtype)
    scratch = _pipeline_scratch(dtype, o_dtype, head_dim, block_k, num_stages,
                                pages_per_compute_block,
                                extra=[plgpu.SMEM((Q_TILE_ROWS,), jnp.float32)])
    kernel = functools.partial(
        _decode_kernel, block_size=block_size, pages_per_compute_block=pages_per_compute_block,
        pages_per_split=pages_per_split, num_stages=num_stages, q_rows=rows, scale=scale,
        warp_specialized=warp_specialized, interpret=interpret)
    if not split:
        def body(lens, table, qq, k, v, o, *scr):
            kernel(lens, table, qq, k, v, o, None, *scr)
    else:
        body = kernel
    call = plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch,
        grid=(batch, num_kv_heads, num_splits), grid_names=("b", "h", "s"),
        **(dict(num_threads=2, thread_name="wg") if warp_specialized else {}),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpret else None)
    out = call(context_lens, block_tables, q4, k_pages, v_pages)
    if not split:
        return out[:, :, :group].reshape(batch, num_heads, head_dim)
    o_part, lse = out
    o_part = o_part[:, :, :, :group].reshape(batch, num_splits, num_heads, head_dim)
    lse = lse[:, :, :, :group].reshape(batch, num_splits, num_heads)
    return combine_splits(o_part, lse).astype(q.dtype)

"""What the paged kernels share: input checks and, in-kernel, page -> token slot arithmetic,
row gathers and the online-softmax step.

Both kernels see one layer's pages flattened to tokens, `[num_blocks * block_size, d]` for
one KV head (the head is squeezed away by the BlockSpec), and read a block of `block_k`
consecutive logical tokens of a sequence by gathering through its block table. Every load
and store here indexes with arrays on every axis: that form lowers to Triton pointer
tensors and also runs in Pallas interpret mode (which cannot mix array and slice indices).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def resolve_num_warps(requested: int | None, default: int) -> int:
    """`requested` warps per program, or `default` where None; 0, negative or non-power-of-two
    counts are refused rather than silently replaced."""
    if requested is None:
        return default
    if (isinstance(requested, bool) or not isinstance(requested, int)
            or not is_power_of_two(requested)):
        raise ValueError(f"num_warps must be a power of two >= 1, got {requested!r}")
    return requested


def tile_rows(query_rows: int) -> int:
    """Rows of a program's query tile: a power of two, at least the 16 a dot needs."""
    return max(16, next_power_of_two(query_rows))


def check_heads(num_heads: int, q_dim: int, num_kv_heads: int, head_dim: int,
                block_size: int) -> None:
    """Head and page shapes both kernels need (ValueError naming the field otherwise)."""
    if q_dim != head_dim:
        raise ValueError(f"q head_dim {q_dim} != k_pages head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"q_heads ({num_heads}) must be a multiple of kv_heads ({num_kv_heads})")
    if not is_power_of_two(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if not is_power_of_two(block_size):
        raise ValueError(f"block_size must be a power of two, got {block_size}")


def check_scales(k_pages: jax.Array, k_scale: jax.Array | None, v_scale: jax.Array | None) -> None:
    """Per-token scales come in pairs, shaped like the pages without `head_dim`."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale must be given together")
    if k_scale is not None:
        want = k_pages.shape[:3]
        if k_scale.shape != want or v_scale.shape != want:
            raise ValueError(f"k_scale/v_scale must have shape {want}, got {k_scale.shape} "
                             f"and {v_scale.shape}")


def token_slots(table_ref, row: jax.Array | None, first_page: jax.Array, block_k: int,
                block_size: int) -> jax.Array:
    """Flat pool slots of the `block_k` tokens starting at logical page `first_page`.

    `table_ref` is one sequence's block table (1-D, `row=None`) or all of them (2-D, `row`
    picks the sequence). Each token reads its page id; consecutive tokens hit the same
    entry, which the cache serves.
    """
    j = jnp.arange(block_k, dtype=jnp.int32)
    page_idx = first_page + j // block_size
    pages = table_ref[page_idx] if row is None else table_ref[row, page_idx]
    return pages * block_size + j % block_size


def load_tokens(ref, slots: jax.Array, valid: jax.Array | None, head_dim: int,
                dtype=None) -> jax.Array:
    """Gather rows `slots` of a `[tokens, d]` ref -> `[len(slots), d]` in `dtype` (default:
    the ref's own), invalid rows read as 0.

    8-bit codes are converted once, straight to `dtype`: fp8 (e4m3, e5m2) and int8 codes are
    exact in bf16, so no float32 detour is needed. With `valid=None` (every row in range) the
    load is plain: no mask and no per-element select.
    """
    cols = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    rows_ref = ref.at[slots[:, None], cols]
    if valid is None:
        x = plgpu.load(rows_ref)
    elif jnp.dtype(ref.dtype).itemsize == 1 and jnp.issubdtype(ref.dtype, jnp.floating):
        # Triton cannot splat a fill value into fp8: load (slots are always in bounds:
        # padding pages are the null block), convert, then zero the invalid rows. The select
        # is needed, not cosmetic: fp8 has NaN (and e5m2 inf) codes, and NaN * (p = 0) is
        # NaN in the PV dot.
        x = plgpu.load(rows_ref).astype(jnp.float32 if dtype is None else dtype)
        return jnp.where(valid[:, None], x, jnp.zeros((), x.dtype))
    else:
        mask = jnp.broadcast_to(valid[:, None], (slots.shape[0], head_dim))
        x = plgpu.load(rows_ref, mask=mask, other=0)
    return x if dtype is None else x.astype(dtype)


def load_scales(ref, slots: jax.Array, valid: jax.Array | None) -> jax.Array:
    """Gather per-token dequantization scales of a `[tokens]` ref (invalid -> 0)."""
    if valid is None:
        return plgpu.load(ref.at[slots]).astype(jnp.float32)
    return plgpu.load(ref.at[slots], mask=valid, other=0).astype(jnp.float32)


def dot_precision(dtype) -> jax.lax.Precision | None:
    """fp32 operands get exact (IEEE) products on the GPU; bf16/fp16 use the default."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def init_softmax_state(rows: int, head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Empty online-softmax state: output accumulator, running max (base 2), running sum."""
    return (jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def key_logits(q: jax.Array, k_ref, ks_ref, slots: jax.Array, valid: jax.Array | None,
               precision) -> jax.Array:
    """fp32 `q @ k.T` `[rows, len(slots)]` for the gathered key rows, dequantized by their
    per-token scales when `ks_ref` is given (the scale factors out of the dot)."""
    k = load_tokens(k_ref, slots, valid, q.shape[-1], q.dtype)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)
    if ks_ref is not None:
        s = s * load_scales(ks_ref, slots, valid)[None, :]
    return s


def softmax_step(carry, s: jax.Array, v_ref, vs_ref, slots: jax.Array,
                 valid: jax.Array | None, compute_dtype, precision, *,
                 guard_empty_rows: bool):
    """Fold one key block into the online-softmax state `(acc, m, l)` (base 2).

    `s` holds the block's logits, already scaled by `scale * log2(e)` and -inf where masked.
    With `guard_empty_rows`, a row that has seen no visible key yet (running max -inf) is
    shifted by 0 instead of -inf, so it stays exactly zero rather than NaN; callers whose
    every block has a visible key in every row leave the guard off.
    """
    acc, m, l = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if guard_empty_rows else m_new
    alpha = jnp.exp2(m - shift)
    p = jnp.exp2(s - shift[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    if vs_ref is not None:
        p = p * load_scales(vs_ref, slots, valid)[None, :]
    v = load_tokens(v_ref, slots, valid, acc.shape[-1], compute_dtype)
    pv = jax.lax.dot_general(p.astype(compute_dtype), v, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_new, l


def normalize(acc: jax.Array, l: jax.Array) -> jax.Array:
    """Final output `acc / l`; rows that saw no key (l == 0) are 0, not NaN."""
    has_keys = l > 0
    return acc * jnp.where(has_keys, 1.0 / jnp.where(has_keys, l, 1.0), 0.0)[:, None]


# Shared memory one Triton program may use on Hopper is 227 KiB; keep a margin for Triton's
# own scratch (the reduction and layout-conversion buffers).
SHARED_MEMORY_BUDGET = 200 * 1024


def fit_num_stages(requested: int | None, default: int, *, block_k: int, head_dim: int,
                   kv_itemsize: int, rows: int, q_itemsize: int) -> int:
    """Pipeline depth for a kernel whose loop loads a K and a V tile of `block_k` tokens.

    An explicit `requested` value is kept. Otherwise `default`, lowered until `stages` K+V
    tiles plus the query tile fit `SHARED_MEMORY_BUDGET`: large pages (block size 128-256,
    one page per loop step) would otherwise ask for more shared memory than the GPU has.
    """
    if requested is not None:
        return requested
    per_stage = 2 * block_k * head_dim * kv_itemsize
    fixed = rows * head_dim * q_itemsize
    stages = default
    while stages > 1 and stages * per_stage + fixed > SHARED_MEMORY_BUDGET:
        stages -= 1
    return stages

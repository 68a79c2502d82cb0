"""Batch-invariant forms of the operations whose result for one token could otherwise depend
on the other tokens of its step: `LLM(batch_invariant=True)` and the trainer's side of a
rollout (`dense.token_logprobs`) compute through these, so a request's tokens and logprobs
are bitwise the same whatever shares its batch, however its prefill is chunked, and equal to
what a training loop computes on the whole sequence.

Where the dependence comes from: a matmul library picks its kernel (and its order of
summation) by the number of rows, and so does XLA's code for a row reduction (an RMSNorm, a
log-softmax). Attention kernels split a long context into a number of pieces chosen by the
batch, and the prefill and decode kernels sum in different orders.

What these do instead (the recipe of Thinking Machines' "Defeating Nondeterminism in LLM
Inference", 2025, in jnp):

- **Row tiles.** Every matmul, norm and log-softmax runs over the rows in tiles of a fixed
  `ROW_TILE` rows (`rows_in_tiles`): one compiled shape whatever the row count, so one
  kernel and one order of summation for every row.
- **Attention in fixed key chunks.** Each query reads its keys in chunks of `KEY_CHUNK`
  positions from position 0 on, combined one after the other by the online softmax
  (`chunked_attention`). The chunks a query reads depend only on its own position, so a
  token attends the same way in a prefill chunk, in a decode step and in the trainer's
  dense forward; chunks past the query combine as an exact no-op, so it does not matter
  how many there are.

This is the reference form, exact on any backend and the ground truth of the tests. It is
not fast: on a GPU a matmul tiled this way reads its weights once per tile (see
docs/rollouts.md for what a fast form needs).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

ROW_TILE = 8      # rows per tile of every matmul, norm and log-softmax
KEY_CHUNK = 16    # key positions per chunk of attention


def rows_in_tiles(fn: Callable[[jax.Array], jax.Array], x: jax.Array,
                  tile: int = ROW_TILE) -> jax.Array:
    """`fn` (rows `[tile, n]` -> `[tile, m]`) over the rows of `x [..., n]`, `tile` rows at a
    time: the rows are padded to a multiple of `tile` and mapped over tile by tile, so `fn`
    always sees the same shape."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    padded = jnp.pad(flat, ((0, _padded_rows(n, tile) - n), (0, 0)))
    out = jax.lax.map(lambda t: _fenced(fn, t), padded.reshape(-1, tile, flat.shape[-1]))
    out = out.reshape(-1, out.shape[-1])[:n]
    return out.reshape(*lead, out.shape[-1])


def _padded_rows(n: int, tile: int) -> int:
    """Rows padded to whole tiles, and to two tiles at least: XLA inlines a loop of one
    iteration into the program around it, where its operations could be fused (and
    contracted into fused multiply-adds) differently from a loop body."""
    return max(2, -(-n // tile)) * tile


def _fenced(fn: Callable, args: Any) -> Any:
    """`fn(args)` with optimization barriers before and after: nothing outside is fused into
    it, so it compiles the same in every program."""
    return jax.lax.optimization_barrier(fn(jax.lax.optimization_barrier(args)))


def matmul(x: jax.Array, w: jax.Array, preferred_element_type: Any = None) -> jax.Array:
    """`x [..., k] @ w [k, n]` in row tiles."""
    return rows_in_tiles(lambda t: jnp.dot(t, w, preferred_element_type=preferred_element_type), x)


def dot_general(x: jax.Array, w: jax.Array, dimension_numbers: Any, precision: Any = None,
                preferred_element_type: Any = None) -> jax.Array:
    """`jax.lax.dot_general`'s signature for a projection (`x`'s last axis against `w`'s
    first, no batch axes) in row tiles; what `nn.Dense(dot_general=...)` calls."""
    (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
    if tuple(lhs_c) != (x.ndim - 1,) or tuple(rhs_c) != (0,) or lhs_b or rhs_b:
        raise ValueError(f"batch_invariant.dot_general takes x's last axis against w's first, "
                         f"got {dimension_numbers}")
    w2 = w.reshape(w.shape[0], -1)
    out = rows_in_tiles(lambda t: jax.lax.dot_general(
        t, w2, (((1,), (0,)), ((), ())), precision=precision,
        preferred_element_type=preferred_element_type), x)
    return out.reshape(*x.shape[:-1], *w.shape[1:])


def log_softmax(logits: jax.Array) -> jax.Array:
    """`jax.nn.log_softmax` over the last axis, in row tiles."""
    return rows_in_tiles(lambda t: jax.nn.log_softmax(t, axis=-1), logits)


def chunked_attention(q: jax.Array, q_pos: jax.Array, slots: Callable[[jax.Array, jax.Array], jax.Array],
                      rows: jax.Array, k_flat: jax.Array, v_flat: jax.Array, scale: float,
                      num_chunks: int, window: int | None = None) -> jax.Array:
    """Causal GQA attention, each query over its keys in `KEY_CHUNK`-position chunks.

    q `[T, Hq, d]`, q_pos `[T]` (each query's position: it sees keys at positions <= it,
    and with `window` > q_pos - window); `rows [T, ...]`: what `slots` needs to find a
    query's keys; `slots(rows_tile, key_positions [tile, KEY_CHUNK]) -> [tile, KEY_CHUNK]`
    indices into `k_flat / v_flat [slots, Hkv, d]`. `num_chunks` chunks are read (at least
    enough for the last query; more change nothing): an upper bound, each tile of queries
    stops after the chunk its last query needs. -> `[T, Hq, d]` in q's dtype.
    """
    t, hq, d = q.shape
    hkv = k_flat.shape[1]
    g = hq // hkv
    tile = ROW_TILE
    pad = _padded_rows(t, tile) - t

    def padded(a: jax.Array) -> jax.Array:
        return jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1))

    qs = padded(q).reshape(-1, tile, hkv, g, d)
    ps = padded(q_pos).reshape(-1, tile)
    rs = padded(rows).reshape(-1, tile, *rows.shape[1:])

    def one_tile(args: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        qt, pt, rt = args
        qt = qt.astype(jnp.float32)

        def chunk(carry, j):
            m, l, acc = carry
            key_pos = j * KEY_CHUNK + jnp.arange(KEY_CHUNK, dtype=jnp.int32)[None, :]
            visible = key_pos <= pt[:, None]                          # [tile, C]
            if window is not None:
                visible &= key_pos > pt[:, None] - window
            idx = slots(rt, jnp.broadcast_to(key_pos, (tile, KEY_CHUNK)))
            k = jnp.where(visible[..., None, None], k_flat[idx].astype(jnp.float32), 0.0)
            v = jnp.where(visible[..., None, None], v_flat[idx].astype(jnp.float32), 0.0)
            s = jnp.einsum("thgd,tchd->thgc", qt, k) * scale
            s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - m_safe[..., None])
            l = alpha * l + jnp.sum(p, axis=-1)
            acc = alpha[..., None] * acc + jnp.einsum("thgc,tchd->thgd", p, v)
            return (m_new, l, acc), None

        init = (jnp.full((tile, hkv, g), -jnp.inf, jnp.float32),
                jnp.zeros((tile, hkv, g), jnp.float32),
                jnp.zeros((tile, hkv, g, d), jnp.float32))
        # Only the chunks this tile's last query needs (at least two, at most `num_chunks`,
        # a bound known only at run time): the work follows the context, not the table.
        needed = jnp.clip(jnp.max(pt) // KEY_CHUNK + 1, 2, max(2, num_chunks))
        _, l, acc = jax.lax.fori_loop(
            0, needed, lambda j, c: _fenced(lambda a: chunk(*a)[0], (c, j)), init)
        return acc / jnp.where(l == 0, 1.0, l)[..., None]

    out = jax.lax.map(lambda a: _fenced(one_tile, a), (qs, ps, rs))
    return out.reshape(-1, hq, d)[:t].astype(q.dtype)


def cdiv_chunks(length: int) -> int:
    """Key chunks that cover `length` positions."""
    return -(-length // KEY_CHUNK)

"""What the kernel tests share: tolerances, the error measure and random ragged batches."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

HEAD_DIM = 32
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def rel_err(out, ref) -> float:
    """Relative L2 error of `out` against `ref`, in float64."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def ragged_case(seed, *, q_lens, ctx_lens, q_heads, kv_heads, block_size, pad_tokens, dtype,
                head_dim=HEAD_DIM):
    """A fresh random ragged batch over a random pool, for the ragged kernels.

    Each sequence's pages are a random permutation of pool blocks, its unused table entries
    the null block 0; sequence s has `q_lens[s]` new tokens ending at `ctx_lens[s]` keys;
    `pad_tokens` padding rows follow the last sequence. Returns `(q, k, v, block_tables,
    context_lens, cu_q_lens, real_tokens)`, arrays in `dtype` / int32.
    """
    rng = np.random.default_rng(seed)
    seqs = len(q_lens)
    max_blocks = max(1, max(-(-c // block_size) for c in ctx_lens))
    num_blocks = seqs * max_blocks + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    tables = rng.permutation(np.arange(1, num_blocks))[: seqs * max_blocks]
    tables = tables.reshape(seqs, max_blocks).astype(np.int32)
    for s, c in enumerate(ctx_lens):
        tables[s, -(-c // block_size):] = 0
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tokens = int(cu[-1]) + pad_tokens
    q = rng.standard_normal((tokens, q_heads, head_dim)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(tables), jnp.asarray(ctx_lens, jnp.int32), jnp.asarray(cu), int(cu[-1]))


def decode_case(seed, *, batch, q_heads, kv_heads, block_size, max_blocks, lens, dtype,
                head_dim=HEAD_DIM):
    """A fresh random decode batch: `(q, k_pages, v_pages, block_tables, context_lens)`.

    Each sequence's pages are a random permutation of pool blocks; the table entries past its
    length are the null block 0. Tables and lengths are int32 numpy arrays."""
    rng = np.random.default_rng(seed)
    num_blocks = batch * max_blocks + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    v = jnp.asarray(rng.standard_normal(shape), dtype)
    q = jnp.asarray(rng.standard_normal((batch, q_heads, head_dim)), dtype)
    tables = rng.permutation(np.arange(1, num_blocks))[: batch * max_blocks]
    tables = tables.reshape(batch, max_blocks).astype(np.int32)
    for b, n in enumerate(lens):
        tables[b, -(-int(n) // block_size):] = 0
    return q, k, v, tables, np.asarray(lens, np.int32)

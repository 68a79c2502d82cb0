"""The "pallas" attention backend: paxkv's Pallas GPU kernels behind `attention.attend`.

Decode steps (every sequence has exactly one new token) go to the decode kernel, which
packs each sequence's GQA heads and splits long contexts; any other step (prefill, chunked
prefill, mixed) goes to the ragged kernel. Same semantics as `reference_attention` for every
real token; padding tokens (past `cu_q_lens[-1]`) get finite outputs that callers ignore.
Off the GPU (tests) the kernels run in Pallas interpret mode.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import paged_attention, rope_paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from paxkv.model.batch import StepBatch


def _token_seq_ids(cu_q_lens: jax.Array, num_tokens: int) -> jax.Array:
    """Sequence of each token (tokens past the last sequence -> the last row)."""
    num_seqs = cu_q_lens.shape[0] - 1
    ids = jnp.searchsorted(cu_q_lens[1:], jnp.arange(num_tokens, dtype=jnp.int32), side="right")
    return jnp.minimum(ids, num_seqs - 1).astype(jnp.int32)


def attend(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, batch: StepBatch, *,
           scale: float, decode_only: bool, k_scale: jax.Array | None = None,
           v_scale: jax.Array | None = None, interpret: bool | None = None) -> jax.Array:
    """q `[T, Hq, d]` -> `[T, Hq, d]` over one layer's pages (see `attention.attend`).

    `decode_only` (static): every real sequence has one new token, at `cu_q_lens[s]`.
    `interpret` defaults to True off the GPU.
    """
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    num_tokens = q.shape[0]
    if decode_only and num_tokens == batch.context_lens.shape[0]:
        # The runner's decode layout: token s is sequence s's new token (cu_q_lens counts one
        # per real sequence; padding rows have context 0, so the kernel writes zeros for
        # them). No gathers: they were two extra launches per layer.
        return paged_attention(q, k_pages, v_pages, batch.block_tables, batch.context_lens,
                               k_scale, v_scale, scale=float(scale), interpret=interpret)
    if decode_only:
        # One query row per sequence (padding sequences read some row; their context is 0,
        # so the kernel writes zeros for them), then back to token order.
        rows = jnp.clip(batch.cu_q_lens[:-1], 0, num_tokens - 1)
        out = paged_attention(q[rows], k_pages, v_pages, batch.block_tables,
                              batch.context_lens, k_scale, v_scale, scale=float(scale),
                              interpret=interpret)
        return out[_token_seq_ids(batch.cu_q_lens, num_tokens)]
    return ragged_paged_attention(q, k_pages, v_pages, batch.block_tables, batch.context_lens,
                                  batch.cu_q_lens, k_scale, v_scale, scale=float(scale),
                                  interpret=interpret)


# Decode steps of at most this many rows (the GPU's smallest decode bucket) rotate and write
# inside the attention kernel. Measured on an H200 with Llama-3-8B (results/one_stream.md):
# one stream 240.3 against 234.0 tok/s, but a full batch of 256 lost 1.8% (65.35 against
# 66.57 requests/s); likely, though no trace was taken there, because each of thousands of
# attention programs waits on its own rotation before its first page load.
ROPE_DECODE_MAX_ROWS = 8


def fuses_rope_decode(qkv: jax.Array, k_pages: jax.Array, batch: StepBatch, *,
                      decode_only: bool, quantized: bool) -> bool:
    """Whether `rope_attend` serves this step: the runner's decode layout (token s is sequence
    s's new token) of at most `ROPE_DECODE_MAX_ROWS` rows, unquantized pages, heads as the
    RoPE kernel takes them."""
    from pallas_kernels.layer_ops.rope_kv_write import supported
    kv_heads = k_pages.shape[2]
    return (decode_only and not quantized and qkv.shape[0] == batch.context_lens.shape[0]
            and qkv.shape[0] <= ROPE_DECODE_MAX_ROWS
            and supported(qkv.shape[1] - 2 * kv_heads, kv_heads, qkv.shape[2]))


def rope_attend(qkv: jax.Array, cos: jax.Array, sin: jax.Array, k_pages: jax.Array,
                v_pages: jax.Array, batch: StepBatch, *, scale: float,
                interpret: bool | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A decode step's RoPE, KV write and attention in one kernel (`rope_paged_attention`):
    packed unrotated heads `[S, Hq + 2 Hkv, d]` -> (`[S, Hq, d]`, k_pages, v_pages). Only where
    `fuses_rope_decode`."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return rope_paged_attention(qkv, cos, sin, batch.slot_mapping, k_pages, v_pages,
                                batch.block_tables, batch.context_lens, scale=float(scale),
                                interpret=interpret)

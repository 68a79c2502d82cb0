"""Token sampling on the device: greedy, temperature, top-k, top-p, min-p, logprobs.

Sampling runs inside the jitted step, so logits never travel to the host: only the chosen
ids (and requested logprobs) do. Each row's randomness comes from (seed, step): a request's
tokens depend on its own seed and on how many tokens it has generated, never on what else
shares the batch.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class SamplingTensors(NamedTuple):
    """Per-row sampling parameters; row r samples from logits row `logits_rows[r]`."""

    logits_rows: jax.Array   # [R] int32
    temperature: jax.Array   # [R] float32 (0 = greedy)
    top_k: jax.Array         # [R] int32 (<= 0 = disabled)
    top_p: jax.Array         # [R] float32
    min_p: jax.Array         # [R] float32
    seeds: jax.Array         # [R] int32
    steps: jax.Array         # [R] int32, tokens this sample has generated so far
    banned: jax.Array        # [R, NB] int32 token ids forced to -inf (min_tokens); -1 = none


class SampleResult(NamedTuple):
    tokens: jax.Array          # [R] int32
    logprobs: jax.Array        # [R] float32, log p(token) under the raw model distribution
    top_ids: jax.Array         # [R, K] int32, the K most likely tokens (K = num_logprobs)
    top_logprobs: jax.Array    # [R, K] float32


def _filtered_sample(x: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                     key: jax.Array) -> jax.Array:
    """Sample one id from logits row `x` (already temperature-scaled) after k/p/min-p filters."""
    vocab = x.shape[0]
    order = jnp.argsort(-x)
    vals = x[order]
    probs = jax.nn.softmax(vals)
    rank = jnp.arange(vocab)
    keep = (top_k <= 0) | (rank < top_k)
    cum_before = jnp.cumsum(probs) - probs
    keep &= cum_before < top_p
    keep &= probs >= min_p * probs[0]
    keep = keep.at[0].set(True)
    gumbel = jax.random.gumbel(key, (vocab,), jnp.float32)
    choice = jnp.argmax(jnp.where(keep, vals + gumbel, -jnp.inf))
    return order[choice].astype(jnp.int32)


def sample(logits: jax.Array, st: SamplingTensors, *, all_greedy: bool,
           num_logprobs: int) -> SampleResult:
    """logits `[S, V]` float32 -> one token per sampling row. `all_greedy`, `num_logprobs` static."""
    rows = logits[st.logits_rows].astype(jnp.float32)             # [R, V]
    raw_logprobs = jax.nn.log_softmax(rows, axis=-1)
    vocab = rows.shape[-1]
    if st.banned.shape[1]:
        r = jnp.broadcast_to(jnp.arange(rows.shape[0])[:, None], st.banned.shape)
        ids = jnp.where(st.banned >= 0, st.banned, vocab)          # vocab = out of range: dropped
        rows = rows.at[r, ids].set(-jnp.inf, mode="drop")
    greedy_ids = jnp.argmax(rows, axis=-1).astype(jnp.int32)
    if all_greedy:
        tokens = greedy_ids
    else:
        keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(st.seeds, st.steps)
        temp = jnp.where(st.temperature > 0, st.temperature, 1.0)[:, None]
        sampled = jax.vmap(_filtered_sample)(rows / temp, st.top_k, st.top_p, st.min_p, keys)
        tokens = jnp.where(st.temperature > 0, sampled, greedy_ids)
    chosen = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    if num_logprobs:
        top_lp, top_ids = jax.lax.top_k(raw_logprobs, num_logprobs)
    else:
        top_lp = jnp.zeros((rows.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((rows.shape[0], 0), jnp.int32)
    return SampleResult(tokens, chosen, top_ids.astype(jnp.int32), top_lp)

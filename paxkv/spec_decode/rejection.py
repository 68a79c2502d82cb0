"""The verify step's sampler: which draft tokens to keep, and the token after them, so that
the emitted tokens follow the target model's distribution exactly (rejection sampling,
Leviathan et al., 2023; Chen et al., 2023). Pure JAX, jittable, per row.

Per row, for drafts d_1..d_n (n <= k) proposed with probabilities q_i, and the target's
processed distributions p_0..p_n at the verified positions (p_i: after d_1..d_i):

- draft i is kept while u_i < p_{i-1}(d_i) / q_i(d_i) (u_i uniform), the first refusal ends it;
- at the first refusal the next token is drawn from max(p_{i-1} - q_i, 0), renormalised;
- when all n are kept, a bonus token is drawn from p_n.

A proposer without probabilities (n-gram lookup) is a point mass: q_i(d_i) = 1. A greedy
row's p is one-hot at the argmax, so a draft is kept exactly when it equals the argmax and
the token after is the argmax: greedy output is the same with or without speculation.

Randomness comes from (seed, step + i), as the ordinary sampler's, so a seeded request is
reproducible; the token after the drafts is drawn by Gumbel-max like the ordinary sampler.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class VerifyResult(NamedTuple):
    tokens: jax.Array        # [R, k + 1] int32: kept drafts, then the drawn token; -1 after
    num_emitted: jax.Array   # [R] int32: kept drafts + 1


def target_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                 top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """The distribution the ordinary sampler draws from: logits `[N, V]` with per-row
    temperature (0: greedy, one-hot at the argmax), top-k, top-p and min-p (as
    `sampler._filtered_sample` keeps tokens) -> probabilities `[N, V]` float32."""
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    temp = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    x = logits / temp
    order = jnp.argsort(-x, axis=-1)
    vals = jnp.take_along_axis(x, order, axis=-1)
    probs = jax.nn.softmax(vals, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= (top_p[:, None] >= 1.0) | (cum_before < top_p[:, None])
    keep &= probs >= min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    kept = jnp.where(keep, probs, 0.0)
    kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
    sampled = jnp.zeros_like(kept).at[jnp.arange(kept.shape[0])[:, None], order].set(kept)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)
    return jnp.where((temperature > 0)[:, None], sampled, greedy)


def _draw(probs: jax.Array, key: jax.Array) -> jax.Array:
    """One id from `probs [V]` by Gumbel-max (zero-probability ids never win)."""
    gumbel = jax.random.gumbel(key, probs.shape, jnp.float32)
    return jnp.argmax(jnp.where(probs > 0, jnp.log(probs) + gumbel, -jnp.inf)).astype(jnp.int32)


def _verify_row(p: jax.Array, drafts: jax.Array, n: jax.Array, q: jax.Array | None,
                seed: jax.Array, step: jax.Array) -> tuple[jax.Array, jax.Array]:
    k = drafts.shape[0]
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(seed), step + i))(
        jnp.arange(k + 1))
    uniform = jax.vmap(lambda kk: jax.random.uniform(jax.random.fold_in(kk, 1)))(keys[:k])
    p_draft = jnp.take_along_axis(p[:k], drafts[:, None], axis=-1)[:, 0]       # p_{i-1}(d_i)
    q_draft = (jnp.ones((k,), jnp.float32) if q is None
               else jnp.take_along_axis(q, drafts[:, None], axis=-1)[:, 0])
    accept = (uniform * q_draft < p_draft) & (jnp.arange(k) < n)
    kept = jnp.argmin(jnp.concatenate([accept, jnp.zeros((1,), bool)]))        # first refusal
    q_at = (jax.nn.one_hot(drafts, p.shape[-1], dtype=jnp.float32) if q is None else q)
    q_at = jnp.concatenate([q_at, jnp.zeros_like(p[:1])])[kept]
    residual = jnp.maximum(p[kept] - jnp.where(kept < n, 1.0, 0.0) * q_at, 0.0)
    # A refusal leaves mass in the residual whenever p and q differ; float rounding could
    # empty it, and then p itself is the right fallback.
    residual = jnp.where(jnp.sum(residual) > 0, residual, p[kept])
    last = _draw(residual, keys[kept])
    pos = jnp.arange(k + 1)
    tokens = jnp.where(pos < kept, jnp.concatenate([drafts, jnp.zeros((1,), jnp.int32)]), -1)
    tokens = jnp.where(pos == kept, last, tokens).astype(jnp.int32)
    return tokens, (kept + 1).astype(jnp.int32)


def rejection_sample(p: jax.Array, drafts: jax.Array, num_drafts: jax.Array, seeds: jax.Array,
                     steps: jax.Array, q: jax.Array | None = None) -> VerifyResult:
    """Verify each row's drafts.

    p `[R, k + 1, V]`: the target's processed distributions at the k + 1 verified positions
    (`target_probs`); drafts `[R, k]` int32 (entries past `num_drafts [R]` are ignored);
    q `[R, k, V]`: the proposer's distributions, None for a point mass (n-gram); seeds and
    steps `[R]`: the rows' seeds and output lengths before this step.
    """
    if q is None:
        tokens, emitted = jax.vmap(lambda *a: _verify_row(*a[:3], None, *a[3:]))(
            p, drafts, num_drafts, seeds, steps)
    else:
        tokens, emitted = jax.vmap(_verify_row)(p, drafts, num_drafts, q, seeds, steps)
    return VerifyResult(tokens, emitted)

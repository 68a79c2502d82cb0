"""Token sampling on the device: greedy, temperature, top-k, top-p, min-p, logprobs, and the
logits processors of `sampling/processors.py` (penalties, bias, bans, grammar masks).

Sampling runs inside the jitted step, so logits never travel to the host: only the chosen
ids (and requested logprobs) do. Each row's randomness comes from (seed, step): a request's
tokens depend on its own seed and on how many tokens it has generated, never on what else
shares the batch.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from paxkv.sampling.rows import SAMPLING_MODES


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
    # Optional features: a zero-sized dimension means no row of the step uses it (see
    # sampling/processors.py for their layouts).
    penalties: jax.Array     # [R or 0, 3] float32 presence, frequency, repetition
    history: jax.Array       # [R or 0, L] int32 tokens before the fed one (a window)
    history_meta: jax.Array  # [R or 0, 2] int32 (tokens in use, output start in the window)
    bias_ids: jax.Array      # [R, NB] int32 logit_bias ids, -1 = padding
    bias_values: jax.Array   # [R, NB] float32
    allowed: jax.Array       # [R, NA] int32 allowed_token_ids, -1 = padding (all -1: no limit)
    bad_words: jax.Array     # [R, NW, WL] int32 right-aligned bad words, -1 = padding
    mask_rows: jax.Array     # [R or 0] int32 row of `masks` constraining this row, -1 = none
    masks: jax.Array         # [M, ceil(V/32)] int32 token bitmasks (structured outputs)
    prompt_positions: jax.Array  # [P] int32 rows of the logits whose prompt logprobs are wanted
    prompt_targets: jax.Array    # [P] int32 the prompt token each of those rows predicts


class SampleResult(NamedTuple):
    tokens: jax.Array          # [R] int32
    logprobs: jax.Array        # [R] float32, log p(token) under the raw model distribution
    top_ids: jax.Array         # [R, K] int32, the K most likely tokens (K = num_logprobs)
    top_logprobs: jax.Array    # [R, K] float32
    prompt_logprobs: jax.Array      # [P] float32, log p(prompt token | the tokens before it)
    prompt_top_ids: jax.Array       # [P, KP] int32
    prompt_top_logprobs: jax.Array  # [P, KP] float32


def _filtered_sample(x: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                     gumbel: jax.Array) -> jax.Array:
    """Sample one id from logits row `x` (already temperature-scaled) after k/p/min-p filters.

    `gumbel` holds one draw per token id, the same draws the unfiltered path uses, so a row
    whose filters are all off picks the same token on either path (Gumbel-max over the same
    values): its tokens do not depend on whether a batch-mate asked for a filter.
    """
    vocab = x.shape[0]
    order = jnp.argsort(-x)
    vals = x[order]
    probs = jax.nn.softmax(vals)
    rank = jnp.arange(vocab)
    keep = (top_k <= 0) | (rank < top_k)
    cum_before = jnp.cumsum(probs) - probs
    keep &= (top_p >= 1.0) | (cum_before < top_p)    # float sums can reach 1 before the tail
    keep &= probs >= min_p * probs[0]
    keep = keep.at[0].set(True)
    choice = jnp.argmax(jnp.where(keep, vals + gumbel[order], -jnp.inf))
    return order[choice].astype(jnp.int32)


def process_logits(rows: jax.Array, st: SamplingTensors, fed_tokens: jax.Array) -> jax.Array:
    """Apply the step's logits processors in vLLM's order: allowed ids, bad words, bias and
    min_tokens bans, then penalties. Each runs only if some row of the step uses it (static)."""
    from paxkv.sampling import processors as proc
    vocab = rows.shape[-1]
    if st.allowed.shape[1]:
        rows = proc.apply_allowed_token_ids(rows, st.allowed)
    if st.history.shape[0]:
        tokens, in_use, is_output = proc.contexts(st.history, st.history_meta, fed_tokens)
    if st.bad_words.shape[1]:
        if st.bad_words.shape[2] > 1:
            rows = proc.apply_bad_words(rows, st.bad_words, tokens, is_output, st.history_meta[:, 0])
        else:
            rows = proc.apply_bad_words(rows, st.bad_words, None, None, None)
    if st.bias_ids.shape[1]:
        rows = proc.apply_logit_bias(rows, st.bias_ids, st.bias_values)
    if st.banned.shape[1]:
        r = jnp.broadcast_to(jnp.arange(rows.shape[0])[:, None], st.banned.shape)
        ids = jnp.where(st.banned >= 0, st.banned, vocab)          # vocab = out of range: dropped
        rows = rows.at[r, ids].set(-jnp.inf, mode="drop")
    if st.mask_rows.shape[0]:
        rows = proc.apply_token_bitmask(rows, st.mask_rows, st.masks)
    if st.penalties.shape[0]:
        rows = proc.apply_penalties(rows, st.penalties, tokens, in_use, is_output)
    return rows


def log_softmax_rows(rows: jax.Array, invariant: bool) -> jax.Array:
    """Log-softmax over the last axis; in the batch-invariant form when `invariant`."""
    if invariant:     # row tiles: a row's logprobs do not depend on the other rows
        from paxkv.model import batch_invariant as bi
        return bi.log_softmax(rows)
    return jax.nn.log_softmax(rows, axis=-1)


def _prompt_logprobs(logits: jax.Array, st: SamplingTensors, k: int,
                     invariant: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-softmax of the last P logits rows (the prompt positions), at their targets and top k."""
    p = st.prompt_positions.shape[0]
    if not p:
        return (jnp.zeros((0,), jnp.float32), jnp.zeros((0, k), jnp.int32),
                jnp.zeros((0, k), jnp.float32))
    lp = log_softmax_rows(logits[logits.shape[0] - p:].astype(jnp.float32), invariant)
    own = jnp.take_along_axis(lp, st.prompt_targets[:, None], axis=-1)[:, 0]
    if k:
        top_lp, top_ids = jax.lax.top_k(lp, k)
    else:
        top_lp, top_ids = jnp.zeros((p, 0), jnp.float32), jnp.zeros((p, 0), jnp.int32)
    return own, top_ids.astype(jnp.int32), top_lp


def sample(logits: jax.Array, st: SamplingTensors, *, mode: str, num_logprobs: int,
           num_prompt_logprobs: int = 0, fed_tokens: jax.Array | None = None,
           invariant: bool = False) -> SampleResult:
    """logits `[S(+P), V]` float32 -> one token per sampling row. `mode`, `num_logprobs` and
    `num_prompt_logprobs` are static; `mode` is the step's cheapest sufficient path
    (`SAMPLING_MODES`): every row greedy; some rows sampled, none filtered (Gumbel-max over
    the whole vocabulary, no sort); some row with top-k, top-p or min-p (one sort per row).
    `fed_tokens [R]` is the token each row's step fed (needed only when `st.history` is in
    use); the last P logits rows are prompt positions. `invariant` (static): logprobs in the
    batch-invariant form (`ModelConfig.batch_invariant`)."""
    if mode not in SAMPLING_MODES:
        raise ValueError(f"mode must be one of {SAMPLING_MODES}, got {mode!r}")
    rows = logits[st.logits_rows].astype(jnp.float32)             # [R, V]
    raw_logprobs = log_softmax_rows(rows, invariant)
    rows = process_logits(rows, st, fed_tokens)
    greedy_ids = jnp.argmax(rows, axis=-1).astype(jnp.int32)
    if mode == "greedy":
        tokens = greedy_ids
    else:
        vocab = rows.shape[-1]
        keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(st.seeds, st.steps)
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)
        temp = jnp.where(st.temperature > 0, st.temperature, 1.0)[:, None]
        if mode == "random":
            sampled = jnp.argmax(rows / temp + gumbel, axis=-1).astype(jnp.int32)
        else:
            sampled = jax.vmap(_filtered_sample)(rows / temp, st.top_k, st.top_p, st.min_p, gumbel)
        tokens = jnp.where(st.temperature > 0, sampled, greedy_ids)
    chosen = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    if num_logprobs:
        top_lp, top_ids = jax.lax.top_k(raw_logprobs, num_logprobs)
    else:
        top_lp = jnp.zeros((rows.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((rows.shape[0], 0), jnp.int32)
    return SampleResult(tokens, chosen, top_ids.astype(jnp.int32), top_lp,
                        *_prompt_logprobs(logits, st, num_prompt_logprobs, invariant))

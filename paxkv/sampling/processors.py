"""Per-row logits processors applied on the device inside the jitted sampler (pure JAX).

Every input is a per-row tensor packed with the rest of the step. A feature no row of the
step uses arrives with a zero-sized dimension, and the sampler tests that shape (static under
jit) before calling its processor: a feature switched off compiles to nothing.

Token contexts. Penalties and multi-token bad words look at the tokens a row has seen. The
host sends `history [R, L]`, the tokens *before* the one this step feeds (a window ending
there), and the device appends the fed token, which it reads from the step's own input. So an
engine whose host learns the previous step's token one step late packs the same arrays: the
token it does not know yet is exactly the one the device already holds.
`history_meta [R, 2]` is (tokens of `history` in use, index in the window where the outputs
start; <= 0 when the whole window is output).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _row_index(shape: tuple[int, ...]) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(shape[0])[:, None], shape)


def _ids_or_drop(ids: jax.Array, valid: jax.Array, vocab: int) -> jax.Array:
    """Ids where valid, else `vocab` (out of range: a scatter with mode="drop" skips it).
    Negative ids must never reach a scatter: they would wrap around to the end."""
    return jnp.where(valid & (ids >= 0), ids, vocab)


def contexts(history: jax.Array, meta: jax.Array, fed: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens `[R, L+1]` with the fed token appended, in use `[R, L+1]`, is an output `[R, L+1]`)."""
    rows, width = history.shape
    pos = jnp.arange(width + 1)[None, :]
    used = meta[:, 0:1]
    tokens = jnp.concatenate([history, jnp.zeros((rows, 1), history.dtype)], axis=1)
    tokens = jnp.where(pos == used, fed[:, None], tokens)
    in_use = pos <= used
    return tokens, in_use, in_use & (pos >= meta[:, 1:2])


def _output_counts(keys: jax.Array, is_output: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sorted `keys [R, C]`, how often each sorted key occurs among the outputs).

    Sorting each row's context puts equal ids side by side; an occurrence count is then the
    difference of a running sum across its run of equal ids. Cost O(R C log C), free of V.
    """
    width = keys.shape[1]
    keys, outs = jax.lax.sort((keys, is_output.astype(jnp.int32)), dimension=1, num_keys=1)
    pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None, :], keys.shape)
    edge = keys[:, 1:] != keys[:, :-1]
    first = jnp.concatenate([jnp.ones_like(edge[:, :1]), edge], axis=1)   # a run starts here
    last = jnp.concatenate([edge, jnp.ones_like(edge[:, :1])], axis=1)    # a run ends here
    run_start = jax.lax.cummax(jnp.where(first, pos, 0), axis=1)
    run_end = jax.lax.cummin(jnp.where(last, pos, width - 1), axis=1, reverse=True)
    running = jnp.cumsum(outs, axis=1)
    before = jnp.take_along_axis(running - outs, run_start, axis=1)
    return keys, jnp.take_along_axis(running, run_end, axis=1) - before


def apply_penalties(logits: jax.Array, penalties: jax.Array, tokens: jax.Array, in_use: jax.Array,
                    is_output: jax.Array) -> jax.Array:
    """Repetition penalty over prompt and output (transformers' RepetitionPenaltyLogitsProcessor),
    then OpenAI's frequency and presence penalties over the output. `penalties [R, 3]` =
    (presence, frequency, repetition); the neutral row (0, 0, 1) leaves its logits unchanged.

    Only the logits of the context's tokens change, so they are gathered, penalized and set
    back: `[R, C]` work (C = context width) instead of dense `[R, V]` seen/count arrays. A
    token repeated in the context is set several times to the same value.
    """
    vocab = logits.shape[1]
    valid = in_use & (tokens >= 0) & (tokens < vocab)
    keys, counts = _output_counts(jnp.where(valid, tokens, vocab), is_output & valid)
    r = _row_index(keys.shape)
    x = jnp.take_along_axis(logits, jnp.minimum(keys, vocab - 1), axis=1)
    presence, frequency, repetition = penalties[:, 0:1], penalties[:, 1:2], penalties[:, 2:3]
    penalized = jnp.where(x > 0, x / repetition, x * repetition)
    c = counts.astype(jnp.float32)
    penalized = penalized - frequency * c - presence * (c > 0).astype(jnp.float32)
    return logits.at[r, keys].set(penalized, mode="drop")


def apply_logit_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """Add `values [R, N]` at token `ids [R, N]` (-1 = padding)."""
    vocab = logits.shape[1]
    return logits.at[_row_index(ids.shape), _ids_or_drop(ids, ids >= 0, vocab)].add(values, mode="drop")


def apply_allowed_token_ids(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """Rows whose `allowed [R, N]` list is non-empty keep only those ids (-1 = padding)."""
    rows, vocab = logits.shape
    keep = jnp.zeros((rows, vocab), jnp.bool_).at[
        _row_index(allowed.shape), _ids_or_drop(allowed, allowed >= 0, vocab)].set(True, mode="drop")
    active = allowed[:, 0:1] >= 0
    return jnp.where(active & ~keep, -jnp.inf, logits)


def apply_bad_words(logits: jax.Array, words: jax.Array, tokens: jax.Array, is_output: jax.Array,
                    used: jax.Array) -> jax.Array:
    """Ban each bad word's last token where the output ends with the tokens before it.

    `words [R, N, W]` are right-aligned token ids, -1 on the left of shorter words (and whole
    rows of -1 for padding). `tokens`/`is_output` come from `contexts`; `used [R]` is the index
    of the fed token in them. A one-token word is banned always.
    """
    rows, vocab = logits.shape
    width = words.shape[2]
    if width > 1:
        offsets = jnp.arange(width - 1) - (width - 2)                  # ..., -1, 0 (= fed token)
        at = used[:, None] + offsets[None, :]                          # [R, W-1]
        safe = jnp.clip(at, 0, tokens.shape[1] - 1)
        tail = jnp.take_along_axis(tokens, safe, axis=1)
        tail_ok = (at >= 0) & jnp.take_along_axis(is_output, safe, axis=1)
        prefix = words[:, :, :-1]                                       # [R, N, W-1]
        match = jnp.all((prefix < 0) | ((prefix == tail[:, None, :]) & tail_ok[:, None, :]), axis=-1)
    else:
        match = jnp.ones(words.shape[:2], jnp.bool_)
    last = words[:, :, -1]
    r = _row_index(last.shape)
    return logits.at[r, _ids_or_drop(last, match, vocab)].set(-jnp.inf, mode="drop")


def apply_token_bitmask(logits: jax.Array, mask_rows: jax.Array, masks: jax.Array) -> jax.Array:
    """Rows with `mask_rows[r] >= 0` keep the tokens whose bit is set in `masks[mask_rows[r]]`
    (`[M, ceil(V / 32)]` int32, llguidance's layout: token t is bit t % 32 of word t // 32)."""
    vocab = logits.shape[1]
    words = masks[jnp.maximum(mask_rows, 0)]                            # [R, W]
    t = jnp.arange(vocab)
    bits = (jnp.take(words, t // 32, axis=1) >> (t % 32)[None, :]) & 1
    return jnp.where((mask_rows[:, None] >= 0) & (bits == 0), -jnp.inf, logits)

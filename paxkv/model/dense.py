"""The dense (unpaged) forward: the reference the paged engine is tested against, and the
training path.

Three uses of one function, `dense_forward`:

- `cache=None`: plain causal attention over the given tokens. Differentiable; this is what a
  training loop calls (`dense_forward(params, tokens, cfg)[0]`).
- with a `DenseCache` (contiguous `[B, max_len, kv_heads, head_dim]` per layer): the new
  tokens' K/V are written at `start_pos + t` (per row) and every query attends to cached keys
  at positions `<=` its own. Right-padded ragged batches work: a row's padding writes
  garbage past its end, and that garbage is overwritten by the row's next real token before
  any query can see it.
- `greedy_generate`: a small jitted prefill + decode loop on the dense cache.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from paxkv.config import ModelConfig
from paxkv.model.layers import DecoderLM, params_dtype


class DenseCache(NamedTuple):
    """Contiguous KV cache: per layer `[batch, max_len, kv_heads, head_dim]`."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int, dtype: Any = jnp.float32) -> DenseCache:
    """Zero-filled dense cache for `batch_size` rows of up to `max_len` tokens."""
    if batch_size < 1 or max_len < 1:
        raise ValueError(f"init_cache: batch_size and max_len must be >= 1, got {batch_size}, {max_len}")
    shape = (batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
    return DenseCache(tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                      tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)))


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                      k_pos: jax.Array, scale: float, window: int | None = None) -> jax.Array:
    """GQA attention, queries see keys with `k_pos <= q_pos` (and, with `window`,
    `k_pos > q_pos - window`); fp32 scores and softmax.

    q `[B, Tq, Hq, d]`, k/v `[B, Tk, Hkv, d]`, q_pos `[B, Tq]`, k_pos `[Tk]` -> `[B, Tq, Hq, d]`.
    """
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, tq, hkv, hq // hkv, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(q.dtype),
                        preferred_element_type=jnp.float32) * scale
    visible = k_pos[None, None, :] <= q_pos[:, :, None]               # [B, Tq, Tk]
    if window is not None:
        visible &= k_pos[None, None, :] > q_pos[:, :, None] - window
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # Probabilities stay float32 (as in the paged reference attention), so the dense path is
    # a faithful reference for bf16 too; v is upcast for the product.
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v.astype(jnp.float32))
    return out.reshape(b, tq, hq, d).astype(q.dtype)


def _invariant(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, scale: float,
               window: int | None) -> jax.Array:
    """`grouped_attention` in the batch-invariant form (`batch_invariant.chunked_attention`):
    q `[B, Tq, Hq, d]` over k/v `[B, Tk, Hkv, d]` at key positions 0..Tk-1."""
    from paxkv.model import batch_invariant as bi
    b, tq, hq, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    rows = jnp.repeat(jnp.arange(b, dtype=jnp.int32), tq)[:, None]

    def slots(r: jax.Array, key_pos: jax.Array) -> jax.Array:
        return r * tk + jnp.minimum(key_pos, tk - 1)

    out = bi.chunked_attention(q.reshape(b * tq, hq, d), q_pos.reshape(-1), slots, rows,
                               k.reshape(b * tk, hkv, d), v.reshape(b * tk, hkv, d), scale,
                               bi.cdiv_chunks(tk), window)
    return out.reshape(b, tq, hq, d)


def _positions(start_pos: int | jax.Array, batch: int, length: int) -> jax.Array:
    start = jnp.broadcast_to(jnp.asarray(start_pos, jnp.int32).reshape(-1, 1), (batch, 1))
    return start + jnp.arange(length, dtype=jnp.int32)[None, :]


def dense_forward(params: Any, token_ids: jax.Array, cfg: ModelConfig,
                  cache: DenseCache | None = None, start_pos: int | jax.Array = 0,
                  hidden_layers: tuple[int, ...] = ()) -> tuple[jax.Array, ...]:
    """token_ids `[B, T]` -> (logits `[B, T, vocab]` float32, updated cache or None), and
    with `hidden_layers` (static) the residual stream at every token, `[B * T,
    len(hidden_layers), hidden]` float32 (`DecoderLM`'s numbering: `cfg.num_layers` is the
    final norm's output, the features an EAGLE head reads).

    `start_pos` (an int or `[B]` ints) is the position of each row's first token. Without a
    cache the tokens attend causally among themselves only. With one, `start_pos + T` must not
    exceed `cache.max_len`.
    """
    if token_ids.ndim != 2:
        raise ValueError(f"dense_forward: token_ids must be [batch, seq], got shape {token_ids.shape}")
    b, t = token_ids.shape
    positions = _positions(start_pos, b, t)
    scale = cfg.attention_scale

    def no_cache(layer: int, q, k, v, state):
        # Causal among the given tokens: offsets within the chunk, the same for every row.
        rel = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if cfg.batch_invariant:
            return _invariant(q, k, v, rel, scale, cfg.layer_window(layer)), state
        return grouped_attention(q, k, v, rel, rel[0], scale, cfg.layer_window(layer)), state

    def with_cache(layer: int, q, k, v, state: DenseCache):
        rows = jnp.arange(b)[:, None]
        ck = state.k[layer].at[rows, positions].set(k.astype(state.k[layer].dtype))
        cv = state.v[layer].at[rows, positions].set(v.astype(state.v[layer].dtype))
        state = DenseCache(state.k[:layer] + (ck,) + state.k[layer + 1:],
                           state.v[:layer] + (cv,) + state.v[layer + 1:])
        if cfg.batch_invariant:
            return _invariant(q, ck, cv, positions, scale, cfg.layer_window(layer)), state
        k_pos = jnp.arange(ck.shape[1], dtype=jnp.int32)
        return grouped_attention(q, ck, cv, positions, k_pos, scale,
                                 cfg.layer_window(layer)), state

    if cache is None:
        attention = no_cache
    else:
        if len(cache.k) != cfg.num_layers:
            raise ValueError(f"dense_forward: cache has {len(cache.k)} layers, "
                             f"cfg.num_layers={cfg.num_layers}")
        attention = with_cache
    model = DecoderLM(cfg, params_dtype(params))
    return model.apply({"params": params}, token_ids, positions, attention, cache,
                       hidden_layers=hidden_layers)


dense_forward_jit = jax.jit(dense_forward, static_argnames=("cfg", "hidden_layers"),
                            donate_argnames=("cache",))


def token_logprobs(params: Any, token_ids: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The trainer's side of a rollout: token_ids `[B, T]` -> `[B, T - 1]` float32, the
    log-probability of each token after the first given the ones before it (temperature 1).
    Jittable and differentiable (`cfg` static); what the engine reports as a sampled token's
    logprob, computed by the dense forward."""
    logits = dense_forward(params, token_ids, cfg)[0][:, :-1].astype(jnp.float32)
    if cfg.batch_invariant:
        from paxkv.model import batch_invariant as bi
        logp = bi.log_softmax(logits)
    else:
        logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, token_ids[:, 1:, None], axis=-1)[..., 0]


def _bucket(n: int, minimum: int = 16) -> int:
    size = minimum
    while size < n:
        size *= 2
    return size


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _greedy_step(params: Any, token_ids: jax.Array, cache: DenseCache, start_pos: jax.Array,
                 last: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, DenseCache]:
    logits, cache = dense_forward(params, token_ids, cfg, cache, start_pos)
    return jnp.argmax(logits[0, last], axis=-1).astype(jnp.int32), cache


def greedy_generate(params: Any, cfg: ModelConfig, prompt_ids: Sequence[int], max_new_tokens: int,
                    stop_token_ids: Sequence[int] = ()) -> list[int]:
    """Greedy continuation of one prompt on the dense path; returns the new token ids.

    Stops early only at a token in `stop_token_ids` (included in the output). Compiles one
    prefill per prompt-length bucket (powers of two) and one decode step per cache size.
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("greedy_generate: prompt_ids is empty")
    if any(t < 0 or t >= cfg.vocab_size for t in prompt):
        raise ValueError(f"greedy_generate: prompt_ids has a token outside [0, {cfg.vocab_size})")
    if max_new_tokens < 0:
        raise ValueError(f"greedy_generate: max_new_tokens must be >= 0, got {max_new_tokens}")
    if max_new_tokens == 0:
        return []
    n = len(prompt)
    padded = _bucket(n)
    cache = init_cache(cfg, 1, _bucket(padded + max_new_tokens), params_dtype(params))
    tokens = jnp.asarray([prompt + [0] * (padded - n)], jnp.int32)
    token, cache = _greedy_step(params, tokens, cache, jnp.zeros((1,), jnp.int32),
                                jnp.int32(n - 1), cfg)
    out = [int(token)]
    stops = set(int(s) for s in stop_token_ids)
    for step in range(1, max_new_tokens):
        if out[-1] in stops:
            break
        token, cache = _greedy_step(params, token.reshape(1, 1), cache,
                                    jnp.full((1,), n + step - 1, jnp.int32), jnp.int32(0), cfg)
        out.append(int(token))
    return out

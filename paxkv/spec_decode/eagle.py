"""An EAGLE draft head (Li et al., 2024, EAGLE-1): one decoder layer that predicts the target
model's next feature from its current feature and the next token, so that the target's own
LM head turns the prediction into a draft token.

The feature `f_t` is the target's last hidden state at position t (after its final norm: the
vector its LM head reads), which predicts token t + 1. The head reads `(f_t, x_{t+1})`, the
token embedded with the target's (frozen) embedding, through `fc` (2h -> h) and one layer of
the target family's shape, and returns a prediction of `f_{t+1}`. Drafting runs the head on
its own predictions: `(f_n, x_{n+1}) -> f'_{n+1} -> d_1`, `(f'_{n+1}, d_1) -> f'_{n+2} -> d_2`...

Training (`scripts/train_eagle.py`) regresses the predicted feature on the target's (smooth
L1) and matches the target's next-token distribution through the LM head (cross-entropy,
weight 0.1), on sequences the target generated itself, and saves the head as one safetensors
file (`flatten_head`'s names; `load_head` reads it back, checked against the target).

The engine (`speculative_config={"method": "eagle", "model": HEAD_FILE, ...}`) keeps each
sequence's window on the host (`proposers.EagleProposer`) and drafts for a step's sequences
in one batched call of `draft` (`eagle_drafter.EagleDrafter`). Device code: pure JAX
functions (and the loader).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from paxkv.config import ModelConfig
from paxkv.model.dense import grouped_attention
from paxkv.model.layers import decoder_layer_class
from paxkv.model.rope import rope_tables

CLS_WEIGHT = 0.1   # EAGLE's weight of the token loss beside the feature regression


def head_config(target: ModelConfig) -> ModelConfig:
    """The head's layer: the target's shape, one layer, full attention."""
    return dataclasses.replace(target, num_layers=1, sliding_window=None, layer_types=(),
                               name=f"{target.name}-eagle")


# The head attends to this many positions back (its training windows): drafting then costs
# one window, however long the sequence.
WINDOW = 128
# Position given to left padding: no real query (positions 0..WINDOW-1) attends to it.
PAD_POSITION = 1 << 20


class EagleHead(nn.Module):
    """`(features [B, T, h], next_tokens [B, T], embedding [V, h])` -> predicted next
    features `[B, T, h]`, causal over T (`positions` 0..T-1 unless given; a padding
    position of `PAD_POSITION` is seen by no real one)."""

    cfg: ModelConfig            # the head's (`head_config` of the target's)
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, features: jax.Array, next_tokens: jax.Array, embedding: jax.Array,
                 positions: jax.Array | None = None) -> jax.Array:
        c = self.cfg
        b, t = next_tokens.shape
        e = jnp.take(embedding, next_tokens, axis=0).astype(self.dtype)
        x = nn.Dense(c.hidden_size, use_bias=True, dtype=self.dtype, param_dtype=self.dtype,
                     name="fc")(jnp.concatenate([e, features.astype(self.dtype)], axis=-1))
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

        def attention(layer, q, k, v, state):
            return grouped_attention(q, k, v, positions, positions[0], c.attention_scale), state

        layer = decoder_layer_class(c)(c, 0, self.dtype, False, name="layer")
        out, residual, _ = layer(x, None, rope_tables(positions, c), attention, None)
        return out + residual


def init_head(target: ModelConfig, key: jax.Array, dtype: Any = jnp.float32) -> Any:
    cfg = head_config(target)
    f = jnp.zeros((1, 2, target.hidden_size), dtype)
    return EagleHead(cfg, dtype).init(key, f, jnp.zeros((1, 2), jnp.int32),
                                      jnp.zeros((target.vocab_size, target.hidden_size), dtype))["params"]


def _name(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


def flatten_head(params: Any) -> dict[str, np.ndarray]:
    """The head's parameters as the file stores them: `"fc/kernel"`, `"layer/mlp/..."`,
    float32 host arrays."""
    return {_name(path): np.asarray(v, np.float32)
            for path, v in jax.tree_util.tree_leaves_with_path(params)}


def load_head(path: str, target: ModelConfig) -> Any:
    """The head `flatten_head` saved at `path` (safetensors) -> params for `target`; a
    ValueError says which tensor is missing, unexpected or of a shape the target does not
    fit (a head trained for another model)."""
    from paxkv.model.weights import read_safetensors
    tensors = read_safetensors(path)
    shapes = jax.eval_shape(lambda: init_head(target, jax.random.PRNGKey(0)))
    want = {_name(p): tuple(v.shape) for p, v in jax.tree_util.tree_leaves_with_path(shapes)}
    missing = sorted(set(want) - set(tensors))
    unexpected = sorted(set(tensors) - set(want))
    if missing or unexpected:
        raise ValueError(f"{path} is not an EAGLE head for {target.name}: tensors missing "
                         f"{missing[:3]}, unexpected {unexpected[:3]}")
    for name, shape in want.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                             f"a head for {target.name} needs {shape}")
    flat = {name: jnp.asarray(np.asarray(tensors[name], np.float32)) for name in want}
    return jax.tree_util.tree_map_with_path(lambda p, _: flat[_name(p)], shapes)


def head_logits(features: jax.Array, embedding: jax.Array) -> jax.Array:
    """The target's tied LM head on (predicted) features -> float32 logits."""
    return jnp.einsum("...h,vh->...v", features, embedding, preferred_element_type=jnp.float32)


def eagle_loss(params: Any, target: ModelConfig, embedding: jax.Array, features: jax.Array,
               tokens: jax.Array, mask: jax.Array, cls_rows: jax.Array) -> tuple[jax.Array, dict]:
    """EAGLE-1's loss over sequences: `features [B, T, h]` the target's at every position,
    `tokens [B, T]`, `mask [B, T]` (1 where position t + 1 is real). Position t's input is
    `(f_t, x_{t+1})` and its target `f_{t+1}`. The token term runs at `cls_rows` (`[B, R]`
    position indices; the LM head over every position would dominate the step's cost)."""
    head = EagleHead(head_config(target))
    pred = head.apply({"params": params}, features[:, :-1], tokens[:, 1:], embedding)
    want = features[:, 1:]
    m = mask[:, 1:].astype(jnp.float32)
    diff = jnp.abs(pred - want)
    smooth_l1 = jnp.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5).mean(-1)
    reg = (smooth_l1 * m).sum() / jnp.maximum(m.sum(), 1.0)
    take = jax.vmap(lambda a, i: a[i])
    p_target = jax.nn.softmax(head_logits(take(want, cls_rows), embedding), axis=-1)
    logp = jax.nn.log_softmax(head_logits(take(pred, cls_rows), embedding), axis=-1)
    mc = take(m, cls_rows)
    cls = (-(p_target * logp).sum(-1) * mc).sum() / jnp.maximum(mc.sum(), 1.0)
    agree = ((jnp.argmax(logp, -1) == jnp.argmax(p_target, -1)) * mc).sum() / jnp.maximum(mc.sum(), 1.0)
    return reg + CLS_WEIGHT * cls, {"reg": reg, "cls": cls, "top1": agree}


def draft(params: Any, target: ModelConfig, embedding: jax.Array, features: jax.Array,
          next_tokens: jax.Array, num_real: jax.Array, k: int) -> jax.Array:
    """k greedy drafts after a prefix, over the head's last `WINDOW` positions:
    `features [WINDOW, h]` the target's features and `next_tokens [WINDOW]` the token after
    each, right-aligned (the last row: the newest feature and the token just emitted), the
    first `WINDOW - num_real` rows padding. Jittable (`target`, `k` static); recomputes the
    window for each draft (an offline replay: the engine would keep the head's KV)."""
    head = EagleHead(head_config(target))
    w = features.shape[0]
    rows = jnp.arange(w)

    def positions(num_real):   # the real rows 0.., the padding before them out of sight
        first = w - num_real
        return jnp.where(rows >= first, rows - first, PAD_POSITION).astype(jnp.int32)

    feats, toks, out = features, next_tokens, []
    for _ in range(k):
        pred = head.apply({"params": params}, feats[None], toks[None], embedding,
                          positions(num_real)[None])[0, -1]
        d = jnp.argmax(head_logits(pred, embedding)).astype(jnp.int32)
        out.append(d)
        # slide the window one position: the prediction and its draft become the newest row
        feats = jnp.concatenate([feats[1:], pred[None]], 0)
        toks = jnp.concatenate([toks[1:], d[None]], 0)
        num_real = jnp.minimum(num_real + 1, w)
    return jnp.stack(out)

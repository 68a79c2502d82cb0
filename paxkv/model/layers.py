"""The Llama-3 decoder as Flax Linen modules, shared by the paged and the dense forward.

The modules know nothing about KV caches. Each attention layer hands its rotated
`q, k, v` to an `AttentionFn` supplied by the caller together with an opaque cache state
(a `KVPool` for the paged engine, a contiguous cache for the dense reference, nothing for
training); the function returns the attention output and the new state. That keeps one
definition of the network for every path, so the paged engine and its dense reference
cannot drift apart.

Layers are unrolled in Python (no `nn.scan`): the KV pool is a tuple of per-layer pages,
and unrolling lets XLA update each layer's pages in place when the pool is donated.

Parameter tree (the Linen "params" collection; names follow the HF checkpoint):
    embed_tokens/embedding              [vocab, hidden]
    layers_{i}/input_layernorm/scale    [hidden]
    layers_{i}/self_attn/{q,k,v,o}_proj/kernel   [in, out]
    layers_{i}/post_attention_layernorm/scale    [hidden]
    layers_{i}/mlp/{gate,up,down}_proj/kernel    [in, out]
    norm/scale                          [hidden]
    lm_head/kernel                      [hidden, vocab]   (absent when embeddings are tied)
The engine serves from the fused layout of `fusion.py` (qkv_proj, gate_up_proj; grouped 3-D
kernels under tensor parallelism); every layout runs here.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from paxkv.config import ModelConfig
from paxkv.model.fusion import FUSED, part_widths, split_columns, split_groups
from paxkv.model.rope import apply_rope, cos_sin

# (layer, q [..., Hq, d], k [..., Hkv, d], v [..., Hkv, d], state) -> (out [..., Hq, d], state)
AttentionFn = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]

INIT_STD = 0.02  # the usual Llama initializer range


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32 whatever the activation dtype."""

    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * scale.astype(jnp.float32)).astype(self.dtype)


def _linear(features: int, name: str, dtype: Any) -> nn.Dense:
    return nn.Dense(features, use_bias=False, dtype=dtype, param_dtype=dtype, name=name,
                    kernel_init=nn.initializers.normal(INIT_STD))


def _fused_projections(module: nn.Module, x: jax.Array, fused_name: str, cfg: ModelConfig,
                       dtype: Any) -> tuple[jax.Array, ...]:
    """The outputs of the projections that all read `x` and that `fusion.FUSED[fused_name]`
    names: one matmul when the parameters are in the serving layout, else one `nn.Dense`
    each."""
    widths = part_widths(cfg, fused_name)
    if not module.is_initializing() and module.has_variable("params", fused_name):
        kernel = module.get_variable("params", fused_name)["kernel"]
        y = jax.lax.dot_general(x.astype(dtype), kernel.astype(dtype),
                                (((x.ndim - 1,), (0,)), ((), ())))
        if kernel.ndim == 3:   # the grouped (tensor-parallel) layout of fusion.py
            return split_groups(y, widths)
        return split_columns(y, widths)
    return tuple(_linear(w, n, dtype)(x) for w, n in zip(widths, FUSED[fused_name][1]))


class Attention(nn.Module):
    """Grouped-query self-attention projections and RoPE around a caller-given core."""

    cfg: ModelConfig
    layer: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 attention: AttentionFn, state: Any) -> tuple[jax.Array, Any]:
        c = self.cfg
        lead = x.shape[:-1]
        q, k, v = _fused_projections(self, x, "qkv_proj", c, self.dtype)
        q = apply_rope(q.reshape(*lead, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(k.reshape(*lead, c.num_kv_heads, c.head_dim), cos, sin)
        v = v.reshape(*lead, c.num_kv_heads, c.head_dim)
        out, state = attention(self.layer, q, k, v, state)
        out = out.astype(self.dtype).reshape(*lead, c.num_heads * c.head_dim)
        return _linear(c.hidden_size, "o_proj", self.dtype)(out), state


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    cfg: ModelConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.cfg
        gate, up = _fused_projections(self, x, "gate_up_proj", c, self.dtype)
        return _linear(c.hidden_size, "down_proj", self.dtype)(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    layer: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 attention: AttentionFn, state: Any) -> tuple[jax.Array, Any]:
        c = self.cfg
        h = RMSNorm(c.rms_norm_eps, self.dtype, name="input_layernorm")(x)
        h, state = Attention(c, self.layer, self.dtype, name="self_attn")(h, cos, sin, attention, state)
        x = x + h
        h = RMSNorm(c.rms_norm_eps, self.dtype, name="post_attention_layernorm")(x)
        return x + MLP(c, self.dtype, name="mlp")(h), state


class LMHead(nn.Module):
    """Untied output projection; accumulates in float32 so bf16 logits keep their precision."""

    vocab_size: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", nn.initializers.normal(INIT_STD),
                            (x.shape[-1], self.vocab_size), self.dtype)
        return jnp.einsum("...h,hv->...v", x.astype(self.dtype), kernel,
                          preferred_element_type=jnp.float32)


class Llama(nn.Module):
    """Token ids (any leading shape) -> logits float32, threading a cache state through.

    `logits_at`, when given, is an integer index array into the flattened leading dims:
    only those rows go through the final norm and the LM head (the engine needs one row per
    sequence, not one per token).
    """

    cfg: ModelConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, token_ids: jax.Array, positions: jax.Array, attention: AttentionFn,
                 state: Any = None, logits_at: jax.Array | None = None,
                 hidden_at: jax.Array | None = None,
                 hidden_layers: tuple[int, ...] = ()) -> tuple[jax.Array, ...]:
        """-> (logits, state), or (logits, state, hidden `[H, len(hidden_layers), hidden]`
        float32) when `hidden_layers` (static) names layers: the residual stream at token
        indices `hidden_at`, layer i as transformers' hidden_states[i] (0: the embeddings,
        num_layers: the final norm's output)."""
        c = self.cfg
        embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=self.dtype,
                         embedding_init=nn.initializers.normal(INIT_STD), name="embed_tokens")
        x = embed(token_ids)
        taken: dict[int, jax.Array] = {}

        def take(layer: int, h: jax.Array, at: jax.Array | None) -> None:
            if layer in hidden_layers:
                flat = h.reshape(-1, c.hidden_size)
                taken[layer] = (flat if at is None else flat[at]).astype(jnp.float32)

        take(0, x, hidden_at)
        cos, sin = cos_sin(positions, c)
        for i in range(c.num_layers):
            x, state = DecoderLayer(c, i, self.dtype, name=f"layers_{i}")(x, cos, sin, attention, state)
            if i + 1 < c.num_layers:
                take(i + 1, x, hidden_at)
        final = RMSNorm(c.rms_norm_eps, self.dtype, name="norm")
        if c.num_layers in hidden_layers:
            take(c.num_layers, final(x.reshape(-1, c.hidden_size)[hidden_at]), None)
        if logits_at is not None:
            x = x.reshape(-1, c.hidden_size)[logits_at]
        x = final(x)
        if c.tie_word_embeddings:
            logits = jnp.einsum("...h,vh->...v", x, embed.embedding.astype(self.dtype),
                                preferred_element_type=jnp.float32)
        else:
            logits = LMHead(c.vocab_size, self.dtype, name="lm_head")(x)
        if hidden_layers:
            return logits.astype(jnp.float32), state, jnp.stack([taken[i] for i in hidden_layers], 1)
        return logits.astype(jnp.float32), state


def params_dtype(params: Any) -> Any:
    """The compute dtype of a parameter tree: that of its token embedding."""
    return params["embed_tokens"]["embedding"].dtype

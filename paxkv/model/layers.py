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


class AddRMSNorm(nn.Module):
    """The residual add and the RMSNorm after it: `(x + residual, norm(x + residual))`.

    The norm is computed in float32 whatever the activation dtype, on the sum rounded to
    the activation dtype; `residual` None means no add (the first layer's input). With
    `fused` the pair is one Pallas kernel (`pallas_kernels.layer_ops.add_rms_norm`).
    """

    eps: float
    dtype: Any = jnp.float32
    fused: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        if self.fused:
            from pallas_kernels.layer_ops import add_rms_norm
            from pallas_kernels.layer_ops.add_rms_norm import supported
            if supported(x.shape[-1]):
                return add_rms_norm(x, residual, scale, eps=self.eps,
                                    interpret=jax.default_backend() != "gpu")
        total = x if residual is None else x + residual
        xf = total.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return total, (xf * scale.astype(jnp.float32)).astype(self.dtype)


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


def _packed_qkv_heads(module: nn.Module, x: jax.Array, cfg: ModelConfig, dtype: Any) -> jax.Array:
    """The q/k/v projections of `x` as one `[..., Hq + 2 Hkv, d]` array (q, k, v heads): in
    the 2-D fused layout that is the fused matmul's output itself, else a concatenation."""
    lead = x.shape[:-1]
    heads = cfg.num_heads + 2 * cfg.num_kv_heads
    if not module.is_initializing() and module.has_variable("params", "qkv_proj"):
        kernel = module.get_variable("params", "qkv_proj")["kernel"]
        if kernel.ndim == 2:
            y = jax.lax.dot_general(x.astype(dtype), kernel.astype(dtype),
                                    (((x.ndim - 1,), (0,)), ((), ())))
            return y.reshape(*lead, heads, cfg.head_dim)
    q, k, v = _fused_projections(module, x, "qkv_proj", cfg, dtype)
    return jnp.concatenate([q.reshape(*lead, cfg.num_heads, cfg.head_dim),
                            k.reshape(*lead, cfg.num_kv_heads, cfg.head_dim),
                            v.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)], axis=-2)


class Attention(nn.Module):
    """Grouped-query self-attention projections and RoPE around a caller-given core.

    With `packed_qkv` the core receives the q/k/v projection's output as it comes out of the
    fused matmul, unrotated and unsplit: `[..., Hq + 2 Hkv, d]` (q heads, k heads, v heads)
    as `q`, and None as k and v; it rotates and splits them itself (the paged engine's fused
    RoPE + KV-write kernel reads its heads from that one buffer)."""

    cfg: ModelConfig
    layer: int
    dtype: Any = jnp.float32
    packed_qkv: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 attention: AttentionFn, state: Any) -> tuple[jax.Array, Any]:
        c = self.cfg
        lead = x.shape[:-1]
        if self.packed_qkv:
            out, state = attention(self.layer, _packed_qkv_heads(self, x, c, self.dtype), None,
                                   None, state)
        else:
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
    """One layer, its last residual add deferred: `(x, residual)` -> `(mlp_out, residual')`.

    The residual stream entering the layer is `x + residual` (`residual` None at layer 0,
    where x is the embeddings); the stream leaving it is `mlp_out + residual'`. Deferring
    that add to the next norm lets the add and the norm be one kernel (`fused`), with the
    same operations, in the same order, as the plain form.
    """

    cfg: ModelConfig
    layer: int
    dtype: Any = jnp.float32
    fused: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array | None, cos: jax.Array, sin: jax.Array,
                 attention: AttentionFn, state: Any) -> tuple[jax.Array, jax.Array, Any]:
        c = self.cfg
        residual, h = AddRMSNorm(c.rms_norm_eps, self.dtype, self.fused,
                                 name="input_layernorm")(x, residual)
        h, state = Attention(c, self.layer, self.dtype, packed_qkv=self.fused,
                             name="self_attn")(h, cos, sin, attention, state)
        residual, h = AddRMSNorm(c.rms_norm_eps, self.dtype, self.fused,
                                 name="post_attention_layernorm")(h, residual)
        return MLP(c, self.dtype, name="mlp")(h), residual, state


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

    `fused` (the paged engine on a GPU backend): each residual add and the norm after it
    run as one Pallas kernel, and the attention core receives the packed, unrotated q/k/v
    heads (`Attention.packed_qkv`; it applies RoPE as it writes the KV pages).
    """

    cfg: ModelConfig
    dtype: Any = jnp.float32
    fused: bool = False

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
        residual = None
        for i in range(c.num_layers):
            x, residual, state = DecoderLayer(c, i, self.dtype, self.fused, name=f"layers_{i}")(
                x, residual, cos, sin, attention, state)
            if i + 1 < c.num_layers and i + 1 in hidden_layers:
                take(i + 1, x + residual, hidden_at)
        final = AddRMSNorm(c.rms_norm_eps, self.dtype, self.fused, name="norm")

        def rows(a: jax.Array, at: jax.Array) -> jax.Array:
            return a.reshape(-1, c.hidden_size)[at]

        if c.num_layers in hidden_layers:
            take(c.num_layers, final(rows(x, hidden_at), rows(residual, hidden_at))[1], None)
        if logits_at is not None:
            x, residual = rows(x, logits_at), rows(residual, logits_at)
        x = final(x, residual)[1]
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

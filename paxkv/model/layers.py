"""The decoder as Flax Linen modules, shared by every family and by the paged and dense forward.

The modules know nothing about KV caches. Each attention layer hands its `q, k, v` to an
`AttentionFn` supplied by the caller together with an opaque cache state (a `KVPool` for
the paged engine, a contiguous cache for the dense reference, nothing for training); the
function returns the attention output and the new state. That keeps one definition of the
network for every path, so the paged engine and its dense reference cannot drift apart.
Which window, scale and RoPE a layer's attention uses is the config's to say
(`ModelConfig.layer_window`, `attention_scale`, `layer_rope`), so the function reads them
from the config and the layer index it is given.

The pieces here (norms, projections with their fused layouts, attention projections, the
gated MLP, the Llama-shaped `DecoderLayer` and the `DecoderLM` around the layers) are what a
family is built from: a family module (`paxkv/model/families/`) names its layer class, which
is `DecoderLayer` for Llama, Qwen2, Qwen3 and Mistral, and its own arrangement of these
pieces for Gemma 3.

Layers are unrolled in Python (no `nn.scan`): the KV pool is a tuple of per-layer pages,
and unrolling lets XLA update each layer's pages in place when the pool is donated.

Parameter tree (the Linen "params" collection; names follow the HF checkpoint):
    embed_tokens/embedding              [vocab, hidden]
    layers_{i}/input_layernorm/scale    [hidden]
    layers_{i}/self_attn/{q,k,v,o}_proj/kernel   [in, out]   (and /bias where the family has it)
    layers_{i}/self_attn/{q,k}_norm/scale        [head_dim]  (families with q/k norms)
    layers_{i}/post_attention_layernorm/scale    [hidden]    (and a family's other norms)
    layers_{i}/mlp/{gate,up,down}_proj/kernel    [in, out]
    layers_{i}/moe/router/kernel, moe/experts/{gate,up,down}_proj   (mixture-of-experts layers
                                                in place of mlp: `moe.py`)
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
from paxkv.model import batch_invariant as bi
from paxkv.model.activations import activation
from paxkv.model.rope import RopeKey, apply_rope, rope_tables

# (layer, q [..., Hq, d], k [..., Hkv, d], v [..., Hkv, d], state) -> (out [..., Hq, d], state)
AttentionFn = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]
# cos and sin per distinct RoPE (`rope.rope_tables`): a layer takes `tables[cfg.layer_rope(i)]`.
RopeTables = dict[RopeKey, tuple[jax.Array, jax.Array]]

INIT_STD = 0.02  # the usual Llama initializer range


class AddRMSNorm(nn.Module):
    """The residual add and the RMSNorm after it: `(x + residual, norm(x + residual))`.

    The norm is computed in float32 whatever the activation dtype, on the sum rounded to
    the activation dtype; `residual` None means no add (a plain norm). `unit_offset`: the
    gain is `1 + scale` (Gemma). With `fused` the pair is one Pallas kernel
    (`pallas_kernels.layer_ops.add_rms_norm`).
    """

    eps: float
    dtype: Any = jnp.float32
    fused: bool = False
    unit_offset: bool = False
    invariant: bool = False   # in row tiles (`batch_invariant.rows_in_tiles`)

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), self.dtype)
        if self.fused and not self.invariant:
            from pallas_kernels.layer_ops import add_rms_norm
            from pallas_kernels.layer_ops.add_rms_norm import supported
            if supported(x.shape[-1]):
                return add_rms_norm(x, residual, scale, eps=self.eps, unit_offset=self.unit_offset,
                                    interpret=jax.default_backend() != "gpu")
        total = x if residual is None else x + residual
        gain = scale.astype(jnp.float32)
        if self.unit_offset:
            gain = gain + 1.0

        def norm(rows: jax.Array) -> jax.Array:
            xf = rows.astype(jnp.float32)
            xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
            return (xf * gain).astype(self.dtype)

        return total, bi.rows_in_tiles(norm, total) if self.invariant else norm(total)


def rms_norm(module_name: str, cfg: ModelConfig, dtype: Any, fused: bool = False) -> AddRMSNorm:
    """The config's RMSNorm (its epsilon, its gain convention) named `module_name`."""
    return AddRMSNorm(cfg.rms_norm_eps, dtype, fused, cfg.norm_unit_offset, cfg.batch_invariant,
                      name=module_name)


def _linear(features: int, name: str, dtype: Any, bias: bool = False,
            invariant: bool = False) -> nn.Dense:
    return nn.Dense(features, use_bias=bias, dtype=dtype, param_dtype=dtype, name=name,
                    kernel_init=nn.initializers.normal(INIT_STD),
                    dot_general=bi.dot_general if invariant else None)


def _fused_matmul(module: nn.Module, x: jax.Array, fused_name: str, dtype: Any,
                  invariant: bool = False) -> jax.Array | None:
    """`x` through the fused projection `fused_name` when the parameters hold it (the serving
    layout, 2-D or grouped 3-D, with its bias when it has one), else None."""
    if module.is_initializing() or not module.has_variable("params", fused_name):
        return None
    weights = module.get_variable("params", fused_name)
    kernel = weights["kernel"]
    dot = bi.dot_general if invariant else jax.lax.dot_general
    y = dot(x.astype(dtype), kernel.astype(dtype), (((x.ndim - 1,), (0,)), ((), ())))
    if "bias" in weights:
        y = y + weights["bias"].astype(dtype)
    return y


def _fused_projections(module: nn.Module, x: jax.Array, fused_name: str, cfg: ModelConfig,
                       dtype: Any, bias: bool = False) -> tuple[jax.Array, ...]:
    """The outputs of the projections that all read `x` and that `fusion.FUSED[fused_name]`
    names: one matmul when the parameters are in the serving layout, else one `nn.Dense`
    each (`bias`: the separate projections carry biases)."""
    widths = part_widths(cfg, fused_name)
    y = _fused_matmul(module, x, fused_name, dtype, cfg.batch_invariant)
    if y is not None:
        if y.ndim == x.ndim + 1:   # the grouped (tensor-parallel) layout of fusion.py
            return split_groups(y, widths)
        return split_columns(y, widths)
    return tuple(_linear(w, n, dtype, bias, cfg.batch_invariant)(x) for w, n in zip(widths, FUSED[fused_name][1]))


class Attention(nn.Module):
    """Grouped-query self-attention projections (with the family's biases and q/k norms) and
    RoPE around a caller-given core.

    With `packed_qkv` the core receives the q/k/v projection's output as it comes out of the
    fused matmul, unrotated and unsplit: `[..., Hq + 2 Hkv, d]` (q heads, k heads, v heads)
    as `q`, and None as k and v; it rotates and splits them itself (the paged engine's fused
    RoPE + KV-write kernel reads its heads from that one buffer). Q/k norms, where the family
    has them, are applied to the packed heads first."""

    cfg: ModelConfig
    layer: int
    dtype: Any = jnp.float32
    packed_qkv: bool = False

    def _packed(self, x: jax.Array) -> jax.Array | None:
        """The packed `[..., Hq + 2 Hkv, d]` heads straight from the 2-D fused matmul."""
        y = _fused_matmul(self, x, "qkv_proj", self.dtype, self.cfg.batch_invariant)
        if y is None or y.ndim != x.ndim:
            return None
        c = self.cfg
        return y.reshape(*x.shape[:-1], c.num_heads + 2 * c.num_kv_heads, c.head_dim)

    @nn.compact
    def __call__(self, x: jax.Array, rope: RopeTables, attention: AttentionFn,
                 state: Any) -> tuple[jax.Array, Any]:
        c = self.cfg
        lead = x.shape[:-1]
        qkv = self._packed(x) if self.packed_qkv else None
        if qkv is not None:
            q, k, v = jnp.split(qkv, [c.num_heads, c.num_heads + c.num_kv_heads], axis=-2)
        else:
            q, k, v = _fused_projections(self, x, "qkv_proj", c, self.dtype, c.qkv_bias)
            q = q.reshape(*lead, c.num_heads, c.head_dim)
            k = k.reshape(*lead, c.num_kv_heads, c.head_dim)
            v = v.reshape(*lead, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm("q_norm", c, self.dtype)(q, None)[1]
            k = rms_norm("k_norm", c, self.dtype)(k, None)[1]
        if self.packed_qkv:
            if qkv is None or c.qk_norm:
                qkv = jnp.concatenate([q, k, v], axis=-2)
            out, state = attention(self.layer, qkv, None, None, state)
        else:
            cos, sin = rope[c.layer_rope(self.layer)]
            out, state = attention(self.layer, apply_rope(q, cos, sin), apply_rope(k, cos, sin),
                                   v, state)
        out = out.astype(self.dtype).reshape(*lead, c.num_heads * c.head_dim)
        return _linear(c.hidden_size, "o_proj", self.dtype, c.o_bias, c.batch_invariant)(out), state


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)); SwiGLU or GeGLU by `cfg.hidden_act`."""

    cfg: ModelConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.cfg
        gate, up = _fused_projections(self, x, "gate_up_proj", c, self.dtype)
        return _linear(c.hidden_size, "down_proj", self.dtype, invariant=c.batch_invariant)(activation(c.hidden_act)(gate) * up)


def feed_forward(cfg: ModelConfig, layer: int, dtype: Any) -> nn.Module:
    """Layer `layer`'s feed-forward block: the gated MLP ("mlp"), or in a mixture-of-experts
    layer the experts and their router ("moe", `paxkv/model/moe.py`)."""
    if cfg.is_moe_layer(layer):
        from paxkv.model.moe import SparseMoE
        return SparseMoE(cfg, dtype, name="moe")
    return MLP(cfg, dtype, name="mlp")


class DecoderLayer(nn.Module):
    """One pre-norm layer (Llama, Qwen2, Qwen3, Mistral), its last residual add deferred:
    `(x, residual)` -> `(mlp_out, residual')`.

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
    def __call__(self, x: jax.Array, residual: jax.Array | None, rope: RopeTables,
                 attention: AttentionFn, state: Any) -> tuple[jax.Array, jax.Array, Any]:
        c = self.cfg
        residual, h = rms_norm("input_layernorm", c, self.dtype, self.fused)(x, residual)
        h, state = Attention(c, self.layer, self.dtype, packed_qkv=self.fused,
                             name="self_attn")(h, rope, attention, state)
        residual, h = rms_norm("post_attention_layernorm", c, self.dtype, self.fused)(h, residual)
        return feed_forward(c, self.layer, self.dtype)(h), residual, state


class LMHead(nn.Module):
    """Untied output projection; accumulates in float32 so bf16 logits keep their precision."""

    vocab_size: int
    dtype: Any = jnp.float32
    invariant: bool = False   # in row tiles (`batch_invariant`)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", nn.initializers.normal(INIT_STD),
                            (x.shape[-1], self.vocab_size), self.dtype)
        if self.invariant:
            return bi.matmul(x.astype(self.dtype), kernel, preferred_element_type=jnp.float32)
        return jnp.einsum("...h,hv->...v", x.astype(self.dtype), kernel,
                          preferred_element_type=jnp.float32)


def decoder_layer_class(cfg: ModelConfig) -> type[nn.Module]:
    """The layer class of `cfg`'s family (`paxkv/model/registry.py`)."""
    from paxkv.model.registry import family_of
    return family_of(cfg).decoder_layer()


class DecoderLM(nn.Module):
    """Token ids (any leading shape) -> logits float32, threading a cache state through; the
    layers are the family's (`decoder_layer_class`).

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
        if c.embedding_multiplier != 1.0:   # in the compute dtype, as transformers' Gemma
            x = x * jnp.asarray(c.embedding_multiplier, self.dtype)
        taken: dict[int, jax.Array] = {}

        def take(layer: int, h: jax.Array, at: jax.Array | None) -> None:
            if layer in hidden_layers:
                flat = h.reshape(-1, c.hidden_size)
                taken[layer] = (flat if at is None else flat[at]).astype(jnp.float32)

        take(0, x, hidden_at)
        rope = rope_tables(positions, c)
        layer_class = decoder_layer_class(c)
        residual = None
        for i in range(c.num_layers):
            x, residual, state = layer_class(c, i, self.dtype, self.fused, name=f"layers_{i}")(
                x, residual, rope, attention, state)
            if i + 1 < c.num_layers and i + 1 in hidden_layers:
                take(i + 1, x + residual, hidden_at)
        final = rms_norm("norm", c, self.dtype, self.fused)

        def rows(a: jax.Array, at: jax.Array) -> jax.Array:
            return a.reshape(-1, c.hidden_size)[at]

        if c.num_layers in hidden_layers:
            take(c.num_layers, final(rows(x, hidden_at), rows(residual, hidden_at))[1], None)
        if logits_at is not None:
            x, residual = rows(x, logits_at), rows(residual, logits_at)
        x = final(x, residual)[1]
        if c.tie_word_embeddings and c.batch_invariant:
            logits = bi.matmul(x, embed.embedding.astype(self.dtype).T,
                               preferred_element_type=jnp.float32)
        elif c.tie_word_embeddings:
            logits = jnp.einsum("...h,vh->...v", x, embed.embedding.astype(self.dtype),
                                preferred_element_type=jnp.float32)
        else:
            logits = LMHead(c.vocab_size, self.dtype, c.batch_invariant, name="lm_head")(x)
        logits = logits.astype(jnp.float32)
        if c.final_logit_softcapping:
            cap = c.final_logit_softcapping
            logits = jnp.tanh(logits / cap) * cap
        if hidden_layers:
            return logits, state, jnp.stack([taken[i] for i in hidden_layers], 1)
        return logits, state


def params_dtype(params: Any) -> Any:
    """The compute dtype of a parameter tree: that of its token embedding."""
    return params["embed_tokens"]["embedding"].dtype

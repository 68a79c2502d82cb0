"""Gemma 3, text (`Gemma3ForCausalLM`): sliding and global layers from `layer_types` (five
sliding to one global by default), the sliding ones with a RoPE base of their own; q/k norms;
a norm after attention and after the MLP as well as before each ("sandwich" norms); RMSNorm
gains applied as 1 + w; GeGLU; embeddings scaled by sqrt(hidden); the softmax scale from
`query_pre_attn_scalar`."""
from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from paxkv.config import ModelConfig
from paxkv.model.families.base import (FULL_ATTENTION, SLIDING_ATTENTION, TensorSpec,
                                       decoder_config, decoder_hf_config, decoder_tensor_specs,
                                       layer_types_of, reject, rope_of, rope_scaling_dict)

ARCHITECTURE = "Gemma3ForCausalLM"
MODEL_TYPE = "gemma3_text"
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm")


def config_from_hf(raw: Mapping[str, Any], name: str) -> ModelConfig:
    act = raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"config.json field 'hidden_activation'={act!r}: only "
                         "'gelu_pytorch_tanh' is supported")
    reject(raw, "attn_logit_softcapping", None, "attention logit soft-capping is not supported")
    reject(raw, "use_bidirectional_attention", False, "bidirectional attention is not supported")
    reject(raw, "attention_bias", False, "attention biases are not supported")
    layers = int(raw.get("num_hidden_layers", 0))
    types = layer_types_of(raw, layers)
    if not types:
        pattern = int(raw.get("sliding_window_pattern", 6))
        types = tuple(SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION
                      for i in range(layers))
    theta, scaling = rope_of(raw, FULL_ATTENTION, default_theta=1_000_000.0)
    local = raw.get("rope_local_base_freq") or 10_000.0
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and isinstance(params.get(SLIDING_ATTENTION), Mapping):
        local_params = params[SLIDING_ATTENTION]
        if local_params.get("rope_type", "default") != "default":
            raise ValueError("config.json field 'rope_parameters': scaled RoPE on sliding "
                             "layers is not supported")
        local = local_params.get("rope_theta", local)
    softcap = raw.get("final_logit_softcapping")
    hidden = int(raw.get("hidden_size", 0))
    return decoder_config(
        {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, **raw}, name, ARCHITECTURE,
        rope_theta=theta, rope_scaling=scaling, rope_local_theta=float(local),
        qk_norm=True, layer_types=types, sliding_window=int(raw.get("sliding_window", 4096)),
        hidden_act="gelu_tanh", query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        embedding_multiplier=hidden ** 0.5, norm_unit_offset=True,
        final_logit_softcapping=float(softcap) if softcap else None)


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    return decoder_tensor_specs(cfg, LAYER_NORMS)


def hf_config(cfg: ModelConfig, dtype: Any) -> dict[str, Any]:
    """Written with the rope keys transformers 4 and 5 both read."""
    out = decoder_hf_config(cfg, dtype, MODEL_TYPE)
    scalar = cfg.query_pre_attn_scalar
    out.update(hidden_activation="gelu_pytorch_tanh",
               query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
               sliding_window=cfg.sliding_window, layer_types=list(cfg.layer_types),
               rope_local_base_freq=cfg.rope_local_theta,
               rope_scaling=rope_scaling_dict(cfg.rope_scaling),
               final_logit_softcapping=cfg.final_logit_softcapping,
               attn_logit_softcapping=None, attention_bias=False)
    return out


def decoder_layer() -> type:
    return Gemma3DecoderLayer


class Gemma3DecoderLayer(nn.Module):
    """Gemma 3's layer, its last residual add deferred as `layers.DecoderLayer`'s:
    norm -> attention -> norm, added to the stream; norm -> MLP -> norm, handed on to be
    added at the next layer's first norm."""

    cfg: ModelConfig
    layer: int
    dtype: Any = jnp.float32
    fused: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array | None, rope: Any, attention: Any,
                 state: Any) -> tuple[jax.Array, jax.Array, Any]:
        from paxkv.model.layers import MLP, Attention, rms_norm
        c = self.cfg
        residual, h = rms_norm("input_layernorm", c, self.dtype, self.fused)(x, residual)
        h, state = Attention(c, self.layer, self.dtype, packed_qkv=self.fused,
                             name="self_attn")(h, rope, attention, state)
        h = rms_norm("post_attention_layernorm", c, self.dtype, self.fused)(h, None)[1]
        residual, h = rms_norm("pre_feedforward_layernorm", c, self.dtype, self.fused)(h, residual)
        h = MLP(c, self.dtype, name="mlp")(h)
        h = rms_norm("post_feedforward_layernorm", c, self.dtype, self.fused)(h, None)[1]
        return h, residual, state

"""Qwen3 (`Qwen3ForCausalLM`): the Llama layer with an RMSNorm over every q and k head before
RoPE, biases only where `attention_bias` asks, and sliding layers as Qwen2 has them."""
from __future__ import annotations

from typing import Any, Mapping

from paxkv.config import ModelConfig
from paxkv.model.families.base import (TensorSpec, decoder_config, decoder_hf_config,
                                       decoder_tensor_specs, qwen_layer_types, reject)

ARCHITECTURE = "Qwen3ForCausalLM"
MODEL_TYPE = "qwen3"


def config_from_hf(raw: Mapping[str, Any], name: str) -> ModelConfig:
    reject(raw, "hidden_act", "silu", "only 'silu' is supported")
    bias = bool(raw.get("attention_bias", False))
    types, window = qwen_layer_types(raw, int(raw.get("num_hidden_layers", 0)))
    return decoder_config(raw, name, ARCHITECTURE, qkv_bias=bias, o_bias=bias, qk_norm=True,
                          layer_types=types, sliding_window=window)


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    return decoder_tensor_specs(cfg)


def hf_config(cfg: ModelConfig, dtype: Any) -> dict[str, Any]:
    out = {**decoder_hf_config(cfg, dtype, MODEL_TYPE), "hidden_act": "silu",
           "attention_bias": cfg.qkv_bias, "use_sliding_window": cfg.has_sliding_layers,
           "sliding_window": cfg.sliding_window}
    if cfg.layer_types:
        out["layer_types"] = list(cfg.layer_types)
    return out


def decoder_layer() -> type:
    from paxkv.model.layers import DecoderLayer
    return DecoderLayer

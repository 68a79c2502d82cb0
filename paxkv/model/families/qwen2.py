"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): the Llama layer with biases on q, k and v (not on
o), and sliding layers only where `use_sliding_window` asks for them."""
from __future__ import annotations

from typing import Any, Mapping

from paxkv.config import ModelConfig
from paxkv.model.families.base import (TensorSpec, decoder_config, decoder_hf_config,
                                       decoder_tensor_specs, qwen_layer_types, reject)

ARCHITECTURE = "Qwen2ForCausalLM"
MODEL_TYPE = "qwen2"


def config_from_hf(raw: Mapping[str, Any], name: str) -> ModelConfig:
    reject(raw, "hidden_act", "silu", "only 'silu' is supported")
    types, window = qwen_layer_types(raw, int(raw.get("num_hidden_layers", 0)))
    return decoder_config(raw, name, ARCHITECTURE, qkv_bias=True, layer_types=types,
                          sliding_window=window)


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    return decoder_tensor_specs(cfg)


def hf_config(cfg: ModelConfig, dtype: Any) -> dict[str, Any]:
    out = {**decoder_hf_config(cfg, dtype, MODEL_TYPE), "hidden_act": "silu",
           "use_sliding_window": cfg.has_sliding_layers, "sliding_window": cfg.sliding_window}
    if cfg.layer_types:
        out["layer_types"] = list(cfg.layer_types)
    return out


def decoder_layer() -> type:
    from paxkv.model.layers import DecoderLayer
    return DecoderLayer

"""Mistral (`MistralForCausalLM`): the Llama layer, every layer attending through the
sliding window when `sliding_window` is set (Mistral-7B v0.1: 4,096; later versions set
none and attend to the full context)."""
from __future__ import annotations

from typing import Any, Mapping

from paxkv.config import ModelConfig
from paxkv.model.families.base import (SLIDING_ATTENTION, TensorSpec, decoder_config,
                                       decoder_hf_config, decoder_tensor_specs, reject)

ARCHITECTURE = "MistralForCausalLM"
MODEL_TYPE = "mistral"


def config_from_hf(raw: Mapping[str, Any], name: str) -> ModelConfig:
    reject(raw, "hidden_act", "silu", "only 'silu' is supported")
    if raw.get("layer_types"):
        raise ValueError("config.json field 'layer_types': a Mistral checkpoint with per-layer "
                         "attention kinds is a Ministral model, which is not supported")
    window = raw.get("sliding_window")
    layers = int(raw.get("num_hidden_layers", 0))
    types = (SLIDING_ATTENTION,) * layers if window else ()
    return decoder_config(raw, name, ARCHITECTURE, layer_types=types,
                          sliding_window=int(window) if window else None)


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    return decoder_tensor_specs(cfg)


def hf_config(cfg: ModelConfig, dtype: Any) -> dict[str, Any]:
    return {**decoder_hf_config(cfg, dtype, MODEL_TYPE), "hidden_act": "silu",
            "sliding_window": cfg.sliding_window}


def decoder_layer() -> type:
    from paxkv.model.layers import DecoderLayer
    return DecoderLayer

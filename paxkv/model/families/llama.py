"""Llama 2 / 3 / 3.1 (`LlamaForCausalLM`): the reference family, and the layer Qwen and
Mistral reuse. SmolLM2 is this family too."""
from __future__ import annotations

from typing import Any, Mapping

from paxkv.config import ModelConfig
from paxkv.model.families.base import (TensorSpec, decoder_config, decoder_hf_config,
                                       decoder_tensor_specs, reject)

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"


def config_from_hf(raw: Mapping[str, Any], name: str) -> ModelConfig:
    reject(raw, "hidden_act", "silu", "only 'silu' is supported")
    reject(raw, "mlp_bias", False, "biases in the MLP are not supported")
    bias = bool(raw.get("attention_bias", False))
    return decoder_config(raw, name, ARCHITECTURE, qkv_bias=bias, o_bias=bias)


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    return decoder_tensor_specs(cfg)


def hf_config(cfg: ModelConfig, dtype: Any) -> dict[str, Any]:
    return {**decoder_hf_config(cfg, dtype, MODEL_TYPE), "hidden_act": "silu",
            "attention_bias": cfg.qkv_bias, "mlp_bias": False}


def decoder_layer() -> type:
    from paxkv.model.layers import DecoderLayer
    return DecoderLayer

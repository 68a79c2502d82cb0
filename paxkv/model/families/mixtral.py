"""Mixtral (`MixtralForCausalLM`): Mistral's attention with every MLP replaced by a mixture of
experts (`paxkv/model/moe.py`): `num_local_experts` experts of width `intermediate_size`, the
top `num_experts_per_tok` (2) per token by a softmax router, their weights renormalised."""
from __future__ import annotations

from typing import Any, Mapping

from paxkv.config import ModelConfig
from paxkv.model.families.base import (SLIDING_ATTENTION, MoENames, TensorSpec, decoder_config,
                                       decoder_hf_config, decoder_tensor_specs, reject, require)

ARCHITECTURE = "MixtralForCausalLM"
MODEL_TYPE = "mixtral"
NAMES = MoENames(block="block_sparse_moe", router="gate", experts=("w1", "w3", "w2"))


def config_from_hf(raw: Mapping[str, Any], name: str) -> ModelConfig:
    reject(raw, "hidden_act", "silu", "only 'silu' is supported")
    require(raw, "num_local_experts", "num_experts_per_tok")
    window = raw.get("sliding_window")
    layers = int(raw.get("num_hidden_layers", 0))
    types = (SLIDING_ATTENTION,) * layers if window else ()
    return decoder_config(raw, name, ARCHITECTURE, layer_types=types,
                          sliding_window=int(window) if window else None,
                          num_experts=int(raw["num_local_experts"]),
                          num_experts_per_tok=int(raw["num_experts_per_tok"]),
                          moe_intermediate_size=int(raw.get("intermediate_size", 0)),
                          norm_topk_prob=True, moe_layers=tuple(range(layers)))


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    return decoder_tensor_specs(cfg, moe=NAMES)


def hf_config(cfg: ModelConfig, dtype: Any) -> dict[str, Any]:
    return {**decoder_hf_config(cfg, dtype, MODEL_TYPE), "hidden_act": "silu",
            "sliding_window": cfg.sliding_window, "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok, "router_jitter_noise": 0.0}


def decoder_layer() -> type:
    from paxkv.model.layers import DecoderLayer
    return DecoderLayer

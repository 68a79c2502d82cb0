"""Qwen3-MoE (`Qwen3MoeForCausalLM`, e.g. Qwen3-30B-A3B): Qwen3's attention (q/k norms) with
mixture-of-experts MLPs (`paxkv/model/moe.py`) in every `decoder_sparse_step`-th layer not
listed in `mlp_only_layers`: `num_experts` experts of width `moe_intermediate_size`, the top
`num_experts_per_tok` per token, renormalised when `norm_topk_prob`; other layers keep a
dense MLP of width `intermediate_size`."""
from __future__ import annotations

from typing import Any, Mapping

from paxkv.config import ModelConfig
from paxkv.model.families.base import (MoENames, TensorSpec, decoder_config, decoder_hf_config,
                                       decoder_tensor_specs, qwen_layer_types, reject, require)

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPE = "qwen3_moe"
NAMES = MoENames(block="mlp")


def moe_layers(num_layers: int, num_experts: int, sparse_step: int,
               mlp_only: tuple[int, ...]) -> tuple[int, ...]:
    """transformers' rule: layer i is sparse when it is not in `mlp_only_layers`, there are
    experts, and (i + 1) is a multiple of `decoder_sparse_step`."""
    return tuple(i for i in range(num_layers) if i not in mlp_only and num_experts > 0
                 and sparse_step > 0 and (i + 1) % sparse_step == 0)


def config_from_hf(raw: Mapping[str, Any], name: str) -> ModelConfig:
    reject(raw, "hidden_act", "silu", "only 'silu' is supported")
    require(raw, "num_experts_per_tok", "moe_intermediate_size")
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    if experts is None:
        raise ValueError("config.json is missing field 'num_experts'")
    layers = int(raw.get("num_hidden_layers", 0))
    bias = bool(raw.get("attention_bias", False))
    types, window = qwen_layer_types(raw, layers)
    sparse = moe_layers(layers, int(experts), int(raw.get("decoder_sparse_step", 1)),
                        tuple(int(i) for i in raw.get("mlp_only_layers") or ()))
    return decoder_config(raw, name, ARCHITECTURE, qkv_bias=bias, o_bias=bias, qk_norm=True,
                          layer_types=types, sliding_window=window, num_experts=int(experts),
                          num_experts_per_tok=int(raw["num_experts_per_tok"]),
                          moe_intermediate_size=int(raw["moe_intermediate_size"]),
                          norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                          moe_layers=sparse)


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    return decoder_tensor_specs(cfg, moe=NAMES)


def hf_config(cfg: ModelConfig, dtype: Any) -> dict[str, Any]:
    """Writes `decoder_sparse_step` 1 and lists every dense layer in `mlp_only_layers`, which
    reproduces any set of sparse layers."""
    out = {**decoder_hf_config(cfg, dtype, MODEL_TYPE), "hidden_act": "silu",
           "attention_bias": cfg.qkv_bias, "use_sliding_window": cfg.has_sliding_layers,
           "sliding_window": cfg.sliding_window, "num_experts": cfg.num_experts,
           "num_experts_per_tok": cfg.num_experts_per_tok,
           "moe_intermediate_size": cfg.moe_intermediate_size,
           "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1,
           "mlp_only_layers": [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]}
    if cfg.layer_types:
        out["layer_types"] = list(cfg.layer_types)
    return out


def decoder_layer() -> type:
    from paxkv.model.layers import DecoderLayer
    return DecoderLayer

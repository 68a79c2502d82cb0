"""What every family module shares: a checkpoint tensor's place in the parameter tree, the
config fields all decoder families read the same way, and the tensor names they share.

A family module (see `paxkv/model/families/__init__.py`) calls `decoder_config` with its
own fields and `decoder_tensor_specs` with its own extra tensors, so the names a Llama,
Qwen or Mistral checkpoint shares are written down once. Plain Python: config parsing is
host work and imports no JAX.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from paxkv.config import ModelConfig, RopeScaling

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One Hugging Face tensor and where it lives in the parameter tree."""

    hf_name: str
    path: tuple[str, ...]          # keys into the params dict
    hf_shape: tuple[int, ...]      # as stored by HF ([out, in] for linear layers)
    transpose: bool                # HF linear weights are [out, in]; Linen kernels are [in, out]
    expert: int | None = None      # the tensor is this expert's slice of a stacked [E, ...] leaf


@dataclasses.dataclass(frozen=True)
class MoENames:
    """How a family's checkpoint names a mixture-of-experts block: `{block}.{router}.weight`
    and `{block}.experts.{e}.{name}.weight` for the gate, up and down projections."""

    block: str
    router: str = "gate"
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")


def require(raw: Mapping[str, Any], *fields: str) -> None:
    for field in fields:
        if field not in raw:
            raise ValueError(f"config.json is missing field {field!r}")


def reject(raw: Mapping[str, Any], field: str, allowed: Any, why: str) -> None:
    """A config field whose value would change the math in a way paxkv does not model."""
    value = raw.get(field, allowed)
    if value != allowed and not (allowed is False and value is None):
        raise ValueError(f"config.json field {field!r}={value!r}: {why}")


def rope_scaling(spec: Mapping[str, Any] | None) -> RopeScaling | None:
    """`rope_scaling` / a `rope_parameters` entry -> RopeScaling (None for plain RoPE)."""
    if not spec:
        return None
    kind = spec.get("rope_type", spec.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling(
            factor=float(spec["factor"]), low_freq_factor=float(spec["low_freq_factor"]),
            high_freq_factor=float(spec["high_freq_factor"]),
            original_max_position_embeddings=int(spec["original_max_position_embeddings"]))
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(spec["factor"]))
    raise ValueError(f"config.json field 'rope_scaling' type {kind!r} is not supported "
                     "(supported: default, linear, llama3)")


def rope_of(raw: Mapping[str, Any], layer_type: str | None = None,
            default_theta: float = 10000.0) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from `rope_theta` + `rope_scaling` (transformers 4) or
    `rope_parameters` (transformers 5; per layer type where the family has several)."""
    theta, scaling = raw.get("rope_theta"), raw.get("rope_scaling")
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping):
        if layer_type is not None and isinstance(params.get(layer_type), Mapping):
            params = params[layer_type]
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", "default") != "default":
            scaling = params
    return float(theta if theta is not None else default_theta), rope_scaling(scaling)


def decoder_config(raw: Mapping[str, Any], name: str, architecture: str,
                   **family_fields: Any) -> ModelConfig:
    """The fields every decoder checkpoint spells the same way, plus the family's own."""
    require(raw, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    fields: dict[str, Any] = dict(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        name=name,
        architecture=architecture,
    )
    if "rope_theta" not in family_fields:
        fields["rope_theta"], fields["rope_scaling"] = rope_of(raw)
    fields.update(family_fields)
    return ModelConfig(**fields)


def layer_types_of(raw: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """`layer_types` as the checkpoint lists it, checked; () when it lists none."""
    types = raw.get("layer_types")
    if not types:
        return ()
    types = tuple(types)
    if len(types) != num_layers or not set(types) <= {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise ValueError(f"config.json field 'layer_types' must list {num_layers} entries of "
                         f"{FULL_ATTENTION!r} / {SLIDING_ATTENTION!r}, got {list(types)}")
    return types


def qwen_layer_types(raw: Mapping[str, Any], num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """Qwen2 / Qwen3: sliding layers only with `use_sliding_window`, from `max_window_layers`
    on -> (layer types, window)."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    types = layer_types_of(raw, num_layers)
    if not types and window is not None:
        first = int(raw.get("max_window_layers", num_layers))
        types = tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION
                      for i in range(num_layers))
    if SLIDING_ATTENTION not in types:
        return (), None
    return types, int(window)


def moe_tensor_specs(cfg: ModelConfig, layer: int, names: MoENames) -> list[TensorSpec]:
    """Layer `layer`'s router and experts (`paxkv/model/moe.py`): each expert's HF `[out, in]`
    weight is slice `e` of a stacked `[E, in, out]` leaf."""
    h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    pre, key = f"model.layers.{layer}.{names.block}.", f"layers_{layer}"
    specs = [TensorSpec(f"{pre}{names.router}.weight", (key, "moe", "router", "kernel"), (e, h), True)]
    shapes = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    for expert in range(e):
        for hf_name, ours in zip(names.experts, ("gate_proj", "up_proj", "down_proj")):
            specs.append(TensorSpec(f"{pre}experts.{expert}.{hf_name}.weight",
                                    (key, "moe", "experts", ours), shapes[ours], True, expert))
    return specs


def decoder_tensor_specs(cfg: ModelConfig, layer_norms: tuple[str, ...] = (
        "input_layernorm", "post_attention_layernorm"),
        moe: MoENames | None = None) -> list[TensorSpec]:
    """Every tensor of a Llama-shaped decoder checkpoint, in HF naming: embeddings, per layer
    q/k/v/o (with biases and q/k norms where the config has them), `layer_norms`, the
    gated MLP (or, in the config's mixture-of-experts layers, the experts `moe` names), the
    final norm and (untied) the LM head."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    specs = [TensorSpec("model.embed_tokens.weight", ("embed_tokens", "embedding"),
                        (cfg.vocab_size, h), False)]
    for layer in range(cfg.num_layers):
        pre, key = f"model.layers.{layer}.", f"layers_{layer}"

        def linear(block: str, part: str, out: int, inp: int, bias: bool) -> list[TensorSpec]:
            base = f"{pre}{block}.{part}."
            out_specs = [TensorSpec(base + "weight", (key, block, part, "kernel"), (out, inp), True)]
            if bias:
                out_specs.append(TensorSpec(base + "bias", (key, block, part, "bias"), (out,), False))
            return out_specs

        specs += linear("self_attn", "q_proj", q, h, cfg.qkv_bias)
        specs += linear("self_attn", "k_proj", kv, h, cfg.qkv_bias)
        specs += linear("self_attn", "v_proj", kv, h, cfg.qkv_bias)
        specs += linear("self_attn", "o_proj", h, q, cfg.o_bias)
        if cfg.qk_norm:
            for norm in ("q_norm", "k_norm"):
                specs.append(TensorSpec(f"{pre}self_attn.{norm}.weight",
                                        (key, "self_attn", norm, "scale"), (cfg.head_dim,), False))
        for norm in layer_norms:
            specs.append(TensorSpec(f"{pre}{norm}.weight", (key, norm, "scale"), (h,), False))
        if cfg.is_moe_layer(layer):
            if moe is None:
                raise ValueError(f"{cfg.architecture} has no mixture-of-experts tensor names")
            specs += moe_tensor_specs(cfg, layer, moe)
            continue
        specs += linear("mlp", "gate_proj", i, h, False)
        specs += linear("mlp", "up_proj", i, h, False)
        specs += linear("mlp", "down_proj", h, i, False)
    specs.append(TensorSpec("model.norm.weight", ("norm", "scale"), (h,), False))
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", ("lm_head", "kernel"), (cfg.vocab_size, h), True))
    return specs


def decoder_hf_config(cfg: ModelConfig, dtype: Any, model_type: str) -> dict[str, Any]:
    """The config.json fields every family writes the same way (`save_checkpoint`)."""
    eos = list(cfg.eos_token_ids)
    out: dict[str, Any] = {
        "architectures": [cfg.architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling_dict(cfg.rope_scaling),
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": str(dtype),
    }
    return out


def rope_scaling_dict(scaling: RopeScaling | None) -> dict[str, Any] | None:
    if scaling is None:
        return None
    if scaling.kind == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    return {"rope_type": "llama3", "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}

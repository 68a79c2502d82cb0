"""Model families by the checkpoint's `architectures`: one line per family.

A family is one module under `paxkv/model/families/` (its config parsing, its Hugging Face
tensor names and its decoder layer; the contract is in that package's docstring). Modules
are imported when first asked for, so parsing a config does not load every family.
"""
from __future__ import annotations

import importlib
import json
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:   # config.py parses configs through the families: no import back
    from paxkv.config import ModelConfig

# Checkpoint architecture -> family module under paxkv.model.families.
FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# config.json's `model_type` -> architecture, for configs that list no `architectures`.
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}


def family(architecture: str) -> ModuleType:
    """The family module serving `architecture` (e.g. "Qwen3ForCausalLM")."""
    if architecture not in FAMILIES:
        raise ValueError(f"architecture {architecture!r} is not supported "
                         f"(supported: {sorted(FAMILIES)})")
    return importlib.import_module(f"paxkv.model.families.{FAMILIES[architecture]}")


def family_of(cfg: "ModelConfig") -> ModuleType:
    """The family module of a parsed config."""
    return family(cfg.architecture)


def family_for_hf_config(raw: Mapping[str, Any]) -> ModuleType:
    """The family of a config.json: the first of its `architectures` paxkv serves, else its
    `model_type`'s. A ValueError names the field when there is none."""
    archs = list(raw.get("architectures") or ())
    model_type = raw.get("model_type")
    for arch in archs:
        if arch in FAMILIES:
            module = family(arch)
            if model_type is not None and model_type != module.MODEL_TYPE:
                raise ValueError(f"config.json field 'model_type'={model_type!r} does not match "
                                 f"its architecture {arch} (model_type {module.MODEL_TYPE!r})")
            return module
    if not archs and model_type in _MODEL_TYPES:
        return family(_MODEL_TYPES[model_type])
    raise ValueError(f"config.json field 'architectures'={archs} / 'model_type'={model_type!r}: "
                     f"supported architectures are {sorted(FAMILIES)}")


def config_from_hf(config: Mapping[str, Any] | str | os.PathLike, name: str = "hf") -> "ModelConfig":
    """Build a ModelConfig from a Hugging Face config.json (a dict, the file, or its dir):
    the family its `architectures` names parses it (`paxkv/model/registry.py`)."""
    if not isinstance(config, Mapping):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise ValueError(f"config.json not found: {path}")
        with open(path) as f:
            config = json.load(f)
    return family_for_hf_config(config).config_from_hf(config, name)

"""`speculative_config` as vLLM spells it (`LLM(..., speculative_config={...})`,
`paxkv serve --speculative-config JSON`), checked once: a bad key or value is a ValueError
naming it. Host-only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

METHODS = ("ngram", "draft_model", "eagle")
# the methods the engine runs (docs/speculative_decoding.md)
IMPLEMENTED_METHODS = ("ngram", "draft_model", "eagle")
MAX_SPECULATIVE_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """What to propose and how many tokens per step.

    - `method`: "ngram" (prompt lookup in the sequence's own tokens), "draft_model" (a
      smaller model with the target's tokenizer: a checkpoint, GGUF file or preset in
      `model`), or "eagle" (a head drafting from the target's hidden states: its
      safetensors file, `scripts/train_eagle.py`, in `model`).
    - `num_speculative_tokens`: tokens proposed per step, k (1..16).
    - `prompt_lookup_min` / `prompt_lookup_max` (ngram): the lengths of the suffix looked up,
      longest first.
    - `disable_by_batch_size` (vLLM's key): steps with at least this many sequences run
      without speculation; None: never. A verify step's cost grows with the batch
      (results/speculative.md: k = 4 at batch 64 costs 2.47x a decode step on an H100), while
      a large batch already reads the weights for many tokens at once.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None


_KEYS = {"method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
         "disable_by_batch_size"}


def _int(raw: Mapping[str, Any], key: str, default: int | None, lo: int, hi: int) -> int:
    value = raw.get(key, default)
    if value is None:
        raise ValueError(f"speculative_config.{key} is required")
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"speculative_config.{key} must be an integer in [{lo}, {hi}], "
                         f"got {value!r}")
    return value


def parse_speculative_config(raw: Mapping[str, Any] | SpeculativeConfig | None
                             ) -> SpeculativeConfig | None:
    """vLLM's dict (or a config, or None: no speculation) -> a checked `SpeculativeConfig`.

    As in vLLM, `method` may be left out when `model` is given ("draft_model"), and
    "[ngram]" is taken for "ngram".
    """
    if raw is None or isinstance(raw, SpeculativeConfig):
        return raw
    if not isinstance(raw, Mapping):
        raise ValueError(f"speculative_config must be a dict, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ValueError(f"speculative_config.{unknown[0]} is not a known key "
                         f"(known: {sorted(_KEYS)})")
    method = raw.get("method")
    if method == "[ngram]":
        method = "ngram"
    if method is None and raw.get("model") is not None:
        method = "draft_model"
    if method not in METHODS:
        raise ValueError(f"speculative_config.method must be one of {METHODS}, got {method!r}")
    k = _int(raw, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
    model = raw.get("model")
    off_at = (None if raw.get("disable_by_batch_size") is None
              else _int(raw, "disable_by_batch_size", None, 1, 1 << 20))
    if method == "ngram":
        if model is not None:
            raise ValueError("speculative_config.model is not used by method 'ngram'")
        lo = _int(raw, "prompt_lookup_min", 1, 1, 64)
        hi = _int(raw, "prompt_lookup_max", max(lo, 4), 1, 64)
        if hi < lo:
            raise ValueError(f"speculative_config.prompt_lookup_max ({hi}) must be >= "
                             f"prompt_lookup_min ({lo})")
        return SpeculativeConfig(method, k, None, lo, hi, off_at)
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if key in raw:
            raise ValueError(f"speculative_config.{key} is used by method 'ngram' only")
    if not isinstance(model, str) or not model:
        what = ("an EAGLE head's safetensors file" if method == "eagle"
                else "a checkpoint, GGUF file or preset")
        raise ValueError(f"speculative_config.model must name the {method} model "
                         f"({what}), got {model!r}")
    return SpeculativeConfig(method, k, model, disable_by_batch_size=off_at)

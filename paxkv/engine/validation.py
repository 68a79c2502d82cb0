"""Request intake: one place that decides whether a request can be served, shared by `LLM`,
`LLMEngine` and the server.

Every check names the field it refuses. Wrong types raise TypeError, wrong values ValueError;
nothing is coerced silently (a float seed or a float token id is refused, not truncated, and
`True` is not the integer 1). Checks that need only the request live in `check_*` helpers that
`SamplingParams` runs at construction; checks that need the engine (vocabulary, context
length, `max_logprobs`) live in `RequestValidator`, run by `add_request` before anything is
queued.

Host-only: no JAX.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, Mapping, Sequence

DEFAULT_MAX_LOGPROBS = 20  # vLLM's default cap on `logprobs` and `prompt_logprobs`


def _type_name(value: Any) -> str:
    return type(value).__name__


def is_int(value: Any) -> bool:
    """A Python or numpy integer, and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: Any, *, low: int | None = None, high: int | None = None,
              optional: bool = False) -> int | None:
    """`value` as an int in [low, high]; bools, floats and strings are refused."""
    if value is None and optional:
        return None
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {_type_name(value)} {value!r}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value


def check_float(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False, optional: bool = False) -> float | None:
    """`value` as a finite float in the given range (NaN and inf are refused)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {_type_name(value)} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {_type_name(value)} {value!r}")
    return value


def check_int_list(name: str, value: Any, *, optional: bool = True, non_empty: bool = False,
                   low: int | None = 0) -> list[int] | None:
    """A list (or tuple, or array) of ints, each >= `low`."""
    if value is None and optional:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list of ints, got {_type_name(value)}")
    out = []
    for i, v in enumerate(value):
        out.append(check_int(f"{name}[{i}]", v, low=low))
    if non_empty and not out:
        raise ValueError(f"{name} must not be empty")
    return out


def check_str_list(name: str, value: Any, *, allow_single: bool = True) -> list[str]:
    """None -> []; a string -> [it] (when `allow_single`); a list of non-empty strings."""
    if value is None:
        return []
    if isinstance(value, str) and allow_single:
        value = [value]
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list of strings, got {_type_name(value)}")
    out = list(value)
    for i, s in enumerate(out):
        if not isinstance(s, str):
            raise TypeError(f"{name}[{i}] must be a string, got {_type_name(s)}")
        if not s:
            raise ValueError(f"{name}[{i}] must be a non-empty string")
    return out


def check_token_ids_in_vocab(name: str, ids: Iterable[int], vocab_size: int) -> None:
    for t in ids:
        if not 0 <= t < vocab_size:
            raise ValueError(f"{name} holds token id {t}, outside the vocabulary [0, {vocab_size})")


class RequestValidator:
    """The checks that need the engine: vocabulary, context length, logprob caps, tokenizer.

    `prompt()` turns a prompt into (text, token ids) or refuses it; `params()` checks a
    `SamplingParams` against the engine's limits. Neither changes any state, so a caller can
    check a whole batch before queueing any of it.
    """

    def __init__(self, vocab_size: int, max_model_len: int, tokenizer: Any | None = None,
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS, num_layers: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.num_layers = num_layers
        self.max_logprobs = check_int("max_logprobs", max_logprobs, low=0)

    def prompt(self, prompt: Any) -> tuple[str | None, list[int]]:
        """A string (tokenized) or a sequence of int token ids -> (text or None, ids)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; give prompts as token ids")
            text, ids = prompt, list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, (bytes, Mapping)) or not isinstance(prompt, Iterable):
            raise TypeError(f"prompt must be a string or a list of token ids, got {_type_name(prompt)}")
        else:
            text = None
            # The common case, a list of Python ints, is checked in C (type set, min, max);
            # anything else takes the loop that names the offending element.
            if type(prompt) is list and set(map(type, prompt)) <= {int}:
                ids = list(prompt)
            else:
                ids = []
                for i, t in enumerate(prompt):
                    if not is_int(t):
                        raise TypeError(f"prompt token ids must be ints: prompt[{i}] is "
                                        f"{_type_name(t)} {t!r}")
                    ids.append(int(t))
        if not ids:
            raise ValueError("prompt is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            t = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"prompt token id {t} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt length {len(ids)} leaves no room under max_model_len "
                             f"{self.max_model_len}")
        return text, ids

    def params(self, params: Any) -> None:
        """Engine-dependent limits of one `SamplingParams` (its own checks ran at construction)."""
        from paxkv.sampling_params import SamplingParams
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {_type_name(params)}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise ValueError(f"{name} {k} exceeds max_logprobs {self.max_logprobs} "
                                 "(an engine argument)")
        v = self.vocab_size
        check_token_ids_in_vocab("stop_token_ids", params.stop_token_ids, v)
        check_token_ids_in_vocab("logit_bias", params.logit_bias or {}, v)
        check_token_ids_in_vocab("allowed_token_ids", params.allowed_token_ids or (), v)
        layers = params.return_hidden_states or ()
        check_hidden_layers("return_hidden_states", layers, self.num_layers)
        if (params.bad_words or params.structured_outputs is not None) and self.tokenizer is None:
            field = "bad_words" if params.bad_words else "structured_outputs"
            raise ValueError(f"{field} needs a tokenizer; this model has none")


def check_hidden_layers(name: str, layers: Sequence[int], num_layers: int | None) -> None:
    """Layer i is transformers' hidden_states[i]: 0 = embeddings, num_layers = the last."""
    if num_layers is None:
        return
    for i in layers:
        if not 0 <= i <= num_layers:
            raise ValueError(f"{name} layer {i} is outside [0, {num_layers}]")

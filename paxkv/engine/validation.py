"""Request intake: one place that decides whether a request can be served, shared by `LLM`,
`LLMEngine` and the server.

Every check names the field it refuses. Checks that need only the request live in
`paxkv/field_checks.py`, which `SamplingParams` runs at construction; checks that need the
engine (vocabulary, context length, `max_logprobs`) live in `RequestValidator`, run by
`add_request` before anything is queued.

Host-only: no JAX.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from paxkv.field_checks import check_int, check_token_ids_in_vocab, is_int, type_name
from paxkv.sampling_params import SamplingParams

DEFAULT_MAX_LOGPROBS = 20  # vLLM's default cap on `logprobs` and `prompt_logprobs`


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
            raise TypeError(f"prompt must be a string or a list of token ids, got {type_name(prompt)}")
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
                                        f"{type_name(t)} {t!r}")
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
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type_name(params)}")
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

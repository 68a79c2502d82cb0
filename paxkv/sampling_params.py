"""User-facing request parameters (vLLM's names), validated at construction.

Host-only: no JAX. A bad field raises ValueError (TypeError for a wrong type) naming it,
before anything is scheduled; `field_checks.py` holds the checks, and the limits that
need the engine (vocabulary, `max_logprobs`) run at `add_request`.
"""
from __future__ import annotations

import dataclasses
import enum
import json as _json
from typing import Any, Mapping, Sequence

from paxkv.field_checks import check_bool, check_float, check_int, check_int_list, check_str_list

# OpenAI's ranges for the penalties and the logit bias.
PENALTY_RANGE = 2.0
LOGIT_BIAS_RANGE = 100.0


@dataclasses.dataclass
class StructuredOutputsParams:
    """Constrain the output to a language; exactly one of the fields is set.

    `json`: a JSON schema (dict or its text); `json_object`: any JSON object; `regex`: a
    regular expression; `choice`: one of these strings; `grammar`: a Lark grammar (llguidance's
    dialect). Compiled by llguidance at `add_request`; a grammar that does not compile is refused
    there with llguidance's message.
    """

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]
        if check_bool("structured_outputs.json_object", self.json_object):
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, "
                             f"choice, grammar; got {given or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    _json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            elif not isinstance(self.json, Mapping):
                raise TypeError("structured_outputs.json must be a dict or a JSON string, got "
                                f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"structured_outputs.{name} must be a string, got {type(value).__name__}")
            if value == "":
                raise ValueError(f"structured_outputs.{name} must not be empty")
        if self.choice is not None:
            self.choice = check_str_list("structured_outputs.choice", self.choice, allow_single=False)
            if not self.choice:
                raise ValueError("structured_outputs.choice must not be empty")


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a request holds (vLLM's names).

    CUMULATIVE: everything so far. DELTA: only what is new since the request's previous
    output (token ids, logprobs, text, hidden states; prompt logprobs with the first), which
    is what a stream sends and costs the engine O(new tokens) per step instead of O(output).
    FINAL_ONLY: nothing until the request finishes, then everything.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request. temperature 0 means greedy.

    Penalties follow vLLM (and OpenAI for presence/frequency): with c the count of a token in
    the output so far, `logit -= frequency_penalty * c + presence_penalty * (c > 0)`; with a
    token anywhere in prompt or output, `logit /= repetition_penalty` if positive, else
    `logit *= repetition_penalty`. `logit_bias` adds to the logits; `allowed_token_ids` bans
    every other id; `bad_words` bans a word's last token when the output ends with the tokens
    before it. `prompt_logprobs=k` returns, for every prompt token after the first, its own
    logprob and the top k. `return_hidden_states=[layers]` returns, for each generated token,
    the residual stream (transformers' `hidden_states[i]`) at the position that chose it.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    detokenize: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[str] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    return_hidden_states: Sequence[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self.n = check_int("n", self.n, low=1)
        self.best_of = check_int("best_of", self.best_of, low=1, optional=True)
        if self.best_of is None:
            self.best_of = self.n
        if self.best_of < self.n:
            raise ValueError(f"best_of must be >= n, got best_of={self.best_of}, n={self.n}")
        self.temperature = check_float("temperature", self.temperature, low=0.0)
        self.top_p = check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        self.top_k = check_int("top_k", self.top_k, low=-1)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, got 0")
        self.min_p = check_float("min_p", self.min_p, low=0.0, high=1.0)
        self.seed = check_int("seed", self.seed, low=0, high=2**31 - 1, optional=True)
        self.max_tokens = check_int("max_tokens", self.max_tokens, low=1, optional=True)
        self.min_tokens = check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        self.stop = check_str_list("stop", self.stop)
        self.stop_token_ids = check_int_list("stop_token_ids", self.stop_token_ids) or []
        self.ignore_eos = check_bool("ignore_eos", self.ignore_eos)
        self.include_stop_str_in_output = check_bool("include_stop_str_in_output",
                                                     self.include_stop_str_in_output)
        self.logprobs = check_int("logprobs", self.logprobs, low=0, optional=True)
        self.detokenize = check_bool("detokenize", self.detokenize)
        r = PENALTY_RANGE
        self.presence_penalty = check_float("presence_penalty", self.presence_penalty, low=-r, high=r)
        self.frequency_penalty = check_float("frequency_penalty", self.frequency_penalty, low=-r, high=r)
        self.repetition_penalty = check_float("repetition_penalty", self.repetition_penalty,
                                              low=0.0, low_open=True)
        self.logit_bias = self._check_logit_bias(self.logit_bias)
        self.allowed_token_ids = check_int_list("allowed_token_ids", self.allowed_token_ids,
                                                non_empty=True)
        self.bad_words = check_str_list("bad_words", self.bad_words, allow_single=False) or None
        self.prompt_logprobs = check_int("prompt_logprobs", self.prompt_logprobs, low=0, optional=True)
        if (self.structured_outputs is not None
                and not isinstance(self.structured_outputs, StructuredOutputsParams)):
            raise TypeError("structured_outputs must be StructuredOutputsParams, got "
                            f"{type(self.structured_outputs).__name__}")
        layers = check_int_list("return_hidden_states", self.return_hidden_states, non_empty=True)
        if layers is not None and len(set(layers)) != len(layers):
            raise ValueError(f"return_hidden_states lists a layer twice: {layers}")
        self.return_hidden_states = layers
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.output_kind is RequestOutputKind.DELTA and self.best_of > self.n:
            raise ValueError("output_kind DELTA cannot rank samples: best_of must equal n, got "
                             f"best_of={self.best_of}, n={self.n}")

    @staticmethod
    def _check_logit_bias(bias: Any) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, Mapping):
            raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
        out = {}
        for k, v in bias.items():
            # JSON carries the ids as strings ("123"): the server converts before this point.
            token = check_int("logit_bias token id", k, low=0)
            out[token] = check_float(f"logit_bias[{token}]", v, low=-LOGIT_BIAS_RANGE,
                                     high=LOGIT_BIAS_RANGE)
        return out or None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def needs_host_sync(self) -> bool:
        """Whether step t+1's inputs for this request depend on the host knowing step t's token.

        Only structured outputs do: the grammar's token mask is advanced on the host. Penalties
        and bad words are counted on the device from the token history plus the token the step
        feeds, so an engine whose host learns tokens one step late serves them unchanged.
        """
        return self.structured_outputs is not None


@dataclasses.dataclass
class BeamSearchParams:
    """Beam search: beams are forked sequences that share KV blocks copy-on-write."""

    beam_width: int = 4
    max_tokens: int = 32
    length_penalty: float = 1.0
    ignore_eos: bool = False
    early_stopping: bool = True

    def __post_init__(self) -> None:
        self.beam_width = check_int("beam_width", self.beam_width, low=1)
        self.max_tokens = check_int("max_tokens", self.max_tokens, low=1)
        self.length_penalty = check_float("length_penalty", self.length_penalty)
        self.ignore_eos = check_bool("ignore_eos", self.ignore_eos)
        self.early_stopping = check_bool("early_stopping", self.early_stopping)

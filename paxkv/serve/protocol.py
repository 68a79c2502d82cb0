"""OpenAI request bodies as pydantic models, and their mapping onto SamplingParams.

Types are checked strictly (a string where a number belongs is a 400, not a silent cast);
value ranges are not re-checked here: `to_sampling_params` builds `SamplingParams`, whose
own checks (the engine's) raise a ValueError naming the field. Fields OpenAI defines that
the engine cannot honour are rejected when set, never silently ignored.

Structured outputs come in by OpenAI's `response_format` (json_object, json_schema), vLLM's
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, or vLLM's
`structured_outputs` object; at most one of them per request. Errors name the field used.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from paxkv.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

class OpenAIModel(BaseModel):
    # Unknown fields are kept (and reported in a warning) so newer clients still work.
    model_config = ConfigDict(strict=True, extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's `response_format`: plain text, any JSON object, or a named JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(OpenAIModel):
    """vLLM's `structured_outputs` request object (exactly one field set)."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM's extras included)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    repetition_penalty: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsFields | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, reason) of the first set field the engine cannot honour."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        if self.prompt_logprobs is not None and self.stream:
            return "prompt_logprobs", "prompt_logprobs cannot be streamed"
        return None

    def structured_field(self) -> str | None:
        """The one request field asking for structured outputs (ValueError naming them if
        several do); None for none."""
        given = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                   "structured_outputs") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise ValueError(f"{given[0]}: give one way to structure the output, got {', '.join(given)}")
        return given[0] if given else None

    def structured_params(self) -> StructuredOutputsParams | None:
        """StructuredOutputsParams of the structured-output field; ValueError names it."""
        field = self.structured_field()
        if field is None:
            return None
        if field == "response_format":
            fmt = self.response_format
            if fmt.type == "json_object":
                kw: dict[str, Any] = {"json_object": True}
            elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ValueError("response_format: type json_schema needs json_schema.schema")
            else:
                kw = {"json": fmt.json_schema.schema_}
        elif field == "structured_outputs":
            so = self.structured_outputs
            kw = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                  "json_object": bool(so.json_object)}
        else:
            kw = {field[len("guided_"):]: getattr(self, field)}
        try:
            return StructuredOutputsParams(**kw)
        except (ValueError, TypeError) as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith(field) else f"{field}: {msg}") from None

    def token_logit_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias keys are token ids written as strings."""
        if self.logit_bias is None:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            try:
                out[int(key)] = value
            except ValueError:
                raise ValueError(f"logit_bias: key {key!r} is not a token id") from None
        return out

    def common_params(self, max_tokens: int | None, logprobs: int | None,
                      best_of: int | None = None) -> SamplingParams:
        """SamplingParams from these fields; its ValueError names the bad field."""
        return SamplingParams(
            n=self.n, best_of=best_of,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.token_logit_bias(), allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words, prompt_logprobs=self.prompt_logprobs,
            structured_outputs=self.structured_params(),
            detokenize=False,   # the server detokenizes incrementally itself
            # a stream needs only what is new each step; the rest is sent whole at its end
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.CUMULATIVE)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (a string, a token-id list, or lists of those)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return [[]]   # an empty token list: the engine's check reports it
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: score the prompt, generate nothing (lm-eval's
        loglikelihood requests; vLLM runs one step and drops its token, as here)."""
        return self.echo and self.max_tokens == 0

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.echo and self.stream and (self.logprobs is not None or self.max_tokens == 0):
            return "echo", "echo with logprobs or max_tokens 0 cannot be streamed"
        if self.stream and self.best_of is not None and self.best_of > self.n:
            return "best_of", "best_of > n cannot be streamed"
        return super().unsupported()

    def to_sampling_params(self) -> SamplingParams:
        params = self.common_params(1 if self.echo_only else self.max_tokens, self.logprobs,
                                    self.best_of)
        if self.echo and self.logprobs is not None:   # the echoed prompt's logprobs
            params = dataclasses.replace(params, prompt_logprobs=max(self.prompt_logprobs or 0,
                                                                     self.logprobs))
        return params


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tools are not supported"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs to be true"
        return super().unsupported()

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.common_params(max_tokens, logprobs)

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]

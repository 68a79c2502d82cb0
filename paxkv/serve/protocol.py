"""OpenAI request bodies as pydantic models, and their mapping onto SamplingParams.

Types are checked strictly (a string where a number belongs is a 400, not a silent cast);
value ranges are not re-checked here: `to_sampling_params` builds `SamplingParams`, whose
own checks (the engine's) raise a ValueError naming the field. Fields OpenAI defines that
the engine cannot honour are rejected when set, never silently ignored.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from paxkv.sampling_params import SamplingParams

class OpenAIModel(BaseModel):
    # Unknown fields are kept (and reported in a warning) so newer clients still work.
    model_config = ConfigDict(strict=True, extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class StreamOptions(OpenAIModel):
    include_usage: bool = False


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

    def unsupported(self) -> tuple[str, str] | None:
        """(field, reason) of the first set field the engine cannot honour."""
        if self.presence_penalty:
            return "presence_penalty", "presence_penalty is not supported (must be 0)"
        if self.frequency_penalty:
            return "frequency_penalty", "frequency_penalty is not supported (must be 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None

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
            detokenize=False)   # the server detokenizes incrementally itself

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

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.echo and self.logprobs is not None:
            return "echo", "echo with logprobs needs prompt logprobs, which are not supported"
        if self.stream and self.best_of is not None and self.best_of > self.n:
            return "best_of", "best_of > n cannot be streamed"
        return super().unsupported()

    def to_sampling_params(self) -> SamplingParams:
        return self.common_params(self.max_tokens, self.logprobs, self.best_of)


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
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tools are not supported"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format", "response_format other than text is not supported"
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

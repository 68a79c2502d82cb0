"""What generate() and step() return (vLLM's RequestOutput / CompletionOutput shapes)."""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None
    # SamplingParams(return_hidden_states=layers): {layer: [len(token_ids), hidden] float32},
    # row i taken at the position whose logits chose token i.
    hidden_states: dict[int, Any] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Host clock (time.monotonic) stamps of one request's life, for latency figures."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # SamplingParams(prompt_logprobs=k): per prompt token, {its id and the top k: logprob};
    # None for the first token, which nothing predicts.
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclasses.dataclass
class EncodeOutput:
    """What LLM.encode returns: the prompt's hidden states, pooled, as numpy float32.

    `hidden_states[layer]` is `[hidden]` for pooling "last" and "mean", `[len(prompt), hidden]`
    for "none"; layer i is transformers' hidden_states[i].
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    hidden_states: dict[int, Any]

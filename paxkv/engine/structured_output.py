"""Structured outputs on the host: grammars compiled by llguidance, one matcher per sample,
token bitmasks for the device.

llguidance (a Rust library, no PyTorch) compiles a JSON schema, regex, choice list or Lark
grammar against the tokenizer's vocabulary; a matcher then yields, before each token, the
bitmask of the tokens the grammar allows (the sampler applies it on the device,
`sampling/processors.apply_token_bitmask`), and consumes the token sampled. The masks of all
constrained rows of a step are filled in one call that runs in llguidance's thread pool
(without the GIL).

The mask for step t+1 depends on the token sampled at step t, so a request with structured
outputs needs the host to know its previous token before its next step
(`SamplingParams.needs_host_sync`).
"""
from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from paxkv.sampling_params import StructuredOutputsParams


def _llguidance():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401
        import llguidance.numpy  # noqa: F401
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ValueError("structured_outputs needs the llguidance package "
                         "(python3 -m pip install llguidance)") from e
    return llguidance


def grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar of a StructuredOutputsParams (not compiled yet)."""
    llg = _llguidance()
    m = llg.LLMatcher
    # Compact JSON (no free whitespace between tokens, vLLM's disable_any_whitespace): a model
    # may otherwise spend its whole budget on newlines that every grammar state allows.
    compact = {"whitespace_flexible": False}
    if so.json is not None:
        schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
        return m.grammar_from_json_schema(schema, defaults=compact)
    if so.json_object:
        return m.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=compact)
    if so.regex is not None:
        return m.grammar_from_regex(so.regex)
    if so.choice is not None:   # a Lark alternation of JSON-quoted literals
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    return m.grammar_from_lark(so.grammar)


class StructuredOutputs:
    """The engine's llguidance side: compile at add_request, matchers, batched mask filling."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf = tokenizer.hf if hasattr(tokenizer, "hf") else tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer = None
        self._executor = None
        self._cache: dict[str, Any] = {}

    @property
    def words(self) -> int:
        return -(-self.vocab_size // 32)

    def _ll_tokenizer(self) -> Any:
        if self._tokenizer is None:   # ~1 s for a large vocabulary: built once, on first use
            llg = _llguidance()
            self._tokenizer = llg.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                    eos_token=self.eos_token_ids or None)
        return self._tokenizer

    def compile(self, so: StructuredOutputsParams) -> Any:
        """A fresh matcher at the grammar's start; ValueError with llguidance's message if the
        grammar does not compile."""
        llg = _llguidance()
        try:
            grammar = grammar_text(so)
        except ValueError as e:
            raise ValueError(f"structured_outputs: {e}") from None
        template = self._cache.get(grammar)
        if template is None:
            template = llg.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"structured_outputs: the grammar does not compile: "
                                 f"{template.get_error()}")
            if len(self._cache) < 256:
                self._cache[grammar] = template
        return template.deep_copy()

    def fill_masks(self, matchers: Sequence[Any]) -> np.ndarray:
        """Bitmasks `[len(matchers), ceil(V/32)]` int32 of the next allowed tokens, filled
        in parallel."""
        llg = _llguidance()
        masks = llg.numpy.allocate_token_bitmask(len(matchers), self.vocab_size)
        if not matchers:
            return masks
        if len(matchers) == 1:
            llg.numpy.fill_next_token_bitmask(matchers[0], masks, 0)
            return masks
        if self._executor is None:
            self._executor = llg.LLExecutor()
        llg.numpy.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)],
                                              masks)
        return masks

    @staticmethod
    def consume(matcher: Any, token: int) -> None:
        """Advance past a sampled token (tokens after the grammar's end are ignored: the
        request stops on EOS, which the mask then allows alone)."""
        if not matcher.is_stopped():
            matcher.consume_token(int(token))

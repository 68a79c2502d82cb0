"""Host bookkeeping of the per-request sampling features: what each row and work item asks
of the device, and what comes back (prompt logprobs, hidden states, grammar state).

The engine calls in at a few points: `prepare` (validation, before queueing: tokenizes bad
words, compiles grammars), `row_features` / `item_features` (building a step),
`fill_masks` (once per step, before it runs), `on_item_output` / `on_token` / `on_fork`
(after it). A request that uses none of the features has no state here and costs nothing.

Host-only: no JAX.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from paxkv.sampling.rows import ItemFeatures, RowFeatures
from paxkv.sampling_params import SamplingParams

POOLINGS = ("last", "mean", "none")


@dataclasses.dataclass(frozen=True)
class EncodeSpec:
    """LLM.encode: the prompt's hidden states at `layers`, pooled."""

    layers: tuple[int, ...]
    pooling: str


@dataclasses.dataclass
class FeatureState:
    """One request's feature state; absent for requests that use no feature."""

    params: SamplingParams
    prompt_token_ids: list[int]
    bad_words: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    grammar: Any = None                       # a matcher at the grammar's start (template)
    matchers: dict[int, Any] = dataclasses.field(default_factory=dict)   # seq_id -> matcher
    tokens: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # seq_id -> ids
    prompt_logprobs: list[dict[int, float] | None] | None = None
    hidden: dict[int, list[np.ndarray]] = dataclasses.field(default_factory=dict)  # generated
    encode: EncodeSpec | None = None
    prompt_hidden: np.ndarray | None = None   # [P, layers, hidden] for encode

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def needs_history(self) -> bool:
        return self.params.uses_penalties or any(len(w) > 1 for w in self.bad_words)

    @property
    def needs_every_prompt_position(self) -> bool:
        """Prompt logprobs and full-prompt encodes must compute every prompt token: such
        requests skip the prefix cache."""
        return (self.params.prompt_logprobs is not None
                or (self.encode is not None and self.encode.pooling != "last"))


def uses_features(params: SamplingParams) -> bool:
    return (params.uses_penalties or bool(params.logit_bias) or params.allowed_token_ids is not None
            or bool(params.bad_words) or params.prompt_logprobs is not None
            or params.structured_outputs is not None or params.return_hidden_states is not None)


class RequestFeatures:
    """The engine's side of the sampling features (one per engine)."""

    def __init__(self, tokenizer: Any | None, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._structured = None
        self._pending: list[tuple[Any, list]] = []   # (matcher, slot for its mask) this step

    @property
    def structured(self) -> Any:
        if self._structured is None:
            from paxkv.engine.structured_output import StructuredOutputs
            self._structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._structured

    # ---- intake ----------------------------------------------------------------------------
    def prepare(self, params: SamplingParams, prompt_token_ids: list[int],
                encode: EncodeSpec | None = None) -> FeatureState | None:
        """Tokenize bad words and compile the grammar; ValueError names the field. No state."""
        if not uses_features(params) and encode is None:
            return None
        state = FeatureState(params, prompt_token_ids, encode=encode)
        if params.bad_words:
            state.bad_words = self.tokenize_bad_words(params.bad_words)
        if params.structured_outputs is not None:
            state.grammar = self.structured.compile(params.structured_outputs)
        return state

    def tokenize_bad_words(self, words: Sequence[str]) -> list[tuple[int, ...]]:
        """Each word as it reads at the start of the text and after a space (both banned)."""
        out: list[tuple[int, ...]] = []
        for w in words:
            for text in (w.lstrip(), " " + w.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if not ids:
                    raise ValueError(f"bad_words entry {w!r} tokenizes to nothing")
                if ids not in out:
                    out.append(ids)
        return out

    def attach(self, state: FeatureState | None, seq: Any) -> None:
        """Bind a prepared state to the request's first sequence."""
        if state is None:
            return
        seq.skip_prefix_cache = state.needs_every_prompt_position
        if state.grammar is not None:
            state.matchers[seq.seq_id] = state.grammar
        if state.needs_history:
            state.tokens[seq.seq_id] = np.asarray(seq.token_ids, np.int32)
        if state.params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * state.num_prompt_tokens
        if state.encode is not None and state.encode.pooling != "last":
            state.prompt_hidden = None   # allocated on the first chunk (its width comes back)

    # ---- building a step -------------------------------------------------------------------
    def row_features(self, state: FeatureState | None, seq: Any) -> RowFeatures | None:
        """The device-side features of one sampling row of `seq` (its last token is fed)."""
        if state is None:
            return None
        p = state.params
        history, start = None, 0
        if state.needs_history:
            tokens = state.tokens[seq.seq_id]
            fed = seq.num_tokens - 1            # tokens before the one this step feeds
            if len(tokens) < fed:               # the fed token may be a placeholder, no other
                raise RuntimeError(f"sequence {seq.seq_id}: history of {len(tokens)} tokens "
                                   f"known, {fed} needed")
            if p.uses_penalties:
                lo = 0
            else:                              # bad words look only at the recent outputs
                lo = max(0, fed - (max(len(w) for w in state.bad_words) - 2))
            history, start = tokens[lo:fed], state.num_prompt_tokens - lo
        mask = None
        if state.grammar is not None:
            slot: list = []
            self._pending.append((state.matchers[seq.seq_id], slot))
            mask = slot            # filled by fill_masks while the step's forward runs
        return RowFeatures(
            penalties=((p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
                       if p.uses_penalties else None),
            history=history, output_start=start, logit_bias=p.logit_bias,
            allowed_token_ids=p.allowed_token_ids, bad_words=state.bad_words, mask=mask)

    @property
    def has_pending_masks(self) -> bool:
        return bool(self._pending)

    def fill_masks(self, rows: list) -> list:
        """Compute this step's grammar masks in one parallel call and put them in the rows."""
        if not self._pending:
            return rows
        masks = self.structured.fill_masks([m for m, _ in self._pending])
        for (_, slot), mask in zip(self._pending, masks):
            slot.append(mask)
        self._pending = []
        out = []
        for row in rows:
            f = row.features
            if f is not None and isinstance(f.mask, list):
                row = row._replace(features=f._replace(mask=f.mask[0]))
            out.append(row)
        return out

    def item_features(self, state: FeatureState | None, start: int, num_tokens: int,
                      reaches_end: bool) -> ItemFeatures | None:
        """What a chunk of `num_tokens` tokens from position `start` must return."""
        if state is None:
            return None
        kp, targets = None, ()
        n_prompt = state.num_prompt_tokens
        if state.prompt_logprobs is not None and start < n_prompt - 1:
            kp = state.params.prompt_logprobs
            targets = state.prompt_token_ids[start + 1:min(start + num_tokens, n_prompt - 1) + 1]
        hidden, layers = None, ()
        if state.encode is not None:
            layers = state.encode.layers
            if state.encode.pooling != "last" and start < n_prompt:
                hidden = "all"
            elif reaches_end:
                hidden = "last"
        elif state.params.return_hidden_states is not None and reaches_end:
            hidden, layers = "last", tuple(state.params.return_hidden_states)
        if kp is None and hidden is None:
            return None
        return ItemFeatures(kp, targets, hidden, layers)

    # ---- after a step ------------------------------------------------------------------------
    def on_item_output(self, state: FeatureState, start: int, item: int, sample: Any) -> None:
        """Record a chunk's prompt logprobs (by position: a recomputed chunk rewrites the same
        entries) and, for encodes, its prompt hidden states."""
        spans = sample.spans
        first, count = spans.prompt[item]
        k = state.params.prompt_logprobs
        if state.prompt_logprobs is not None and count:
            lps = sample.prompt_logprobs[first:first + count].tolist()
            ids = sample.prompt_top_ids[first:first + count, :k].tolist()
            top = sample.prompt_top_logprobs[first:first + count, :k].tolist()
            for j in range(count):
                pos = start + j + 1
                entry = {state.prompt_token_ids[pos]: lps[j]}
                entry.update(zip(ids[j], top[j]))
                state.prompt_logprobs[pos] = entry
        if state.encode is not None:
            first, count = spans.hidden[item]
            if not count:
                return
            h = self._layers(sample, state.encode.layers, first, count)
            if state.encode.pooling == "last":
                state.prompt_hidden = h
                return
            if state.prompt_hidden is None:
                state.prompt_hidden = np.zeros((state.num_prompt_tokens,) + h.shape[1:], np.float32)
            n = min(count, state.num_prompt_tokens - start)
            state.prompt_hidden[start:start + n] = h[:n]

    @staticmethod
    def _layers(sample: Any, layers: Sequence[int], first: int, count: int) -> np.ndarray:
        """The rows of `layers` (in their order) out of the step's hidden output."""
        returned = sample.spans.hidden_layers
        cols = [returned.index(i) for i in layers]
        return np.array(sample.hidden[first:first + count][:, cols], np.float32)

    def generated_hidden(self, state: FeatureState, item: int, sample: Any) -> np.ndarray | None:
        """`[layers, hidden]` at the position that chose this step's token, if asked for."""
        if state is None or state.params.return_hidden_states is None or state.encode is not None:
            return None
        first, count = sample.spans.hidden[item]
        if not count:
            return None
        return self._layers(sample, state.params.return_hidden_states, first, 1)[0]

    def on_token(self, state: FeatureState | None, seq: Any, token: int,
                 hidden: np.ndarray | None = None) -> None:
        """A token was appended to `seq`: advance its grammar, history and hidden states."""
        if state is None:
            return
        if state.grammar is not None:
            self.structured.consume(state.matchers[seq.seq_id], token)
        if state.needs_history:
            state.tokens[seq.seq_id] = np.append(state.tokens[seq.seq_id], np.int32(token))
        if hidden is not None:
            state.hidden.setdefault(seq.seq_id, []).append(hidden)

    def on_fork(self, state: FeatureState | None, parent: Any, child: Any) -> None:
        """`child` was forked from `parent` before either appended its next token."""
        if state is None:
            return
        if state.grammar is not None:
            state.matchers[child.seq_id] = state.matchers[parent.seq_id].deep_copy()
        if state.needs_history:
            state.tokens[child.seq_id] = state.tokens[parent.seq_id].copy()
        if parent.seq_id in state.hidden:
            state.hidden[child.seq_id] = list(state.hidden[parent.seq_id])

    # ---- outputs -----------------------------------------------------------------------------
    @staticmethod
    def hidden_states_of(state: FeatureState | None, seq: Any, start: int = 0,
                         stop: int | None = None) -> dict[int, np.ndarray] | None:
        """{layer: [generated tokens, hidden]} for a sample, if asked for; of its generated
        tokens `start:stop` only (a DELTA output stacks just its new rows)."""
        if state is None or state.params.return_hidden_states is None or state.encode is not None:
            return None
        all_rows = state.hidden.get(seq.seq_id, [])
        width = all_rows[0].shape[-1] if all_rows else 0
        rows = all_rows[start:stop]
        stacked = np.stack(rows) if rows else np.zeros((0, len(state.params.return_hidden_states), width))
        return {layer: stacked[:, i] for i, layer in enumerate(state.params.return_hidden_states)}

    @staticmethod
    def pooled(state: FeatureState) -> dict[int, np.ndarray]:
        """{layer: pooled hidden state} of an encode request."""
        spec = state.encode
        h = state.prompt_hidden
        if spec.pooling == "last":
            h = h[0]
        elif spec.pooling == "mean":
            h = h.mean(axis=0)
        return {layer: np.ascontiguousarray(h[..., i, :]) for i, layer in enumerate(spec.layers)}

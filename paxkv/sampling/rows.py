"""Host side of the logits processors: per-row and per-item feature records, and their
packing into the padded numpy arrays of `SamplingTensors` (see `processors.py` for layouts).

Host-only: numpy, no JAX. Widths are bucketed to powers of two so that a steady workload
reuses its compiled step; a feature no row uses gets a zero-sized dimension and costs nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple, Sequence

import numpy as np


# The sampler's static paths, cheapest first; each serves every row the ones before it serve.
SAMPLING_MODES = ("greedy", "random", "filtered")


def sampling_mode(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                  min_p: np.ndarray) -> str:
    """The sampler path a step's rows need (`SAMPLING_MODES`): "greedy" when no row
    samples, "filtered" when a sampled row has top-k, top-p or min-p on (a sort of each
    row), else "random" (Gumbel-max, no sort; the OpenAI API's defaults land here)."""
    sampled = temperature > 0.0
    if not sampled.any():
        return "greedy"
    filtered = sampled & ((top_k > 0) | (top_p < 1.0) | (min_p > 0.0))
    return "filtered" if filtered.any() else "random"


def widen_sampling_mode(needed: str, asked: str | None) -> str:
    """`asked` in place of the path the rows need, for ablations (forcing the sort on rows
    that do not need it); a path that cannot serve the rows is an error, never a silent drop
    of their filters."""
    if asked is None:
        return needed
    if asked not in SAMPLING_MODES:
        raise ValueError(f"sampling_mode must be one of {SAMPLING_MODES}, got {asked!r}")
    if SAMPLING_MODES.index(asked) < SAMPLING_MODES.index(needed):
        raise ValueError(f"sampling_mode {asked!r} cannot serve rows that need {needed!r}")
    return asked


class RowFeatures(NamedTuple):
    """What one sampling row needs beyond SampleRow's scalars; None / empty = off."""

    penalties: tuple[float, float, float] | None = None   # presence, frequency, repetition
    history: Sequence[int] | None = None    # tokens before the one this step feeds (a window)
    output_start: int = 0                   # index in `history` where the outputs begin
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[Sequence[int]] = ()
    # [ceil(V/32)] int32 allowed-token bitmask; any other non-None value marks a mask still
    # being computed (`pack_masks` reads it once filled in).
    mask: object = None


class ItemFeatures(NamedTuple):
    """What one work item (chunk) needs returned beyond its sampled tokens."""

    prompt_logprobs: int | None = None      # top-k of the prompt logprobs (0: own logprob only)
    prompt_targets: Sequence[int] = ()      # token at position start + j + 1, for j < len
    hidden: str | None = None               # "last": the sampled position; "all": every token
    hidden_layers: tuple[int, ...] = ()
    hidden_skip: int = 0                    # "all": from the chunk's token `hidden_skip` on


@dataclasses.dataclass
class FeatureSpans:
    """Where each work item's prompt logprobs and hidden states sit in the step's outputs."""

    prompt: list[tuple[int, int]]   # per item: (first row, count) of the prompt logprob rows
    hidden: list[tuple[int, int]]   # per item: (first row, count) of the hidden-state rows
    hidden_layers: tuple[int, ...]  # the layers returned, in order (union over the items)
    num_prompt_logprobs: int        # KP: top-k width of the prompt logprobs


def bucket(n: int, minimum: int) -> int:
    """0 for 0, else the power of two >= max(n, minimum)."""
    if n <= 0:
        return 0
    return 1 << (max(n, minimum) - 1).bit_length()


def pack_row_features(features: Sequence[RowFeatures | None], num_rows: int,
                      vocab_size: int) -> tuple[np.ndarray, ...]:
    """Rows' features -> (penalties, history, history_meta, bias_ids, bias_values, allowed,
    bad_words, mask_rows, masks), padded to `num_rows` rows."""
    r = num_rows
    feats = [(i, f) for i, f in enumerate(features) if f is not None]
    pen_on = any(f.penalties is not None for _, f in feats)
    hist_on = any(f.history is not None for _, f in feats)
    penalties = np.zeros((r if pen_on else 0, 3), np.float32)
    if pen_on:
        penalties[:, 2] = 1.0
    width = bucket(max((len(f.history) for _, f in feats if f.history is not None), default=0), 64)
    history = np.full((r if hist_on else 0, width), -1, np.int32)
    meta = np.zeros((r if hist_on else 0, 2), np.int32)
    if hist_on:
        meta[:, 1] = width + 1          # rows without history: nothing counts as output
    nb = bucket(max((len(f.logit_bias) for _, f in feats if f.logit_bias), default=0), 4)
    bias_ids = np.full((r, nb), -1, np.int32)
    bias_values = np.zeros((r, nb), np.float32)
    na = bucket(max((len(f.allowed_token_ids) for _, f in feats if f.allowed_token_ids), default=0), 4)
    allowed = np.full((r, na), -1, np.int32)
    nw = bucket(max((len(f.bad_words) for _, f in feats), default=0), 2)
    wl = max((len(w) for _, f in feats for w in f.bad_words), default=0)
    bad = np.full((r, nw, wl if nw else 0), -1, np.int32)
    masked = [(i, f.mask) for i, f in feats if f.mask is not None]
    words = -(-vocab_size // 32)
    mask_rows = np.full(r if masked else 0, -1, np.int32)
    masks = np.zeros((bucket(len(masked), 4), words if masked else 0), np.int32)
    for i, f in feats:
        if f.penalties is not None:
            penalties[i] = f.penalties
        if f.history is not None:
            n = len(f.history)
            history[i, :n] = f.history
            meta[i] = (n, f.output_start)
        if f.logit_bias:
            n = len(f.logit_bias)
            bias_ids[i, :n] = list(f.logit_bias.keys())
            bias_values[i, :n] = list(f.logit_bias.values())
        if f.allowed_token_ids:
            allowed[i, :len(f.allowed_token_ids)] = f.allowed_token_ids
        for j, w in enumerate(f.bad_words):
            bad[i, j, wl - len(w):] = w
    for m, (i, _) in enumerate(masked):
        mask_rows[i] = m
    if masked and all(isinstance(mask, np.ndarray) for _, mask in masked):
        masks = pack_masks(features, vocab_size)
    return penalties, history, meta, bias_ids, bias_values, allowed, bad, mask_rows, masks


def pack_masks(features: Sequence[RowFeatures | None], vocab_size: int) -> np.ndarray:
    """The `masks [M, ceil(V/32)]` array of rows whose masks are filled in, in row order."""
    masked = [f.mask for f in features if f is not None and f.mask is not None]
    words = -(-vocab_size // 32)
    masks = np.zeros((bucket(len(masked), 4), words if masked else 0), np.int32)
    for m, mask in enumerate(masked):
        n = min(words, mask.shape[0])
        masks[m, :n] = mask[:n]
    return masks


def pack_item_features(features: Sequence[ItemFeatures | None], cu_q_lens: np.ndarray,
                       logits_indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                             FeatureSpans]:
    """Items' features -> (prompt_positions, prompt_targets, hidden_positions, spans).

    Prompt positions index the step's logits rows after the S per-sequence rows (the
    runner asks the model for logits at `concat(logits_indices, prompt token indices)`);
    hidden positions index the step's tokens.
    """
    pos, targets, hidden, prompt_spans, hidden_spans = [], [], [], [], []
    layers: set[int] = set()
    kp = 0
    for i, f in enumerate(features):
        if f is None or (f.prompt_logprobs is None and f.hidden is None):
            prompt_spans.append((0, 0))
            hidden_spans.append((0, 0))
            continue
        start = int(cu_q_lens[i])
        if f.prompt_logprobs is not None:
            kp = max(kp, f.prompt_logprobs)
            n = len(f.prompt_targets)
            prompt_spans.append((len(pos), n))
            pos.extend(range(start, start + n))
            targets.extend(f.prompt_targets)
        else:
            prompt_spans.append((0, 0))
        if f.hidden is not None:
            layers.update(f.hidden_layers)
            at = (range(start + f.hidden_skip, int(cu_q_lens[i + 1])) if f.hidden == "all"
                  else [int(logits_indices[i])])
            hidden_spans.append((len(hidden), len(at)))
            hidden.extend(at)
        else:
            hidden_spans.append((0, 0))
    p = bucket(len(pos), 16)
    prompt_positions = np.zeros(p, np.int32)
    prompt_positions[:len(pos)] = pos
    prompt_targets = np.zeros(p, np.int32)
    prompt_targets[:len(targets)] = targets
    h = bucket(len(hidden), 4)
    hidden_positions = np.zeros(h, np.int32)
    hidden_positions[:len(hidden)] = hidden
    kp = 0 if kp == 0 else 1 << (kp - 1).bit_length()
    return prompt_positions, prompt_targets, hidden_positions, FeatureSpans(
        prompt_spans, hidden_spans, tuple(sorted(layers)), kp)

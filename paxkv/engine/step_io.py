"""The typed records that cross the door between host and device, one engine step at a time.

The engine builds `WorkItem`s (what to compute) and `SampleRow`s (what to sample); the runner
turns them into padded device arrays and answers with a `HostSample` and a `StepTiming`.
They live here, free of JAX, so host code can import and type them at the top.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import numpy as np

from paxkv.sampling.rows import FeatureSpans, ItemFeatures, RowFeatures


@dataclasses.dataclass
class WorkItem:
    """One scheduled chunk, as the runner needs it: tokens to compute and where they go."""

    token_ids: Sequence[int]     # the tokens computed this step
    start: int                   # position of the first of them
    block_table: Sequence[int]   # KV group 0's table (the only one of most models)
    features: ItemFeatures | None = None   # prompt logprobs / hidden states wanted back
    group_tables: Sequence[Sequence[int]] = ()   # KV groups 1.. (`cache/kv_layout.py`)


class SampleRow(NamedTuple):
    """One token to sample, from the logits of work item `item` (a tuple: cheap to build)."""

    item: int
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    step: int = 0
    banned: Sequence[int] = ()
    num_logprobs: int = 0
    features: RowFeatures | None = None   # penalties, bias, bans, grammar mask


@dataclasses.dataclass
class HostSample:
    tokens: np.ndarray          # [R]
    logprobs: np.ndarray        # [R]
    top_ids: np.ndarray         # [R, K]
    top_logprobs: np.ndarray    # [R, K]
    # Per work item, through `spans`: prompt logprobs and hidden states (empty when unasked).
    prompt_logprobs: np.ndarray | None = None      # [P]
    prompt_top_ids: np.ndarray | None = None       # [P, KP]
    prompt_top_logprobs: np.ndarray | None = None  # [P, KP]
    hidden: np.ndarray | None = None               # [H, len(spans.hidden_layers), hidden]
    #   (a verify step's: [R, k + 1, layers, hidden], `Runner.dispatch_verify`)
    spans: FeatureSpans | None = None


@dataclasses.dataclass
class StepTiming:
    host_s: float = 0.0         # packing + dispatch on the host
    pack_s: float = 0.0         # of which: building the padded numpy arrays
    device_s: float = 0.0       # waiting for the device result
    compile_s: float = 0.0      # first call of a new shape bucket (traced + compiled)
    compiled: bool = False

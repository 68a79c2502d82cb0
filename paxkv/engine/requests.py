"""Engine-side state of one request: its sequences (samples or beams) and how they end.

Two kinds, because they finish differently: a `SamplingRequest` forks its prompt into
`best_of` samples after the first token and ranks them at the end; a `BeamRequest` keeps
a `BeamState` that forks and drops beams every step. Host code only.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from paxkv.engine.beam_search import BeamState
from paxkv.engine.request_features import FeatureState
from paxkv.engine.sequence import Sequence
from paxkv.outputs import RequestMetrics
from paxkv.sampling_params import SamplingParams


@dataclasses.dataclass
class EngineRequest:
    """What every request has: its id, prompt, sequences and timing."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[Sequence]
    timing: RequestMetrics | None = None
    aborted: bool = False
    num_cached_tokens: int | None = None   # prompt tokens served from the prefix cache
    features: FeatureState | None = None   # penalties, grammar, prompt logprobs, hidden states

    @property
    def needs_host_sync(self) -> bool:
        """True when the next step cannot be scheduled before this step's tokens are read
        on the host (forks and beams are decided there)."""
        return False

    @property
    def finished(self) -> bool:
        raise NotImplementedError


@dataclasses.dataclass
class SamplingRequest(EngineRequest):
    """n / best_of samples of one prompt: forked from the prompt once its first token exists."""

    base_seed: int = 0
    texts: dict[int, str] = dataclasses.field(default_factory=dict)
    logprobs: dict[int, list[dict[int, float]]] = dataclasses.field(default_factory=dict)
    forked: bool = False
    # output_kind DELTA: per sample (seq id), output tokens already in an output, and whether
    # its finish was; the text streamed so far (detokenize).
    emitted: dict[int, int] = dataclasses.field(default_factory=dict)
    finish_emitted: set[int] = dataclasses.field(default_factory=set)
    streamed_texts: dict[int, Any] = dataclasses.field(default_factory=dict)

    def sample_seed(self, index: int) -> int:
        """Seed of sample `index`: the request's own seed for sample 0, a mix for the rest."""
        if index == 0:
            return self.base_seed
        return (self.base_seed * 1_000_003 + index * 7919) % (2**31 - 1)

    @property
    def will_fork(self) -> bool:
        return not self.forked and self.params.best_of > 1

    @property
    def needs_host_sync(self) -> bool:
        # A fork happens on the host once the first token is read. Of the sampling features
        # only structured outputs need step t's token before step t+1 (its grammar mask);
        # penalties and bad words count the history the host knows plus the token the device
        # feeds, and per-item outputs are read back with the step they belong to.
        return self.will_fork or (self.features is not None and self.params.needs_host_sync)

    @property
    def finished(self) -> bool:
        if self.will_fork:
            return False
        return all(s.status.is_finished() and not s.num_pending_tokens for s in self.samples)


@dataclasses.dataclass
class BeamRequest(EngineRequest):
    """Beam search: the beams are the request's live sequences, `beam` ranks them."""

    beam: BeamState | None = None

    @property
    def needs_host_sync(self) -> bool:
        return True

    @property
    def finished(self) -> bool:
        return self.beam is not None and self.beam.done

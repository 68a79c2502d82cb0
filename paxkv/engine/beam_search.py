"""Beam search as forks of sequences that share KV blocks copy-on-write.

Each running beam is an engine `Sequence`. A step samples, for every beam, its most likely
continuations (greedy row with top-K logprobs, on the device); the host then ranks all
candidates, forks a parent once per extra surviving child (the children share every block
of the parent; the first write into a shared, partly filled block copies it) and finishes
parents with no surviving child, which releases their blocks at once.

Selection follows transformers' `generate(num_beams=W, early_stopping=True)` so results can
be compared token for token: the top `max(2, 1 + #eos) * W` candidates by summed log
probability; among the first W of them, those ending in EOS (or at the length limit) become
hypotheses scored `sum_logprobs / generated_len ** length_penalty`; the best W unfinished
candidates continue; search ends once W hypotheses exist (early stopping), the best running
beam cannot beat the worst hypothesis, or every candidate hit a stop.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from paxkv.engine.sequence import Sequence as Seq


@dataclasses.dataclass
class BeamSearchSequence:
    tokens: list[int]            # prompt + generated
    text: str | None
    cum_logprob: float
    score: float                 # cum_logprob / generated_len ** length_penalty
    finished: bool = True


@dataclasses.dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


@dataclasses.dataclass
class _Hypothesis:
    generated: list[int]
    cum_logprob: float
    score: float


class BeamState:
    """Host-side bookkeeping of one request's beams between engine steps."""

    def __init__(self, root: Seq, beam_width: int, max_tokens: int, length_penalty: float,
                 early_stopping: bool, eos_ids: frozenset[int]) -> None:
        self.width = beam_width
        self.max_tokens = max_tokens
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.eos_ids = eos_ids
        self.keep = max(2, 1 + len(eos_ids)) * beam_width
        self.running: list[Seq] = [root]
        self.finished: list[_Hypothesis] = []
        self.generated = 0
        self.improvable = True
        self.done = False
        self.pending: dict[int, tuple[Any, Any]] = {}

    def ready(self) -> bool:
        return all(s.seq_id in self.pending for s in self.running)

    def _finished_full(self) -> bool:
        return len(self.finished) >= self.width

    def advance(self, fork: Callable[[Seq], Seq], drop: Callable[[Seq], None]) -> None:
        """Rank candidates, record hypotheses, fork / drop beams. Called once all beams reported."""
        cands = []
        for i, s in enumerate(self.running):
            ids, lps = self.pending[s.seq_id]
            for t, lp in zip(ids, lps):
                cands.append((s.cumulative_logprob + float(lp), i, int(t), float(lp)))
        self.pending.clear()
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = cands[:self.keep]
        gen_len = self.generated + 1
        hits = [(c[2] in self.eos_ids) or gen_len >= self.max_tokens for c in top]
        if not (self._finished_full() and self.early_stopping) and self.improvable:
            for c, hit in zip(top[:self.width], hits[:self.width]):
                if hit:
                    parent = self.running[c[1]]
                    self.finished.append(_Hypothesis(parent.output_token_ids + [c[2]], c[0],
                                                     c[0] / gen_len ** self.length_penalty))
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[self.width:]
        survivors = [c for c, hit in zip(top, hits) if not hit][:self.width]
        # Assign sequences: a parent's first surviving child reuses the parent itself; later
        # children are forks taken before any token is appended (they share its blocks).
        used: set[int] = set()
        plan: list[tuple[Seq, tuple]] = []
        for c in survivors:
            parent = self.running[c[1]]
            if c[1] in used:
                plan.append((fork(parent), c))
            else:
                used.add(c[1])
                plan.append((parent, c))
        for i, s in enumerate(self.running):
            if i not in used:
                drop(s)
        for seq, c in plan:
            seq.append_token(c[2], c[3])
        self.running = [seq for seq, _ in plan]
        self.generated = gen_len
        if self.running and self._finished_full():
            best = self.running[0].cumulative_logprob / self.generated ** self.length_penalty
            self.improvable = self.improvable and best > self.finished[-1].score
        all_finished = self._finished_full() and self.early_stopping
        if not self.running or all_finished or not self.improvable or all(hits):
            self.done = True
            for s in self.running:
                drop(s)
            self.running = []

    def result(self, prompt_ids: list[int], decode: Callable[[list[int]], str] | None) -> BeamSearchOutput:
        seqs = [BeamSearchSequence(list(prompt_ids) + h.generated,
                                   decode(h.generated) if decode else None, h.cum_logprob, h.score)
                for h in self.finished]
        return BeamSearchOutput(seqs)


def run_beam_search(engine: Any, prompts: Sequence[Any], params: Any) -> list[BeamSearchOutput]:
    """Beam-search every prompt concurrently through the engine; outputs in input order."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    ids = [engine.add_beam_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return [engine.pop_beam_result(rid) for rid in ids]

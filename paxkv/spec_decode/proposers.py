"""The proposers the engine drafts with, behind one interface (`Proposer`).

- `NgramProposer`: prompt lookup (`ngram.py`), host only; its drafts are decided before any
  slot is reserved, so it reserves only what it proposes.
- `DraftModelProposer`: a smaller model with the target's tokenizer drafts greedily, k
  steps, through a runner of its own (its own weights and KV pool, the target's block
  tables). Its drafts fill the room it is given, into slots reserved first.

Both draft deterministically given the sequence (a point mass q), so the verify step's
rejection sampler (`rejection.py`) keeps the target's distribution exactly as it does for
n-gram drafts; vLLM's draft model samples from q instead, which accepts more at high
temperature and needs q's probabilities in the verify step.

Host code: the draft model's runner is driven through its host interface (`WorkItem`,
`SampleRow`), with no JAX here.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from paxkv.engine.step_io import SampleRow, WorkItem
from paxkv.spec_decode.config import SpeculativeConfig
from paxkv.spec_decode.ngram import propose_ngram


class Proposer(Protocol):
    """What the engine asks of a proposer (`LLMEngine._propose`)."""

    # True: drafts fill each sequence's room and their slots are reserved before `propose`
    # runs (a model writes its own KV there); False: `propose` runs first and only its
    # drafts' slots are reserved.
    fills_room: bool

    def propose(self, seqs: Sequence[Any], rooms: Sequence[int]) -> list[list[int]]:
        """Up to rooms[i] draft tokens after each sequence's tokens (prompt and output)."""

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """The target's pool copied blocks (copy-on-write): mirror it in the proposer's."""

    def on_verified(self, seq: Any) -> None:
        """A verify step emitted `seq`'s new tokens (kept drafts, then one more)."""


class NgramProposer:
    """Prompt lookup: the tokens that followed the sequence's newest n-gram last time."""

    fills_room = False

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.n_min, self.n_max = spec.prompt_lookup_min, spec.prompt_lookup_max

    def propose(self, seqs: Sequence[Any], rooms: Sequence[int]) -> list[list[int]]:
        return [propose_ngram(s.token_ids, r, self.n_min, self.n_max) if r > 0 else []
                for s, r in zip(seqs, rooms)]

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        pass

    def on_verified(self, seq: Any) -> None:
        pass


class DraftModelProposer:
    """A draft model over the target's block tables, in a pool of its own.

    Its pool has the target's block count and block size, so a sequence's block table
    addresses both; each block costs the target's bytes plus the draft's, and the builder
    sizes the pool from their sum. Per sequence it remembers how many leading tokens have
    their KV in the draft's pool (`_computed`). A proposal first computes the missing ones
    (the whole prompt the first time, then the one or two tokens the verify step added), in
    chunks of the step budget, and samples the first draft from the last; one multi-step
    call drafts the rest. A verify step that rejected drafts cuts the count back to the
    tokens that stayed. Preemption (either mode) starts the sequence over: its blocks are
    freed or swapped, and only the target's pool is swapped.
    """

    fills_room = True

    def __init__(self, runner: Any, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.runner = runner
        self.max_tokens_per_step = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        # seq_id -> (the sequence's preemption count when recorded, tokens with draft KV)
        self._computed: dict[int, tuple[int, int]] = {}
        self.num_draft_steps = 0          # draft-model device calls (catch-up + multi-step)

    def _start(self, seq: Any) -> int:
        epoch, computed = self._computed.get(seq.seq_id, (seq.num_preemptions, 0))
        return computed if epoch == seq.num_preemptions else 0

    def propose(self, seqs: Sequence[Any], rooms: Sequence[int]) -> list[list[int]]:
        live = [i for i, r in enumerate(rooms) if r > 0]
        drafts: list[list[int]] = [[] for _ in seqs]
        if not live:
            return drafts
        self._catch_up_and_draft_first(seqs, live, drafts)
        longest = max(rooms[i] for i in live)
        # The rest in one call, over the sequences whose room is the longest: every token it
        # writes lands in their reserved slots. The others (near a length limit or out of
        # step budget) keep their first draft.
        rest = [i for i in live if rooms[i] == longest]
        if longest > 1 and rest:
            items = [WorkItem([drafts[i][0]], len(seqs[i].token_ids), seqs[i].block_table)
                     for i in rest]
            sample, _ = self.runner.execute_multi_decode(
                items, [SampleRow(j) for j in range(len(items))], longest - 1)
            self.num_draft_steps += 1
            for j, i in enumerate(rest):
                drafts[i] += [int(t) for t in sample.tokens[:, j]]
        for i in live:   # KV computed through the second-last draft
            seq = seqs[i]
            self._computed[seq.seq_id] = (seq.num_preemptions,
                                          len(seq.token_ids) + len(drafts[i]) - 1)
        self._prune(seqs)
        return drafts

    def _catch_up_and_draft_first(self, seqs: Sequence[Any], live: list[int],
                                  drafts: list[list[int]]) -> None:
        """Compute each live sequence's tokens missing from the draft pool, in steps of at
        most the step budget and `max_seqs` chunks; the step holding a sequence's last token
        samples its first draft (greedy)."""
        # the last token always runs (its logits give the first draft)
        at = {i: min(self._start(seqs[i]), len(seqs[i].token_ids) - 1) for i in live}
        todo = list(live)
        while todo:
            items, owners, used = [], [], 0
            for i in todo:
                seq = seqs[i]
                n = min(len(seq.token_ids) - at[i], self.max_tokens_per_step - used)
                if n <= 0 or len(items) == self.max_seqs:
                    break
                items.append(WorkItem(list(seq.token_ids[at[i]:at[i] + n]), at[i],
                                      seq.block_table))
                owners.append(i)
                used += n
            sample, _ = self.runner.execute(items, [SampleRow(j) for j in range(len(items))])
            self.num_draft_steps += 1
            for j, i in enumerate(owners):
                at[i] += len(items[j].token_ids)
                if at[i] == len(seqs[i].token_ids):
                    drafts[i].append(int(sample.tokens[j]))
            todo = [i for i in todo if at[i] < len(seqs[i].token_ids)]

    def _prune(self, seqs: Sequence[Any]) -> None:
        """Keep the record bounded: past 4 x max_num_seqs entries keep this step's only (a
        running sequence dropped here only recomputes its draft KV)."""
        if len(self._computed) > 4 * self.max_seqs:
            keep = {s.seq_id for s in seqs}
            self._computed = {k: v for k, v in self._computed.items() if k in keep}

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            self.runner.copy_blocks(pairs)

    def on_verified(self, seq: Any) -> None:
        """Drafts at or past the first rejected one had their KV written for tokens that did
        not stay: the draft pool is good up to the last kept draft (the token after it, the
        verify step's own, is not in it yet)."""
        entry = self._computed.get(seq.seq_id)
        if entry is not None:
            self._computed[seq.seq_id] = (entry[0], min(entry[1], len(seq.token_ids) - 1))


def make_proposer(spec: SpeculativeConfig, draft_runner: Any = None,
                  max_num_batched_tokens: int = 0, max_num_seqs: int = 0) -> Proposer:
    """The proposer `spec.method` names (the draft model's runner built by the builder)."""
    if spec.method == "ngram":
        return NgramProposer(spec)
    if spec.method == "draft_model":
        if draft_runner is None:
            raise ValueError("speculative_config.method 'draft_model' needs the draft model's "
                             "runner (paxkv.builder builds it)")
        return DraftModelProposer(draft_runner, max_num_batched_tokens, max_num_seqs)
    raise ValueError(f"speculative_config.method {spec.method!r} is not implemented yet")

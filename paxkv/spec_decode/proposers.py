"""The proposers the engine drafts with, behind one interface (`Proposer`).

- `NgramProposer`: prompt lookup (`ngram.py`), host only; its drafts are decided before any
  slot is reserved, so it reserves only what it proposes.
- `DraftModelProposer`: a smaller model with the target's tokenizer drafts greedily, k
  steps, through a runner of its own (its own weights and KV pool, the target's block
  tables). Its drafts fill the room it is given, into slots reserved first.
- `EagleProposer`: an EAGLE head (`eagle.py`) drafts from the target's own final features,
  which every step of the engine returns for it; it keeps each sequence's last `WINDOW`
  features on the host and drafts for all of a step's sequences in one device call
  (`eagle_drafter.EagleDrafter`). Like n-gram lookup it proposes before slots are reserved.

All draft deterministically given the sequence (a point mass q), so the verify step's
rejection sampler (`rejection.py`) keeps the target's distribution exactly as it does for
n-gram drafts; vLLM's draft model samples from q instead, which accepts more at high
temperature and needs q's probabilities in the verify step.

Host code: the draft model's runner and the EAGLE drafter are driven through their host
interfaces (`WorkItem`, `SampleRow`, numpy windows), with no JAX here.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

from paxkv.engine.step_io import SampleRow, WorkItem
from paxkv.sampling.rows import ItemFeatures
from paxkv.spec_decode.config import SpeculativeConfig
from paxkv.spec_decode.ngram import propose_ngram


class Proposer(Protocol):
    """What the engine asks of a proposer (`LLMEngine._propose`)."""

    # True: drafts fill each sequence's room and their slots are reserved before `propose`
    # runs (a model writes its own KV there); False: `propose` runs first, once for all the
    # step's sequences, and only its drafts' slots are reserved.
    fills_room: bool
    # True: every step returns the target's features to it (`EagleProposer`: `item_features`,
    # `feature_layers`, `on_features`, `on_fork`, `forget`).
    wants_features: bool

    def propose(self, seqs: Sequence[Any], rooms: Sequence[int]) -> list[list[int]]:
        """Up to rooms[i] draft tokens after each sequence's tokens (prompt and output)."""

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """The target's pool copied blocks (copy-on-write): mirror it in the proposer's."""

    def on_verified(self, seq: Any) -> None:
        """A verify step emitted `seq`'s new tokens (kept drafts, then one more)."""


class NgramProposer:
    """Prompt lookup: the tokens that followed the sequence's newest n-gram last time."""

    fills_room = False
    wants_features = False

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
    wants_features = False

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


class _Window:
    """One sequence's newest features: position t's in row t % size of a ring, for the
    positions lo..hi (none while hi < lo)."""

    def __init__(self, size: int, hidden_size: int) -> None:
        self.rows = np.zeros((size, hidden_size), np.float32)
        self.lo, self.hi = 0, -1

    def put(self, start: int, features: np.ndarray) -> None:
        """The features of positions start.. (a chunk, a decode step, a verify step's kept
        positions). The window stays one run of positions ending at the newest: a chunk
        after a gap (positions never returned, e.g. a prefix-cache hit) starts it over, and
        one that recomputes positions it holds (recompute preemption) replaces them and
        drops those after them."""
        m = len(features)
        if not m:
            return
        size = self.rows.shape[0]
        if self.hi < self.lo or start > self.hi + 1 or start < self.lo:
            self.lo = start
        end = start + m
        take = features[-size:]
        self.rows[np.arange(end - len(take), end) % size] = take
        self.hi = end - 1
        self.lo = max(self.lo, end - size)

    def copy(self) -> "_Window":
        out = _Window.__new__(_Window)
        out.rows, out.lo, out.hi = self.rows.copy(), self.lo, self.hi
        return out


class EagleProposer:
    """An EAGLE head drafting from the target's features (`eagle.py`, EAGLE-1).

    The head's input row t is (f_t, x_{t+1}): the target's final-norm output at position t
    and the token after it. Per sequence this keeps f_t for the newest `window` positions
    (`_Window`); the tokens come from the sequence itself when it proposes. Every step of
    the engine returns the features the windows need (`item_features`): a prefill chunk its
    positions among the last `window` of the sequence, a decode step its one position, a
    verify step all k + 1 of each sequence, of which the kept drafts' and the last token's
    are stored (`on_features`; the rejected ones' are dropped).

    A sequence proposes once its window ends at the position before its newest token;
    otherwise (its features not returned yet) it proposes nothing that step, and the
    ordinary step that follows gives it one. A window may hold fewer than `window`
    positions, all the newest: after a prefix-cache hit (the cached positions never ran)
    or a gap; the head then drafts from those (its padding is invisible), and the window
    fills up as the sequence runs. Preemption: a swapped sequence keeps its window (its
    positions do not change); one recomputed replaces the positions its chunks recompute.
    A fork (n > 1) starts with its parent's window. Finished requests drop theirs
    (`forget`); past 4 x max_num_seqs windows, only the proposing step's are kept.
    """

    fills_room = False
    wants_features = True

    def __init__(self, drafter: Any, feature_layer: int, max_num_seqs: int) -> None:
        """`drafter`: `eagle_drafter.EagleDrafter`; `feature_layer`: the target's final norm
        output, its `num_layers` in `DecoderLM`'s numbering of hidden states."""
        self.drafter = drafter
        self.window = drafter.window
        self.hidden_size = drafter.hidden_size
        self.feature_layers = (feature_layer,)
        self.max_seqs = max_num_seqs
        self._windows: dict[int, _Window] = {}
        self.num_draft_calls = 0          # drafter device calls

    # ---- features in ---------------------------------------------------------------------
    def item_features(self, seq: Any, start: int, num_tokens: int) -> ItemFeatures | None:
        """What a chunk of `num_tokens` from `start` returns: its positions among the
        sequence's last `window` (`hidden_skip` leading ones skipped); None if none are."""
        skip = max(0, len(seq.token_ids) - self.window - start)
        if skip >= num_tokens:
            return None
        return ItemFeatures(hidden="all", hidden_layers=self.feature_layers, hidden_skip=skip)

    def on_features(self, seq: Any, start: int, features: np.ndarray) -> None:
        """The target's features `[m, hidden]` at positions start..start + m - 1 of `seq`."""
        w = self._windows.get(seq.seq_id)
        if w is None:
            w = self._windows[seq.seq_id] = _Window(self.window, self.hidden_size)
        w.put(start, features)

    def on_fork(self, parent: Any, child: Any) -> None:
        w = self._windows.get(parent.seq_id)
        if w is not None:
            self._windows[child.seq_id] = w.copy()

    def forget(self, seq_id: int) -> None:
        self._windows.pop(seq_id, None)

    def window_of(self, seq: Any) -> tuple[np.ndarray, np.ndarray] | None:
        """`(features [n, hidden], next tokens [n])` of the rows the head reads for `seq`,
        oldest first; None while its window does not reach its newest token."""
        w = self._windows.get(seq.seq_id)
        if w is None or w.hi < w.lo or w.hi != len(seq.token_ids) - 2:
            return None
        size = self.window
        feats = w.rows[np.arange(w.lo, w.hi + 1) % size]
        return feats, np.asarray(seq.token_ids[w.lo + 1:w.hi + 2], np.int32)

    # ---- drafts out ----------------------------------------------------------------------
    def propose(self, seqs: Sequence[Any], rooms: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        live = []
        for i, (seq, room) in enumerate(zip(seqs, rooms)):
            rows = self.window_of(seq) if room > 0 else None
            if rows is not None:
                live.append((i, rows))
        self._prune(seqs)
        if not live:
            return drafts
        b, size = self.drafter.batch_size(len(live)), self.window
        feats = np.zeros((b, size, self.hidden_size), np.float32)
        tokens = np.zeros((b, size), np.int32)
        num_real = np.ones(b, np.int32)       # padding rows: one (zero) row, never read
        for j, (_, (f, t)) in enumerate(live):
            n = len(t)
            feats[j, size - n:] = f
            tokens[j, size - n:] = t
            num_real[j] = n
        out = self.drafter(feats, tokens, num_real)
        self.num_draft_calls += 1
        for j, (i, _) in enumerate(live):
            drafts[i] = out[j, :rooms[i]].tolist()
        return drafts

    def _prune(self, seqs: Sequence[Any]) -> None:
        """Keep the windows bounded: past 4 x max_num_seqs keep this step's only (a
        sequence dropped here restarts its window at its next step)."""
        if len(self._windows) > 4 * self.max_seqs:
            keep = {s.seq_id for s in seqs}
            self._windows = {k: v for k, v in self._windows.items() if k in keep}

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        pass

    def on_verified(self, seq: Any) -> None:
        pass                  # the kept positions' features came in through on_features


def make_proposer(spec: SpeculativeConfig, draft_runner: Any = None,
                  max_num_batched_tokens: int = 0, max_num_seqs: int = 0,
                  eagle_drafter: Any = None, feature_layer: int = 0) -> Proposer:
    """The proposer `spec.method` names (the draft model's runner or the EAGLE drafter
    built by the builder; `feature_layer`: the target's `num_layers`)."""
    if spec.method == "ngram":
        return NgramProposer(spec)
    if spec.method == "draft_model":
        if draft_runner is None:
            raise ValueError("speculative_config.method 'draft_model' needs the draft model's "
                             "runner (paxkv.builder builds it)")
        return DraftModelProposer(draft_runner, max_num_batched_tokens, max_num_seqs)
    if spec.method == "eagle":
        if eagle_drafter is None:
            raise ValueError("speculative_config.method 'eagle' needs the head's drafter "
                             "(paxkv.builder builds it)")
        return EagleProposer(eagle_drafter, feature_layer, max_num_seqs)
    raise ValueError(f"speculative_config.method {spec.method!r} is not implemented yet")

"""One generation stream: its tokens, how many of them sit in the KV cache, and its state.

A request with `n > 1` samples or a beam search owns several `Sequence`s sharing one
`request_id`; they are made by forking after the prompt's prefill, so they share the prompt's
KV blocks copy-on-write. The scheduler's unit is the `Sequence`; it keeps the sequences of
one request together (they are preempted and swapped in as a group).

Token accounting, the one rule everything else follows:

    token_ids            prompt + every generated token, appended by the engine
    num_computed_tokens  leading tokens whose K/V are in the device cache
    uncomputed           token_ids[num_computed_tokens:], computed by the next chunk(s)

A decode step computes exactly one token: the last sampled one. A prefill computes several:
the prompt, or after a recompute preemption the prompt and every output so far.

Asynchronous scheduling: the engine schedules step t+1 before it has read step t's tokens.
Each token sampled at step t is first appended as a *placeholder*, a negative id
`-(row + 1)` naming the sampling row of step t that holds it on the device; the runner
substitutes it there, and the engine resolves it on the host one step later. Placeholders
are only ever the last token, and only for one step (`num_pending_tokens` is 0 or 1).
"""
from __future__ import annotations

import copy
import enum
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = "waiting"                      # queued; owns no blocks
    RUNNING = "running"                      # owns device blocks, scheduled each step
    SWAPPED = "swapped"                      # preempted; its blocks live in the host pool
    FINISHED_STOPPED = "finished_stopped"    # EOS, stop token or stop string
    FINISHED_LENGTH = "finished_length"      # max_tokens or max_model_len reached
    FINISHED_ABORTED = "finished_aborted"    # aborted by the user (or dropped beam)

    def is_finished(self) -> bool:
        # A tuple compares members by identity; a dict lookup would call Enum's Python-level
        # __hash__, and this runs several times per sequence per step.
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """vLLM's strings: "stop", "length", "abort"; None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}
_FINISHED = tuple(_FINISH_REASONS)


def infer_fanout(params: Any) -> int:
    """How many sequences a request will fork into: max of `n`, `best_of`, `beam_width`.

    Duck-typed so it works for both sampling and beam-search parameter objects; the
    scheduler reserves that many batch slots when admitting the request's first sequence.
    """
    fanout = 1
    for name in ("n", "best_of", "beam_width"):
        value = getattr(params, name, None)
        if isinstance(value, int) and value > fanout:
            fanout = value
    return fanout


class Sequence:
    """Tokens and cache bookkeeping of one stream (see the module docstring for the rule).

    `block_table` (physical block ids, one per `block_size` tokens; host ids while SWAPPED),
    `group_tables` (the tables of KV groups 1.. for models with several, `cache/kv_layout.py`),
    `num_window_freed`, `block_hashes` and `num_registered_blocks` are maintained by the
    `BlockManager`.
    """

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int], params: Any,
                 arrival_time: float, fanout: int | None = None) -> None:
        if prompt_token_ids is None or len(prompt_token_ids) == 0:
            raise ValueError("prompt_token_ids must not be empty")
        tokens = [int(t) for t in prompt_token_ids]
        if min(tokens) < 0:
            raise ValueError(f"prompt_token_ids must be >= 0, got {min(tokens)}")
        if fanout is not None and fanout < 1:
            raise ValueError(f"fanout must be >= 1, got {fanout}")
        self.seq_id = seq_id
        self.request_id = request_id
        self.params = params
        self.arrival_time = float(arrival_time)
        self.priority = 0   # the request's (scheduling_policy="priority": smaller first)
        self.token_ids: list[int] = tokens
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.output_logprobs: list[float] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        # Batch slots to reserve while the request has not forked yet (n > 1, beams).
        self.fanout = fanout if fanout is not None else infer_fanout(params)
        self.num_preemptions = 0
        self.num_pending_tokens = 0   # trailing placeholder tokens (async scheduling)
        # Prompt logprobs and full-prompt hidden states need every prompt token computed.
        self.skip_prefix_cache = False
        # Owned by the BlockManager.
        self.block_table: list[int] = []
        self.group_tables: list[list[int]] = []
        self.num_window_freed: list[int] = []   # per group: leading entries a window gave back
        self.block_hashes: list[tuple[int | None, tuple[int, ...]]] = []
        self.num_registered_blocks = 0

    # -- token accounting -------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens the next chunk(s) must compute before a new token can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while computing more than the newest sampled token.

        That is: the prompt is not fully computed yet, or (after a recompute preemption)
        earlier outputs are uncomputed too. False exactly when the only uncomputed token is
        the last sampled one, i.e. the next chunk is a one-token decode.
        """
        return (self.num_computed_tokens < self.num_prompt_tokens
                or self.num_computed_tokens < len(self.token_ids) - 1)

    def is_finished(self) -> bool:
        return self.status.is_finished()

    # -- mutation by the engine -------------------------------------------------------
    def append_token(self, token_id: int, logprob: float = 0.0) -> None:
        """Record a sampled token; its K/V get computed by the next (decode) chunk."""
        self.token_ids.append(int(token_id))
        self.output_logprobs.append(logprob)
        self.cumulative_logprob += float(logprob)

    def append_placeholder(self, row: int) -> None:
        """Append the token that sampling row `row` of the step in flight will produce."""
        self.token_ids.append(-(row + 1))
        self.output_logprobs.append(0.0)
        self.num_pending_tokens += 1

    def resolve_placeholder(self, token_id: int, logprob: float = 0.0) -> None:
        """The placeholder (the last token) became known: store its id and logprob."""
        if not self.num_pending_tokens or self.token_ids[-1] >= 0:
            raise RuntimeError(f"sequence {self.seq_id} has no placeholder to resolve")
        self.token_ids[-1] = int(token_id)
        self.output_logprobs[-1] = logprob
        self.cumulative_logprob += float(logprob)
        self.num_pending_tokens -= 1

    def fork(self, new_seq_id: int) -> "Sequence":
        """A copy with its own token list; the block table is left to `BlockManager.fork`.

        Attributes the engine added are copied shallowly. Fork before appending the
        parent's newly sampled token: the child then appends its own.
        """
        child = copy.copy(self)
        child.seq_id = new_seq_id
        child.token_ids = list(self.token_ids)
        child.output_logprobs = list(self.output_logprobs)
        child.block_table = []
        child.group_tables = []
        child.num_window_freed = []
        child.block_hashes = list(self.block_hashes)
        child.finish_reason = None
        child.stop_reason = None
        child.fanout = 1
        child.num_preemptions = 0
        child.num_pending_tokens = 0
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, "
                f"status={self.status.name}, tokens={self.num_tokens} "
                f"(prompt {self.num_prompt_tokens}), computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)})")

"""LLMEngine: requests in, one step at a time, RequestOutputs out (vLLM's shapes).

The engine is host code: it validates requests, asks the scheduler what to run, hands the
runner padded work, and gives sampled ids to the output processor. Parallel samples (n,
best_of) are forks of one prefilled prompt that share its blocks.

Asynchronous scheduling (the default): each `step()` dispatches step t+1 to the device
before it reads step t's tokens, so the host's scheduling and packing of t+1 overlap the
device's work on t. Tokens sampled at step t enter step t+1 on the device (as placeholders
on the host, `engine/sequence.py`); the host reads them one step behind, only to emit
outputs and check stops. A sequence that stopped at step t has its step t+1 token
discarded. Requests whose next step depends on the host (forks, beams, structured outputs)
make that step synchronous; penalties, bias, bans, prompt logprobs and hidden states do not.
Outputs are identical to the synchronous engine's, token for token.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
import time
from typing import Any, Iterable, Sequence

from paxkv.cache.block_manager import BlockManager
from paxkv.cache.kv_layout import kv_layout
from paxkv.config import EngineConfig, ModelConfig
from paxkv.engine.beam_search import BeamSearchOutput, BeamState
from paxkv.engine.output_processor import OutputProcessor
from paxkv.engine.request_features import EncodeSpec, FeatureState, RequestFeatures
from paxkv.engine.requests import BeamRequest, EngineRequest, SamplingRequest
from paxkv.engine.scheduler import Scheduler, SchedulerOutput
from paxkv.engine.sequence import Sequence as Seq
from paxkv.engine.sequence import SequenceStatus
from paxkv.engine.step_io import HostSample, SampleRow, WorkItem
from paxkv.engine.validation import DEFAULT_MAX_LOGPROBS, RequestValidator
from paxkv.field_checks import check_int
from paxkv.metrics import Metrics, StepStats
from paxkv.outputs import RequestMetrics, RequestOutput
from paxkv.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

FINAL_ONLY = RequestOutputKind.FINAL_ONLY

Prompt = str | Sequence[int]
_NO_TOP = ((), ())   # top-k ids and logprobs of a row whose request asked for none


@dataclasses.dataclass
class Intake:
    """A request `validate_request` accepted, not queued yet."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    features: FeatureState | None
    priority: int = 0                 # scheduling_policy="priority": smaller first


@dataclasses.dataclass
class _StepInFlight:
    """A dispatched step and what its sampling rows belong to."""

    pending: Any                      # runner.PendingStep
    rows: list[SampleRow]
    row_seqs: list[Seq]
    sched: SchedulerOutput
    num_steps: int = 1                # > 1: a multi-step decode call
    verify: bool = False              # a speculative verify step (`num_steps` = k + 1)
    placeholder_at: list[int] | None = None   # async: where each row's placeholder sits
    feature_items: list[int] = dataclasses.field(default_factory=list)  # items with features
    # items returning the proposer's features (EAGLE): (item, position of the first)
    proposer_items: list[tuple[int, int]] = dataclasses.field(default_factory=list)


def check_request(validator: RequestValidator, features: RequestFeatures, prompt: Prompt,
                  params: SamplingParams) -> tuple[str | None, list[int]]:
    """`LLMEngine.check_request` with the engine's validator and features passed in, so that a
    frontend process holding copies built from the engine's settings checks the same way."""
    validator.params(params)
    text, ids = validator.prompt(prompt)
    features.prepare(params, ids, None)
    return text, ids


class LLMEngine:
    """Step-wise engine: add_request, step, abort_request, has_unfinished_requests."""

    def __init__(self, config: EngineConfig, runner: Any, tokenizer: Any | None,
                 proposer: Any = None) -> None:
        """`config` with its pool sized (`EngineConfig.with_pool`): the block manager and
        the scheduler are built from its cache and scheduler configs. `proposer`: the
        speculative proposer (`spec_decode.proposers`) when it needs more than the config
        (a draft model's runner); else it is made from `config.speculative`."""
        self.config = config
        self.model_config: ModelConfig = config.model
        self.runner = runner
        self.tokenizer = tokenizer
        sc, cc = config.scheduler, config.cache
        self.max_model_len = sc.max_model_len
        self.kv_layout = kv_layout(self.model_config)
        self.block_manager = BlockManager(cc, self.kv_layout.windows())
        self.scheduler = Scheduler(sc, cc, self.block_manager)
        self.metrics = Metrics(num_blocks=self.block_manager.num_blocks)
        self.requests: dict[str, EngineRequest] = {}
        self._owner: dict[int, tuple[EngineRequest, int]] = {}
        self._seq_ids = itertools.count()
        self._rng = random.Random(config.seed)
        self._aborted_outputs: list[RequestOutput] = []
        self._beam_results: dict[str, BeamRequest] = {}
        self._host_sync: dict[str, EngineRequest] = {}   # requests that may need the host
        self._in_flight: _StepInFlight | None = None
        self._step_index = 0
        self.num_scheduler_steps = config.num_scheduler_steps
        self.async_scheduling = bool(config.async_scheduling)
        # Speculative decoding proposes from the sequence's newest tokens, so each step is
        # read back before the next is scheduled.
        self.speculative = getattr(config, "speculative", None)
        self.proposer = proposer
        if self.speculative is not None:
            self.async_scheduling = False
            if proposer is None:
                from paxkv.spec_decode.proposers import make_proposer
                self.proposer = make_proposer(self.speculative)
        # An EAGLE proposer reads the target's features: every step returns them to it.
        self._proposer_features = bool(getattr(self.proposer, "wants_features", False))
        eos = set(self.model_config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self.validator = RequestValidator(
            self.model_config.vocab_size, self.max_model_len, tokenizer,
            max_logprobs=getattr(config, "max_logprobs", DEFAULT_MAX_LOGPROBS),
            num_layers=self.model_config.num_layers)
        self.features = RequestFeatures(tokenizer, self.model_config.vocab_size, sorted(eos))
        self.output_processor = OutputProcessor(self.scheduler, tokenizer, self.eos_token_ids,
                                                self.max_model_len, self.features, self.metrics)

    # ---- requests -------------------------------------------------------------------------
    def _register(self, req: EngineRequest, seq: Seq) -> None:
        self.requests[req.request_id] = req
        if req.needs_host_sync:
            self._host_sync[req.request_id] = req
        self._owner[seq.seq_id] = (req, 0)
        self.scheduler.add_seq(seq)

    def validate_request(self, request_id: str, prompt: Prompt,
                         params: SamplingParams | None = None,
                         encode: EncodeSpec | None = None, priority: int = 0) -> Intake:
        """Every check `add_request` makes, with no state changed: a ValueError or TypeError
        names the bad field. `LLM.generate` checks a whole batch this way before queueing any."""
        params = SamplingParams() if params is None else params
        self.validator.params(params)
        if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.validator.prompt(prompt)
        check_int("priority", priority)
        return Intake(request_id, text, ids, params, self.features.prepare(params, ids, encode),
                      priority)

    def check_request(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """The checks add_request runs, without queueing anything: (prompt text, prompt ids).

        Reads only immutable engine state, so a server may call it from its own threads to
        reject bad input before it reaches the engine thread.
        """
        return check_request(self.validator, self.features, prompt, params)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Validate and queue one request; an error names the bad field, nothing else changes.
        `priority` (vLLM's): its place under `scheduling_policy="priority"`, smaller first."""
        self.enqueue(self.validate_request(request_id, prompt, params, priority=priority),
                     arrival_time)

    def enqueue(self, intake: Intake, arrival_time: float | None = None) -> None:
        """Queue a request `validate_request` accepted."""
        request_id, params = intake.request_id, intake.params
        if getattr(self.runner, "asleep", 0):
            raise RuntimeError("the engine is asleep (LLM.sleep): call wake_up() first")
        if getattr(self.runner, "weights_stale", False):
            raise RuntimeError("the weights were dropped by sleep(level=2): call "
                               "update_weights() first")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        base_seed = params.seed if params.seed is not None else self._rng.randrange(2**31 - 1)
        now = time.monotonic() if arrival_time is None else arrival_time
        seq = Seq(next(self._seq_ids), request_id, intake.prompt_token_ids, params, now)
        seq.priority = intake.priority
        req = SamplingRequest(request_id, intake.prompt, intake.prompt_token_ids, params, [seq],
                              RequestMetrics(now), features=intake.features, base_seed=base_seed)
        self.features.attach(intake.features, seq)
        self._register(req, seq)

    def add_beam_request(self, prompt: Prompt, params: BeamSearchParams) -> str:
        """Queue one beam-search request; its beams are forks sharing the prompt's blocks."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        request_id = f"beam-{next(self._seq_ids)}"
        text, ids = self.validator.prompt(prompt)
        now = time.monotonic()
        seq = Seq(next(self._seq_ids), request_id, ids, params, now)
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        max_tokens = min(params.max_tokens, self.max_model_len - len(ids))
        beam = BeamState(seq, params.beam_width, max_tokens, params.length_penalty,
                         params.early_stopping, eos)
        req = BeamRequest(request_id, text, ids, SamplingParams(temperature=0.0, max_tokens=params.max_tokens),
                          [seq], RequestMetrics(now), beam=beam)
        self._register(req, seq)
        return request_id

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests now: their blocks return to the pool at once, and each one's final
        output (finish_reason "abort") comes out of the next `step()`. Until then
        `has_unfinished_requests()` stays True. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self._abort(req)
            self._aborted_outputs.append(self.output_processor.make_output(req))

    def _abort(self, req: EngineRequest) -> None:
        self.scheduler.abort_request(req.request_id)
        for s in req.samples:
            if not s.status.is_finished() or s.num_pending_tokens:
                s.status = SequenceStatus.FINISHED_ABORTED
                s.finish_reason = "abort"
        req.aborted = True
        self._retire(req)

    def discard_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests without emitting their outputs (an API call that failed midway)."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._abort(req)

    def shutdown(self) -> None:
        """Drop every request and the step in flight, and free the runner's device memory."""
        self.discard_requests(list(self.requests))
        self._in_flight = None
        self._aborted_outputs = []
        self.runner.release()

    def pop_beam_result(self, request_id: str) -> BeamSearchOutput:
        req = self._beam_results.pop(request_id)
        decode = None
        if self.tokenizer is not None:
            decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        return req.beam.result(req.prompt_token_ids, decode)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- building a step ----------------------------------------------------------------------
    def _rows_for(self, chunk_index: int, seq: Seq, req: EngineRequest, index: int) -> list[SampleRow]:
        """Sampling rows for a chunk that reaches its sequence's last token (sample `index`
        of `req`)."""
        if isinstance(req, BeamRequest):   # greedy row + the top-K continuations of this beam
            return [SampleRow(chunk_index, num_logprobs=req.beam.keep)]
        p = req.params
        n_out = len(seq.token_ids) - seq.num_prompt_tokens
        banned: tuple[int, ...] = ()
        if n_out < p.min_tokens:
            banned = tuple(([] if p.ignore_eos else sorted(self.eos_token_ids)) + list(p.stop_token_ids))
        features = None if req.features is None else self.features.row_features(req.features, seq)
        if not req.will_fork:   # one row, the common case (_make: half the cost of the keywords' __new__)
            return [SampleRow._make((chunk_index, p.temperature, p.top_k, p.top_p, p.min_p,
                                     req.sample_seed(index), n_out, banned, p.logprobs or 0, features))]
        return [SampleRow(chunk_index, p.temperature, p.top_k, p.top_p, p.min_p, req.sample_seed(i),
                          n_out, banned, p.logprobs or 0, features) for i in range(p.best_of)]

    def _needs_sync(self) -> bool:
        """Whether this step must be read back before the next is scheduled.

        Only the requests that needed the host when registered are asked: a request's need
        can end (at its fork) but never begin, so plain requests cost nothing here per step.
        """
        if not self.async_scheduling:
            return True
        ended = [rid for rid, r in self._host_sync.items() if not r.needs_host_sync]
        for rid in ended:
            del self._host_sync[rid]
        return bool(self._host_sync)

    def _dispatch(self, out: SchedulerOutput, k: int) -> _StepInFlight:
        """Build the step's work items and sampling rows, and queue it on the device."""
        items, rows, row_seqs, feature_items, proposer_items = [], [], [], [], []
        owner = self._owner
        for i, c in enumerate(out.chunks):
            seq = c.seq
            req, index = owner[seq.seq_id]
            start = c.start
            if c.is_prefill and req.num_cached_tokens is None:   # its first chunk starts after the hit
                req.num_cached_tokens = start
            item_features = None
            if req.features is not None:
                item_features = self.features.item_features(req.features, start, c.num_tokens,
                                                            c.needs_sample)
                if item_features is not None:
                    feature_items.append(i)
            elif self._proposer_features and not isinstance(req, BeamRequest):
                # (requests with features of their own never speculate: no window for them)
                item_features = self.proposer.item_features(seq, start, c.num_tokens)
                if item_features is not None:
                    proposer_items.append((i, start + item_features.hidden_skip))
            items.append(WorkItem(seq.token_ids[start:start + c.num_tokens], start,
                                  seq.block_table, item_features, seq.group_tables))
            if c.needs_sample:
                r = self._rows_for(i, seq, req, index)
                rows += r
                if len(r) == 1:
                    row_seqs.append(seq)
                else:
                    row_seqs += [seq] * len(r)
        if k > 1:
            pending = self.runner.dispatch_multi_decode(items, rows, k)
        else:   # grammar masks are computed while the forward runs
            fill = self.features.fill_masks if self.features.has_pending_masks else None
            pending = self.runner.dispatch(items, rows, fill)
        return _StepInFlight(pending, rows, row_seqs, out, k, feature_items=feature_items,
                             proposer_items=proposer_items)

    # ---- the step ---------------------------------------------------------------------------
    def step(self, only_finished: bool = False) -> list[RequestOutput]:
        """Dispatch the next step, then read the previous one; return the requests it changed.

        With synchronous scheduling (or when a request needs the host between steps) the
        step just dispatched is read back before returning. `only_finished` skips building
        outputs of unfinished requests (generate() needs only finished ones).
        """
        t_start = time.perf_counter()
        changed: dict[str, RequestOutput] = {o.request_id: o for o in self._aborted_outputs}
        self._aborted_outputs = []
        device_s = compile_s = 0.0
        sync = self._needs_sync()
        if sync and self._in_flight is not None:   # the next step needs this one's tokens
            d, c = self._process(self._take_in_flight(), changed, only_finished)
            device_s, compile_s = device_s + d, compile_s + c
        out = self.scheduler.schedule()
        # Block movement first, in this order, even on a step with nothing to compute.
        if out.blocks_to_offload:
            self.runner.offload(out.blocks_to_offload)
        self.runner.swap_out(out.blocks_to_swap_out)
        self.runner.swap_in(out.blocks_to_swap_in)
        self._copy_blocks(out.blocks_to_copy)
        if out.blocks_to_load:
            self.runner.load(out.blocks_to_load)
        k = self._multi_step_count(out)
        drafts = self._propose(out) if self.speculative is not None else None
        step = None
        if drafts is not None:
            step = self._dispatch_verify(out, drafts)
            k = 1
            compile_s += step.pending.compile_s
        elif out.chunks:
            if k > 1 and not self._reserve_multi_step(out, k):
                k = 1
            step = self._dispatch(out, k)
            compile_s += step.pending.compile_s
        if self._in_flight is not None:            # step t-1, read while step t runs
            d, c = self._process(self._take_in_flight(), changed, only_finished)
            device_s, compile_s = device_s + d, compile_s + c
        if step is not None:
            self.scheduler.on_step_done(out)
            if sync or k > 1 or step.verify:
                d, c = self._process(step, changed, only_finished)
                device_s, compile_s = device_s + d, compile_s + c
            else:
                self._add_placeholders(step)
                self._in_flight = step
        wall = time.perf_counter() - t_start
        bm = self.block_manager
        self.metrics.record(StepStats(
            step=self._step_index, num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting, num_swapped=self.scheduler.num_swapped,
            num_seqs_scheduled=len(out.chunks), num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens * max(1, k), num_preemptions=len(out.preempted),
            blocks_used=bm.num_used_blocks, blocks_free=bm.num_available_blocks,
            blocks_logical=bm.logical_blocks_in_use(), host_s=(0.0 if compile_s else wall - device_s),
            device_s=device_s, compile_s=compile_s, wall_s=wall,
            python_s=0.0 if compile_s else wall - device_s))
        self.metrics.prefix_cache_queries = bm.prefix_cache_queries
        self.metrics.prefix_cache_hits = bm.prefix_cache_hits
        self._step_index += 1
        return list(changed.values())

    def _take_in_flight(self) -> _StepInFlight:
        step, self._in_flight = self._in_flight, None
        return step

    def _add_placeholders(self, step: _StepInFlight) -> None:
        """Async: each sampled row's token exists on the device only; stand a placeholder in
        for it, and finish now the sequences whose length limit it reaches (their blocks
        are free for the next step; the token itself still arrives)."""
        at = []
        owner = self._owner
        reaches_length_limit = self.output_processor.reaches_length_limit
        for r, seq in enumerate(step.row_seqs):
            entry = owner.get(seq.seq_id)
            if entry is None or seq.status.is_finished():
                at.append(-1)            # stopped when the previous step was read
                continue
            seq.append_placeholder(r)
            at.append(len(seq.token_ids) - 1)
            if reaches_length_limit(entry[0], seq):
                self.scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
        step.placeholder_at = at

    def _multi_step_count(self, out: SchedulerOutput) -> int:
        """How many decode steps to run in one device call (1 = an ordinary step).

        Several steps per host round trip only when the batch is plain decoding: no block
        movement, no pending fork (n > 1 before its first token), no beams, no logprobs,
        min_tokens bans or sampling features; and (checked as they are reserved,
        `_reserve_multi_step`) room in the pool for every sequence's next k tokens.
        """
        k = self.num_scheduler_steps
        if k <= 1 or not out.chunks or out.num_prefill_tokens or out.preempted:
            return 1
        if self._proposer_features:   # a multi-step call returns no features
            return 1
        if out.blocks_to_copy or out.blocks_to_swap_in or out.blocks_to_swap_out:
            return 1
        longest = 0
        owner = self._owner
        for c in out.chunks:
            seq = c.seq
            req = owner[seq.seq_id][0]
            p = req.params
            num_tokens = len(seq.token_ids)
            if (c.num_tokens != 1 or not c.needs_sample or req.needs_host_sync
                    or req.features is not None or p.logprobs is not None
                    or num_tokens - seq.num_prompt_tokens < p.min_tokens):
                return 1
            if num_tokens > longest:
                longest = num_tokens
        k = min(k, self.max_model_len - longest + 1)
        return k if k > 1 else 1

    def _propose(self, out: SchedulerOutput) -> list[list[int]] | None:
        """Drafts for each sequence of a plain decode step, counted in the token budget and
        their slots reserved; None when the step runs as an ordinary one: nothing proposed,
        no room, or a sequence not eligible (`_multi_step_count`'s conditions, except that
        the sampled token's own logprob, `logprobs=0`, is allowed; one KV group only)."""
        spec = self.speculative
        if spec.disable_by_batch_size is not None and len(out.chunks) >= spec.disable_by_batch_size:
            return None
        if (not out.chunks or out.num_prefill_tokens or out.preempted or out.blocks_to_copy
                or out.blocks_to_swap_in or out.blocks_to_swap_out
                or self.kv_layout.windows() != (None,)):
            return None
        proposer = self.proposer
        owner = self._owner
        budget = self.config.scheduler.max_num_batched_tokens - len(out.chunks)
        seqs, rooms, total = [], [], 0
        for c in out.chunks:
            seq = c.seq
            req = owner[seq.seq_id][0]
            p = req.params
            n_out = len(seq.token_ids) - seq.num_prompt_tokens
            if (c.num_tokens != 1 or not c.needs_sample or req.needs_host_sync
                    or req.features is not None or (p.logprobs or 0) > 0
                    or n_out < p.min_tokens or isinstance(req, BeamRequest)):
                return None
            room = max(0, min(spec.num_speculative_tokens, self.max_model_len - len(seq.token_ids),
                              p.max_tokens - n_out - 1))
            if proposer.fills_room:      # a draft model: drafts fill the room, proposed below
                room = max(0, min(room, budget - total))
                total += room
            seqs.append(seq)
            rooms.append(room)
        if not proposer.fills_room:      # n-gram, EAGLE: one call, only what it proposes
            drafts = proposer.propose(seqs, rooms)   # counts in the budget, in order
            for i, d in enumerate(drafts):
                drafts[i] = d = d[:max(0, budget - total)]
                total += len(d)
        if not total:
            return None
        lengths = rooms if proposer.fills_room else [len(d) for d in drafts]
        copies = self.block_manager.allocate_slots([(s, 1 + n) for s, n in zip(seqs, lengths)])
        offloads, _ = self.block_manager.take_tier_copies()
        if offloads:
            self.runner.offload(offloads)
        if copies is None:
            return None
        self._copy_blocks(copies)
        if proposer.fills_room:          # its KV goes into the slots just reserved
            drafts = proposer.propose(seqs, rooms)
        return drafts

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write in the target's pool, and in a draft model's (same block ids)."""
        self.runner.copy_blocks(pairs)
        if self.proposer is not None:
            self.proposer.copy_blocks(pairs)

    def _dispatch_verify(self, out: SchedulerOutput, drafts: list[list[int]]) -> _StepInFlight:
        """A verify step: each sequence's last token and its drafts, one sampling row each."""
        items, rows, row_seqs = [], [], []
        owner = self._owner
        for i, (c, d) in enumerate(zip(out.chunks, drafts)):
            seq = c.seq
            req, index = owner[seq.seq_id]
            items.append(WorkItem(list(seq.token_ids[c.start:c.start + 1]) + d, c.start,
                                  seq.block_table))
            rows += self._rows_for(i, seq, req, index)
            row_seqs.append(seq)
        k = self.speculative.num_speculative_tokens
        self.metrics.spec_decode_num_drafts += sum(1 for d in drafts if d)
        self.metrics.spec_decode_num_draft_tokens += sum(map(len, drafts))
        if self._proposer_features:     # and the target's features at every position
            pending = self.runner.dispatch_verify(items, rows, k, self.proposer.feature_layers)
        else:
            pending = self.runner.dispatch_verify(items, rows, k)
        return _StepInFlight(pending, rows, row_seqs, out, k + 1, verify=True)

    def _apply_verify(self, step: _StepInFlight, sample: HostSample,
                      changed: dict[str, RequestOutput], only_finished: bool) -> None:
        """A verify step's emitted tokens, in order: the kept drafts (their KV is computed)
        and the token after them; then the slots of rejected drafts go back to the pool."""
        tokens = sample.tokens.tolist()
        logprobs = sample.logprobs.tolist()
        owner = self._owner
        live = [(i, seq, owner[seq.seq_id][0]) for i, seq in enumerate(step.row_seqs)
                if seq.seq_id in owner and not seq.status.is_finished()]
        touched: dict[str, EngineRequest] = {req.request_id: req for _, _, req in live}
        ended: set[str] = set()
        record = self.output_processor.record_token
        for j in range(step.num_steps):
            live = [e for e in live if tokens[j][e[0]] >= 0 and not e[1].status.is_finished()]
            if j > 0:    # the draft recorded at j - 1 was kept: its KV counts as computed
                self.scheduler.on_extra_decode_step([seq for _, seq, _ in live])
            last = j + 1 == step.num_steps
            for i, seq, req in live:
                if not last and tokens[j + 1][i] >= 0:    # a token follows: this is a kept draft
                    self.metrics.spec_decode_num_accepted_tokens += 1
                if record(req, seq, tokens[j][i], logprobs[j][i], (), ()):
                    ended.add(req.request_id)
        for i, seq in enumerate(step.row_seqs):
            if seq.seq_id in owner and not seq.status.is_finished():
                if sample.hidden is not None:   # the features of the positions that stayed
                    start = step.sched.chunks[i].start
                    kept = len(seq.token_ids) - 1 - start
                    self.proposer.on_features(seq, start, sample.hidden[i, :kept, 0])
                self.proposer.on_verified(seq)
                self.block_manager.trim(seq, len(seq.token_ids))
        self._finish_touched(touched, ended, changed, only_finished)

    def _reserve_multi_step(self, out: SchedulerOutput, k: int) -> bool:
        """Reserve slots for all k tokens of a multi-step call (copy-on-write if shared), all
        or nothing; False when the pool has no room for them (the step then runs once)."""
        copies = self.block_manager.allocate_slots([(c.seq, k) for c in out.chunks])
        offloads, _ = self.block_manager.take_tier_copies()   # blocks it evicted
        if offloads:
            self.runner.offload(offloads)
        if copies is None:
            return False
        self._copy_blocks(copies)
        return True

    # ---- reading a step back -----------------------------------------------------------------
    def _process(self, step: _StepInFlight, changed: dict[str, RequestOutput],
                 only_finished: bool) -> tuple[float, float]:
        """Fetch a dispatched step's tokens and apply them; returns (device wait, compile) s."""
        sample, timing = self.runner.fetch(step.pending)
        if step.verify:
            self._apply_verify(step, sample, changed, only_finished)
        elif step.num_steps > 1:
            self._apply_multi(step, sample, changed, only_finished)
        else:
            self._apply(step, sample, changed, only_finished)
        return timing.device_s, 0.0   # compile time is booked where the step was dispatched

    def _row_is_live(self, step: _StepInFlight, r: int, seq: Seq) -> bool:
        if seq.seq_id not in self._owner or seq.status is SequenceStatus.FINISHED_ABORTED:
            return False
        if step.placeholder_at is None:
            return not seq.status.is_finished()
        at = step.placeholder_at[r]
        return at >= 0 and at == len(seq.token_ids) - 1 and seq.num_pending_tokens > 0

    def _apply(self, step: _StepInFlight, sample: HostSample, changed: dict[str, RequestOutput],
               only_finished: bool) -> None:
        rows, row_seqs = step.rows, step.row_seqs
        if sample.spans is not None:   # prompt logprobs, hidden states of the work items
            for i in step.feature_items:
                c = step.sched.chunks[i]
                if c.seq.seq_id in self._owner:
                    req = self._owner[c.seq.seq_id][0]
                    self.features.on_item_output(req.features, c.start, i, sample)
            if step.proposer_items:     # before any fork below: a fork copies the window
                self._give_proposer_features(step, sample)
        tokens = sample.tokens.tolist()
        logprobs = sample.logprobs.tolist()
        touched: dict[str, EngineRequest] = {}
        ended: set[str] = set()          # requests a sequence of which finished now
        beams: dict[str, BeamRequest] = {}
        record = self.output_processor.record_token
        owner = self._owner
        live = self._row_is_live
        num_rows = len(rows)
        r = 0
        while r < num_rows:
            seq = row_seqs[r]
            if not live(step, r, seq):
                r += 1
                continue
            req = owner[seq.seq_id][0]
            if isinstance(req, BeamRequest):
                req.beam.pending[seq.seq_id] = (sample.top_ids[r], sample.top_logprobs[r])
                beams[req.request_id] = req
                r += 1
                continue
            # The rows of one request's samples are adjacent: best_of rows at its fork.
            targets = self._fork_samples(req, seq) if req.will_fork else (seq,)
            hidden = (self.features.generated_hidden(req.features, rows[r].item, sample)
                      if req.features is not None else None)
            with_top = req.params.logprobs is not None
            for target in targets:
                top = (sample.top_ids[r], sample.top_logprobs[r]) if with_top else _NO_TOP
                if record(req, target, tokens[r], logprobs[r], *top, hidden):
                    ended.add(req.request_id)
                r += 1
            touched[req.request_id] = req
        for rid, req in beams.items():
            if req.beam.ready():
                req.beam.advance(self._fork_beam, self._drop_beam)
                if req.beam.done:
                    self._beam_results[rid] = req
                    self._retire(req)
        self._finish_touched(touched, ended, changed, only_finished)

    def _give_proposer_features(self, step: _StepInFlight, sample: HostSample) -> None:
        """The target's features each item returned for the proposer (EAGLE)."""
        spans = sample.spans
        col = spans.hidden_layers.index(self.proposer.feature_layers[0])
        for i, first in step.proposer_items:
            seq = step.sched.chunks[i].seq
            if seq.seq_id in self._owner:
                at, count = spans.hidden[i]
                self.proposer.on_features(seq, first, sample.hidden[at:at + count, col])

    def _fork_samples(self, req: SamplingRequest, seq: Seq) -> list[Seq]:
        """A request's first token: fork its prompt into best_of samples (seq is sample 0)."""
        children = [self.scheduler.fork(seq, next(self._seq_ids)) for _ in range(req.params.best_of - 1)]
        for j, child in enumerate(children, start=1):
            req.samples.append(child)
            self._owner[child.seq_id] = (req, j)
            self.features.on_fork(req.features, seq, child)
            if self._proposer_features:
                self.proposer.on_fork(seq, child)
        req.forked = True
        return req.samples[:req.params.best_of]

    def _apply_multi(self, step: _StepInFlight, sample: HostSample,
                     changed: dict[str, RequestOutput], only_finished: bool) -> None:
        """Replay a multi-step call's k tokens per sequence on the host, in order."""
        tokens = sample.tokens.tolist()
        logprobs = sample.logprobs.tolist()
        seqs = [c.seq for c in step.sched.chunks]
        owner = self._owner
        live = [(i, seq, owner[seq.seq_id][0]) for i, seq in enumerate(seqs)
                if seq.seq_id in owner and not seq.status.is_finished()]
        touched: dict[str, EngineRequest] = {req.request_id: req for _, _, req in live}
        ended: set[str] = set()
        record = self.output_processor.record_token
        for j in range(step.num_steps):
            if j > 0:
                self.scheduler.on_extra_decode_step(seqs)
            step_tokens, step_logprobs = tokens[j], logprobs[j]
            stopped = False
            for i, seq, req in live:
                if record(req, seq, step_tokens[i], step_logprobs[i], (), ()):
                    ended.add(req.request_id)
                    stopped = True
            if stopped:   # a sequence that stopped has its later tokens discarded
                live = [entry for entry in live if not entry[1].status.is_finished()]
        self._finish_touched(touched, ended, changed, only_finished)

    def _finish_touched(self, touched: dict[str, EngineRequest], ended: set[str],
                        changed: dict[str, RequestOutput], only_finished: bool) -> None:
        """Outputs and retirement of the requests a step gave tokens; only those in `ended`
        (a sequence of theirs finished) can have finished."""
        now = time.monotonic()
        for rid, req in touched.items():
            if req.timing is not None and req.timing.first_token_time is None:
                req.timing.first_token_time = now
            finished = rid in ended and req.finished
            if finished and req.timing is not None:
                req.timing.finished_time = now
            if finished or not (only_finished or req.params.output_kind is FINAL_ONLY):
                changed[rid] = self.output_processor.make_output(req)
            if finished:
                self.metrics.num_requests_finished += 1
                self._retire(req)

    def _fork_beam(self, parent: Seq) -> Seq:
        child = self.scheduler.fork(parent, next(self._seq_ids))
        req, _ = self._owner[parent.seq_id]
        req.samples.append(child)
        self._owner[child.seq_id] = (req, len(req.samples) - 1)
        return child

    def _drop_beam(self, seq: Seq) -> None:
        if not seq.status.is_finished():
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def _retire(self, req: EngineRequest) -> None:
        self.requests.pop(req.request_id, None)
        self._host_sync.pop(req.request_id, None)
        for s in req.samples:
            self._owner.pop(s.seq_id, None)
            if self._proposer_features:
                self.proposer.forget(s.seq_id)

"""LLM (offline API) and LLMEngine (add_request / step / abort), vLLM's shapes.

The engine is host code: it validates requests, asks the scheduler what to run, hands the
runner padded work, and turns sampled ids into sequences, stop decisions and outputs.
Parallel samples (n, best_of) are forks of one prefilled prompt that share its blocks.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import random
import time
from typing import Any, Iterable, Sequence

from paxkv.cache.block_manager import BlockManager
from paxkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from paxkv.engine.request_features import POOLINGS, EncodeSpec, FeatureState, RequestFeatures
from paxkv.engine.scheduler import Scheduler
from paxkv.engine.sequence import Sequence as Seq
from paxkv.engine.sequence import SequenceStatus
from paxkv.engine.validation import (DEFAULT_MAX_LOGPROBS, RequestValidator, check_hidden_layers,
                                     check_int_list)
from paxkv.metrics import Metrics, StepStats
from paxkv.outputs import CompletionOutput, EncodeOutput, RequestMetrics, RequestOutput
from paxkv.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger("paxkv")

Prompt = str | Sequence[int]


@dataclasses.dataclass
class Intake:
    """A request `validate_request` accepted, not queued yet."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    features: FeatureState | None


@dataclasses.dataclass
class _Request:
    """Engine-side state of one request: its samples (forks) and how to finish them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    base_seed: int
    samples: list[Seq]
    texts: dict[int, str] = dataclasses.field(default_factory=dict)
    logprobs: dict[int, list[dict[int, float]]] = dataclasses.field(default_factory=dict)
    forked: bool = False
    aborted: bool = False
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    beam: Any = None            # BeamState for beam-search requests
    timing: RequestMetrics | None = None
    features: FeatureState | None = None   # penalties, grammar, prompt logprobs, hidden states

    def sample_seed(self, index: int) -> int:
        """Seed of sample `index`: the request's own seed for sample 0, a mix for the rest."""
        if index == 0:
            return self.base_seed
        return (self.base_seed * 1_000_003 + index * 7919) % (2**31 - 1)

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return self.forked_or_single and all(s.status.is_finished() for s in self.samples)

    @property
    def forked_or_single(self) -> bool:
        return self.forked or self.params.best_of == 1


class LLMEngine:
    """Step-wise engine: add_request, step, abort_request, has_unfinished_requests."""

    def __init__(self, config: EngineConfig, runner: Any, tokenizer: Any | None,
                 num_blocks: int, num_host_blocks: int) -> None:
        self.config = config
        self.model_config: ModelConfig = config.model
        self.runner = runner
        self.tokenizer = tokenizer
        sc, cc = config.scheduler, config.cache
        self.max_model_len = sc.max_model_len
        self.block_manager = BlockManager(num_blocks, cc.block_size, num_host_blocks=num_host_blocks,
                                          enable_prefix_caching=cc.enable_prefix_caching,
                                          watermark=sc.watermark)
        self.scheduler = Scheduler(sc, self.block_manager, cc.block_size)
        self.metrics = Metrics(num_blocks=num_blocks)
        self.requests: dict[str, _Request] = {}
        self._owner: dict[int, tuple[_Request, int]] = {}
        self._seq_ids = itertools.count()
        self._rng = random.Random(config.seed)
        self._aborted_outputs: list[RequestOutput] = []
        self._beam_results: dict[str, _Request] = {}
        self._step_index = 0
        self.num_scheduler_steps = max(1, int(getattr(config, "num_scheduler_steps", 1)))
        eos = set(self.model_config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self.validator = RequestValidator(
            self.model_config.vocab_size, self.max_model_len, tokenizer,
            max_logprobs=getattr(config, "max_logprobs", DEFAULT_MAX_LOGPROBS),
            num_layers=self.model_config.num_layers)
        self.features = RequestFeatures(tokenizer, self.model_config.vocab_size, sorted(eos))

    # ---- requests -------------------------------------------------------------------------
    def validate_request(self, request_id: str, prompt: Prompt,
                         params: SamplingParams | None = None,
                         encode: EncodeSpec | None = None) -> Intake:
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
        return Intake(request_id, text, ids, params, self.features.prepare(params, ids, encode))

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate and queue one request; a ValueError names the bad field, nothing else changes."""
        self.enqueue(self.validate_request(request_id, prompt, params), arrival_time)

    def enqueue(self, intake: Intake, arrival_time: float | None = None) -> None:
        """Queue a request `validate_request` accepted."""
        request_id, params = intake.request_id, intake.params
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        base_seed = params.seed if params.seed is not None else self._rng.randrange(2**31 - 1)
        now = time.monotonic() if arrival_time is None else arrival_time
        seq = Seq(next(self._seq_ids), request_id, intake.prompt_token_ids, params, now)
        req = _Request(request_id, intake.prompt, intake.prompt_token_ids, params, base_seed, [seq],
                       timing=RequestMetrics(now))
        req.features = intake.features
        self.features.attach(intake.features, seq)
        self.requests[request_id] = req
        self._owner[seq.seq_id] = (req, 0)
        self.scheduler.add_seq(seq)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop a request now: its blocks return to the pool before the next step.

        The contract: the aborted request's final output (finish_reason "abort") is returned
        by the very next `step()`, alone if nothing else runs, and `has_unfinished_requests()`
        stays True until that step has returned it. Unknown or finished ids are ignored.
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self.scheduler.abort_request(rid)
            for s in req.samples:
                if not s.status.is_finished():
                    s.status = SequenceStatus.FINISHED_ABORTED
                    s.finish_reason = "abort"
            req.aborted = True
            self._aborted_outputs.append(self._make_output(req))
            self._retire(req)

    def add_beam_request(self, prompt: Prompt, params: BeamSearchParams) -> str:
        """Queue one beam-search request; its beams are forks sharing the prompt's blocks."""
        from paxkv.beam_search import BeamState
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        request_id = f"beam-{next(self._seq_ids)}"
        text, ids = self.validator.prompt(prompt)
        seq = Seq(next(self._seq_ids), request_id, ids, params, time.monotonic())
        req = _Request(request_id, text, ids, SamplingParams(temperature=0.0, max_tokens=params.max_tokens),
                       0, [seq])
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        max_tokens = min(params.max_tokens, self.max_model_len - len(ids))
        req.beam = BeamState(seq, params.beam_width, max_tokens, params.length_penalty,
                             params.early_stopping, eos)
        self.requests[request_id] = req
        self._owner[seq.seq_id] = (req, 0)
        self.scheduler.add_seq(seq)
        return request_id

    def pop_beam_result(self, request_id: str) -> Any:
        req = self._beam_results.pop(request_id)
        decode = None
        if self.tokenizer is not None:
            decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        return req.beam.result(req.prompt_token_ids, decode)

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or an aborted one's final output awaits the next step."""
        return bool(self.requests) or bool(self._aborted_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the step ---------------------------------------------------------------------------
    def _rows_for(self, chunk_index: int, seq: Seq) -> list[Any]:
        """Sampling rows for a chunk that reaches its sequence's last token."""
        from paxkv.runner import SampleRow
        req, index = self._owner[seq.seq_id]
        p = req.params
        if req.beam is not None:   # greedy row + the top-K continuations of this beam
            return [SampleRow(chunk_index, num_logprobs=req.beam.keep)]
        n_out = seq.num_output_tokens
        banned: tuple[int, ...] = ()
        if n_out < p.min_tokens:
            banned = tuple(([] if p.ignore_eos else sorted(self.eos_token_ids)) + list(p.stop_token_ids))
        indices = (index,)
        if not req.forked and p.best_of > 1:
            indices = tuple(range(p.best_of))   # first token of every sample from one prefill
        features = self.features.row_features(req.features, seq)
        return [SampleRow(chunk_index, p.temperature, p.top_k, p.top_p, p.min_p, req.sample_seed(i),
                          n_out, banned, p.logprobs or 0, features) for i in indices]

    def step(self, only_finished: bool = False) -> list[RequestOutput]:
        """Schedule, run one device step, sample, stop; return the requests that changed.

        `only_finished` skips building outputs of unfinished requests (generate() needs
        only finished ones, and at batch 256 building the rest is a real share of host time).
        """
        from paxkv.runner import WorkItem
        t_start = time.perf_counter()
        out = self.scheduler.schedule()
        schedule_s = time.perf_counter() - t_start
        python_extra = 0.0
        changed: dict[str, RequestOutput] = {o.request_id: o for o in self._aborted_outputs}
        self._aborted_outputs = []
        device_s = compile_s = 0.0
        # Block movement first, in this order, even on a step with nothing to compute.
        self.runner.swap_out(out.blocks_to_swap_out)
        self.runner.swap_in(out.blocks_to_swap_in)
        self.runner.copy_blocks(out.blocks_to_copy)
        k = self._multi_step_count(out)
        if k > 1:
            device_s, compile_s, python_extra = self._multi_decode(out, k, changed, only_finished)
        elif out.chunks:
            items, rows, row_owner = [], [], []
            for i, c in enumerate(out.chunks):
                seq = c.seq
                if c.is_prefill:
                    req = self._owner[seq.seq_id][0]
                    if req.num_cached_tokens is None:   # its first chunk starts after the hit
                        req.num_cached_tokens = c.start
                req = self._owner[seq.seq_id][0]
                items.append(WorkItem(seq.token_ids[c.start:c.start + c.num_tokens], c.start,
                                      seq.block_table, self.features.item_features(
                                          req.features, c.start, c.num_tokens, c.needs_sample)))
                if c.needs_sample:
                    r = self._rows_for(i, seq)
                    rows.extend(r)
                    row_owner.extend([seq] * len(r))
            t_build = time.perf_counter()
            sample, timing = self.runner.execute(   # grammar masks overlap the forward
                items, rows, self.features.fill_masks if self.features.has_pending_masks else None)
            t_post = time.perf_counter()
            device_s, compile_s = timing.device_s, timing.compile_s
            if sample.spans is not None:
                for i, (c, it) in enumerate(zip(out.chunks, items)):
                    if it.features is not None:
                        req = self._owner[c.seq.seq_id][0]
                        self.features.on_item_output(req.features, c.start, i, sample)
            self.scheduler.on_step_done(out)
            self._apply_samples(sample, rows, row_owner, changed, only_finished)
            python_extra = (t_build - t_start - schedule_s) + timing.pack_s + (time.perf_counter() - t_post)
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
            python_s=0.0 if compile_s else schedule_s + python_extra))
        self.metrics.prefix_cache_queries = bm.prefix_cache_queries
        self.metrics.prefix_cache_hits = bm.prefix_cache_hits
        self._step_index += 1
        return list(changed.values())

    def _multi_step_count(self, out: Any) -> int:
        """How many decode steps to run in one device call (1 = an ordinary step).

        Several steps per host round trip only when the batch is plain decoding: no block
        movement, no pending fork (n > 1 before its first token), no beams, no logprobs or
        min_tokens bans, and room in the pool for every sequence's next k tokens.
        """
        k = self.num_scheduler_steps
        if k <= 1 or not out.chunks or out.num_prefill_tokens or out.preempted:
            return 1
        if out.blocks_to_copy or out.blocks_to_swap_in or out.blocks_to_swap_out:
            return 1
        longest = 0
        for c in out.chunks:
            req, _ = self._owner[c.seq.seq_id]
            p = req.params
            if (c.num_tokens != 1 or not c.needs_sample or req.beam is not None
                    or not req.forked_or_single or p.logprobs is not None
                    or req.features is not None
                    or c.seq.num_output_tokens < p.min_tokens):
                return 1
            longest = max(longest, c.seq.num_tokens)
        k = min(k, self.max_model_len - longest + 1)
        if k <= 1:
            return 1
        bm = self.block_manager
        if bm.blocks_needed(tuple((c.seq, k) for c in out.chunks)) > bm.num_available_blocks:
            return 1
        return k

    def _multi_decode(self, out: Any, k: int, changed: dict[str, RequestOutput],
                      only_finished: bool) -> tuple[float, float, float]:
        """Run k decode steps in one device call, then replay them on the host in order."""
        from paxkv.runner import WorkItem
        t_reserve = time.perf_counter()
        copies = []
        for c in out.chunks:   # reserve slots for all k tokens (copy-on-write if shared)
            copies += self.block_manager.append_slots(c.seq, k)
        self.runner.copy_blocks(copies)
        items, rows, seqs = [], [], []
        for i, c in enumerate(out.chunks):
            seq = c.seq
            items.append(WorkItem(seq.token_ids[c.start:c.start + 1], c.start, seq.block_table))
            rows.extend(self._rows_for(i, seq))
            seqs.append(seq)
        t_build = time.perf_counter()
        sample, timing = self.runner.execute_multi_decode(items, rows, k)
        t_post = time.perf_counter()
        tokens = sample.tokens.tolist()
        logprobs = sample.logprobs.tolist()
        touched: dict[str, _Request] = {}
        for j in range(k):
            if j == 0:
                self.scheduler.on_step_done(out)
            else:
                self.scheduler.on_extra_decode_step(seqs)
            for i, seq in enumerate(seqs):
                if seq.status.is_finished():
                    continue   # stopped at an earlier step: its later tokens are discarded
                req, _ = self._owner[seq.seq_id]
                self._append(req, seq, tokens[j][i], logprobs[j][i], (), ())
                touched[req.request_id] = req
        self._finish_touched(touched, changed, only_finished)
        python_s = (t_build - t_reserve) + timing.pack_s + (time.perf_counter() - t_post)
        return timing.device_s, timing.compile_s, python_s

    def _apply_samples(self, sample: Any, rows: list[Any], row_owner: list[Seq],
                       changed: dict[str, RequestOutput], only_finished: bool = False) -> None:
        tokens = sample.tokens.tolist()
        logprobs = sample.logprobs.tolist()
        touched: dict[str, _Request] = {}
        beams: dict[str, _Request] = {}
        r = 0
        while r < len(rows):
            seq = row_owner[r]
            req, index = self._owner[seq.seq_id]
            if req.beam is not None:
                req.beam.pending[seq.seq_id] = (sample.top_ids[r], sample.top_logprobs[r])
                beams[req.request_id] = req
                r += 1
                continue
            group = 1
            if not req.forked and req.params.best_of > 1:
                group = req.params.best_of
                children = [self.scheduler.fork(seq, next(self._seq_ids)) for _ in range(group - 1)]
                for j, child in enumerate(children, start=1):
                    req.samples.append(child)
                    self._owner[child.seq_id] = (req, j)
                    self.features.on_fork(req.features, seq, child)
                req.forked = True
            hidden = (self.features.generated_hidden(req.features, rows[r].item, sample)
                      if req.features is not None else None)
            for j in range(group):
                target = req.samples[j] if group > 1 else seq
                self._append(req, target, tokens[r + j], logprobs[r + j],
                             sample.top_ids[r + j], sample.top_logprobs[r + j], hidden)
            touched[req.request_id] = req
            r += group
        for rid, req in beams.items():
            if req.beam.ready():
                req.beam.advance(self._fork_beam, self._drop_beam)
                if req.beam.done:
                    self._beam_results[rid] = req
                    self._retire(req)
        self._finish_touched(touched, changed, only_finished)

    def _finish_touched(self, touched: dict[str, _Request], changed: dict[str, RequestOutput],
                        only_finished: bool) -> None:
        now = time.monotonic()
        for rid, req in touched.items():
            if req.timing is not None and req.timing.first_token_time is None:
                req.timing.first_token_time = now
            finished = req.finished
            if finished and req.timing is not None:
                req.timing.finished_time = now
            if finished or not only_finished:
                changed[rid] = self._make_output(req)
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

    def _append(self, req: _Request, seq: Seq, token: int, logprob: float, top_ids: Any,
                top_lps: Any, hidden: Any = None) -> None:
        p = req.params
        seq.append_token(token, logprob)
        if req.features is not None:
            self.features.on_token(req.features, seq, token, hidden)
        self.metrics.num_output_tokens += 1
        if p.logprobs is not None:
            entry = {token: logprob}
            entry.update({int(t): float(lp) for t, lp in zip(top_ids[:p.logprobs], top_lps[:p.logprobs])})
            req.logprobs.setdefault(seq.seq_id, []).append(entry)
        status, reason = self._check_stop(req, seq, token)
        if status is not None:
            seq.finish_reason = "stop" if status == SequenceStatus.FINISHED_STOPPED else "length"
            seq.stop_reason = reason
            self.scheduler.finish(seq, status)

    def _check_stop(self, req: _Request, seq: Seq, token: int) -> tuple[SequenceStatus | None, Any]:
        p = req.params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED, None
            if token in p.stop_token_ids:
                return SequenceStatus.FINISHED_STOPPED, token
            if p.stop and self.tokenizer is not None:
                text = self.tokenizer.decode(seq.output_token_ids)
                for s in p.stop:
                    at = text.find(s)
                    if at >= 0:
                        req.texts[seq.seq_id] = text[:at + (len(s) if p.include_stop_str_in_output else 0)]
                        return SequenceStatus.FINISHED_STOPPED, s
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return SequenceStatus.FINISHED_LENGTH, None
        if seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH, None
        return None, None

    def _retire(self, req: _Request) -> None:
        self.requests.pop(req.request_id, None)
        for s in req.samples:
            self._owner.pop(s.seq_id, None)

    def _make_output(self, req: _Request) -> RequestOutput:
        p = req.params
        comps = []
        for i, s in enumerate(req.samples):
            text = req.texts.get(s.seq_id)
            if text is None:
                text = (self.tokenizer.decode(s.output_token_ids, skip_special_tokens=True)
                        if (self.tokenizer is not None and p.detokenize) else "")
            comps.append(CompletionOutput(
                index=i, text=text, token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob,
                logprobs=req.logprobs.get(s.seq_id) if p.logprobs is not None else None,
                finish_reason=s.finish_reason if s.status.is_finished() else None,
                stop_reason=s.stop_reason,
                hidden_states=RequestFeatures.hidden_states_of(req.features, s)))
        finished = req.aborted or req.finished
        if finished and p.best_of > p.n and not req.aborted:
            comps.sort(key=lambda c: -(c.cumulative_logprob or 0.0))
            comps = comps[:p.n]
            for i, c in enumerate(comps):
                c.index = i
        prompt_logprobs = None
        if req.features is not None and req.features.prompt_logprobs is not None:
            prompt_logprobs = list(req.features.prompt_logprobs)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, comps, finished,
                             req.num_cached_tokens or 0, req.timing, prompt_logprobs)


def _resolve_model(model: str | ModelConfig) -> tuple[str | None, ModelConfig | None]:
    """A checkpoint directory -> (path, None); a preset name -> (path-or-None, config)."""
    from paxkv.config import PRESETS, get_preset
    if isinstance(model, ModelConfig):
        return None, model
    if os.path.isdir(model):
        return model, None
    if model == "tiny":
        from paxkv.assets import tiny_model_dir
        path = tiny_model_dir()
        if path is not None:
            return path, None
    if model in PRESETS or model == "tiny":
        return None, get_preset(model)
    raise ValueError(f"model {model!r} is neither a checkpoint directory nor a preset "
                     f"({sorted(PRESETS) + ['tiny']})")


class LLM:
    """Offline inference, vLLM-style: LLM(model=...).generate(prompts, SamplingParams(...))."""

    def __init__(self, model: str | ModelConfig = "tiny", *, dtype: str = "auto", block_size: int = 16,
                 gpu_memory_utilization: float = 0.9, num_gpu_blocks_override: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None, kv_cache_dtype: str = "auto",
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 preemption_mode: str = "recompute", swap_space: float = 4.0,
                 scheduler: str = "continuous", attention_backend: str = "auto",
                 tensor_parallel_size: int = 1, seed: int = 0, params: Any = None,
                 tokenizer: Any = "auto", num_scheduler_steps: int = 1,
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> None:
        import jax
        import jax.numpy as jnp

        from paxkv.model.attention import resolve_backend
        from paxkv.runner import Runner

        if tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size > 1 is not supported yet")
        on_gpu = jax.default_backend() == "gpu"
        if dtype == "auto":
            dtype = "bfloat16" if on_gpu else "float32"
        if dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype must be 'auto', 'bfloat16' or 'float32', got {dtype!r}")
        jdtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
        path, cfg = _resolve_model(model)
        if path is not None:
            from paxkv.model.weights import load_checkpoint
            if params is None:
                params, cfg = load_checkpoint(path, dtype=dtype)
            else:
                from paxkv.config import from_hf_config
                cfg = from_hf_config(path)
        elif params is None:
            from paxkv.model.weights import random_params
            params = random_params(cfg, jax.random.PRNGKey(seed), jdtype)
        # Serve from the fused weight layout (two matmuls per layer instead of five); nothing
        # else holds the separate tensors, so only one copy of the weights stays resident.
        from paxkv.model.fusion import fuse_projections
        params = fuse_projections(params)
        if tokenizer == "auto":
            from paxkv.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(path) if path is not None else None
        self.tokenizer = tokenizer
        if max_model_len is None:
            max_model_len = min(cfg.max_position_embeddings, 8192)
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {cfg.max_position_embeddings}")
        cache = CacheConfig(block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                            num_gpu_blocks_override=num_gpu_blocks_override,
                            kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=enable_prefix_caching,
                            swap_space=swap_space)
        sched = SchedulerConfig(max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max(max_num_batched_tokens,
                                                           0 if enable_chunked_prefill else max_model_len),
                                max_model_len=max_model_len, policy=scheduler,
                                preemption_mode=preemption_mode,
                                enable_chunked_prefill=enable_chunked_prefill)
        backend = resolve_backend(attention_backend)
        if num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {num_scheduler_steps}")
        self.config = EngineConfig(cfg, cache, sched, dtype=dtype, attention_backend=backend,
                                   tensor_parallel_size=tensor_parallel_size, seed=seed,
                                   num_scheduler_steps=num_scheduler_steps,
                                   max_logprobs=max_logprobs)
        kv_dtype = jdtype if kv_cache_dtype == "auto" else _kv_dtype(kv_cache_dtype)
        # Pages plus, for 8-bit pools, their per-token scales: what init_pool allocates.
        from paxkv.cache.kv_pool import block_bytes
        bytes_per_block = block_bytes(cfg, block_size, kv_dtype)
        num_blocks = self._num_blocks(cache, params, bytes_per_block, on_gpu, profile=dict(
            cfg=cfg, backend=backend, block_size=block_size, kv_dtype=kv_dtype,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=max_model_len))
        need = math.ceil(max_model_len / block_size) + 1
        if num_blocks < need:
            raise ValueError(
                f"num_gpu_blocks {num_blocks} cannot hold one sequence of max_model_len "
                f"{max_model_len} ({need - 1} blocks of {block_size} plus the null block): raise "
                "gpu_memory_utilization / num_gpu_blocks_override or lower max_model_len")
        num_host_blocks = int(swap_space * 2**30 // bytes_per_block) if preemption_mode == "swap" else 0
        # GPU decode steps pad to at least 8 rows: on an H200 one 8B decode stream took 4.62 ms
        # per token padded to 8 rows against 5.50 ms padded to 64 (results/step_profile.md),
        # while each smaller bucket costs one more compiled program.
        runner = Runner(cfg, params, num_blocks=num_blocks, block_size=block_size, kv_dtype=kv_dtype,
                        backend=backend, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=sched.max_num_batched_tokens,
                        max_model_len=max_model_len, num_host_blocks=num_host_blocks,
                        min_seq_bucket=8 if on_gpu else 4, min_token_bucket=256 if on_gpu else 16,
                        fixed_shapes=on_gpu)
        self.llm_engine = LLMEngine(self.config, runner, tokenizer, num_blocks, num_host_blocks)
        self._request_counter = itertools.count()

    @staticmethod
    def _num_blocks(cache: CacheConfig, params: Any, bytes_per_block: float, on_gpu: bool,
                    profile: dict[str, Any]) -> int:
        """Override, else profile the accelerator once (weights + the largest step's
        activations, as vLLM does) and give the KV pool the rest, else the CPU default."""
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if not on_gpu:
            return cache.cpu_default_num_blocks
        import jax

        from paxkv.runner import profile_activation_bytes
        activations = profile_activation_bytes(params=params, **profile)
        stats = jax.devices()[0].memory_stats() or {}
        limit = stats.get("bytes_limit", 0)
        weights = stats.get("bytes_in_use", 0)
        # 5% of the budget stays free for XLA's scratch space and fragmentation.
        free = limit * cache.gpu_memory_utilization * 0.95 - weights - activations
        logger.info("KV pool sizing: limit %.1f GiB, in use %.1f GiB, activations %.2f GiB",
                    limit / 2**30, weights / 2**30, activations / 2**30)
        return max(2, int(free // bytes_per_block))

    @property
    def metrics(self) -> Metrics:
        return self.llm_engine.metrics

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, text or token ids
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for "
                             f"{len(prompts)} prompts")
        engine = self.llm_engine
        # Check every request before queueing any: one bad prompt leaves nothing behind.
        intakes = [engine.validate_request(str(next(self._request_counter)), prompt, sp)
                   for prompt, sp in zip(prompts, sampling_params)]
        for intake in intakes:
            engine.enqueue(intake)
        ids = [intake.request_id for intake in intakes]
        return self._run(ids, use_tqdm)

    def encode(self, prompts: Prompt | Sequence[Prompt], layers: Sequence[int] | None = None,
               pooling: str = "last", use_tqdm: bool = False) -> list[EncodeOutput]:
        """Residual-stream activations of each prompt, from the same paged forward that serves
        generation: `layers` as transformers' hidden_states indices (0 = embeddings; default:
        the last), pooled over the prompt's tokens ("last", "mean", or "none" for all)."""
        engine = self.llm_engine
        num_layers = engine.model_config.num_layers
        layers = tuple(check_int_list("layers", layers if layers is not None else [num_layers],
                                      non_empty=True))
        check_hidden_layers("layers", layers, num_layers)
        if len(set(layers)) != len(layers):
            raise ValueError(f"layers lists a layer twice: {list(layers)}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        spec = EncodeSpec(layers, pooling)
        params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
        intakes = [engine.validate_request(str(next(self._request_counter)), p, params, encode=spec)
                   for p in prompts]
        for intake in intakes:
            engine.enqueue(intake)
        outs = self._run([i.request_id for i in intakes], use_tqdm)
        return [EncodeOutput(o.request_id, o.prompt, o.prompt_token_ids,
                             RequestFeatures.pooled(i.features)) for o, i in zip(outs, intakes)]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until every request of `ids` has finished; outputs in that order."""
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        wanted = set(ids)
        while wanted - results.keys():
            for o in engine.step(only_finished=True):
                if o.finished and o.request_id in wanted and o.request_id not in results:
                    results[o.request_id] = o
                    if bar is not None:
                        bar.update(1)
            if not engine.has_unfinished_requests() and wanted - results.keys():
                missing = wanted - results.keys()
                raise RuntimeError(f"requests {sorted(missing)} vanished without output")
        if bar is not None:
            bar.close()
        logger.info("generate: %s", engine.metrics.format_summary())
        return [results[r] for r in ids]

    def beam_search(self, prompts: Sequence[Prompt], params: BeamSearchParams) -> list[Any]:
        from paxkv.beam_search import run_beam_search
        return run_beam_search(self.llm_engine, prompts, params)


def _kv_dtype(name: str) -> Any:
    """Storage dtype of the KV pages for a `kv_cache_dtype` name other than "auto"; the
    8-bit ones (fp8 = fp8_e4m3, fp8_e5m2, int8) make a quantized pool with scales."""
    from paxkv.cache.quant import storage_dtype
    return storage_dtype(name)

"""From sampled tokens to sequence state and `RequestOutput`s: stop checks, text, logprobs,
best_of ranking. Host code only; the engine calls it once per sampled token.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from paxkv.engine.detokenizer import StreamedText
from paxkv.engine.request_features import RequestFeatures
from paxkv.engine.requests import EngineRequest, SamplingRequest
from paxkv.engine.scheduler import Scheduler
from paxkv.engine.sequence import Sequence, SequenceStatus
from paxkv.metrics import Metrics
from paxkv.outputs import CompletionOutput, RequestOutput
from paxkv.sampling_params import RequestOutputKind


class OutputProcessor:
    """Stop decisions and output assembly, shared by the synchronous and the async step."""

    def __init__(self, scheduler: Scheduler, tokenizer: Any | None, eos_token_ids: frozenset[int],
                 max_model_len: int, features: RequestFeatures | None = None,
                 metrics: Metrics | None = None) -> None:
        self.scheduler = scheduler
        self.metrics = metrics if metrics is not None else Metrics()
        self.features = features
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    # ---- one token ----------------------------------------------------------------------
    def record_token(self, req: SamplingRequest, seq: Sequence, token: int, logprob: float,
                     top_ids: np.ndarray | tuple, top_lps: np.ndarray | tuple,
                     hidden: np.ndarray | None = None) -> bool:
        """A sampled token became known on the host: store it, its logprobs, and stop.
        Returns whether the sequence is finished now (its request may be).

        The token is either new (appended) or the sequence's pending placeholder (resolved).
        A sequence already finished by length (decided when its last placeholder was
        appended) gets its final status from the stop check here.
        """
        p = req.params
        resolving = seq.num_pending_tokens > 0
        if resolving:
            seq.resolve_placeholder(token, logprob)
        else:
            seq.append_token(token, logprob)
        if req.features is not None:
            self.features.on_token(req.features, seq, token, hidden)
        self.metrics.num_output_tokens += 1
        if p.logprobs is not None:
            entry = {token: logprob}
            entry.update({int(t): float(lp) for t, lp in zip(top_ids[:p.logprobs], top_lps[:p.logprobs])})
            req.logprobs.setdefault(seq.seq_id, []).append(entry)
        # A placeholder's length limit was decided when it was appended (the sequence was
        # finished early by length, or not), and resolving it keeps the length.
        status, reason = self.check_stop(req, seq, token,
                                         seq.status.is_finished() if resolving else None)
        if status is not None:
            seq.finish_reason = "stop" if status == SequenceStatus.FINISHED_STOPPED else "length"
            seq.stop_reason = reason
            if seq.status.is_finished():
                seq.status = status          # finished early by length; its last token decides
            else:
                self.scheduler.finish(seq, status)
            return True
        return False

    def reaches_length_limit(self, req: SamplingRequest, seq: Sequence) -> bool:
        """Whether the sequence ends by length once its newest (possibly pending) token
        exists: max_tokens (never below min_tokens, SamplingParams checks) or max_model_len."""
        num_tokens = len(seq.token_ids)
        max_tokens = req.params.max_tokens
        if max_tokens is not None and num_tokens - seq.num_prompt_tokens >= max_tokens:
            return True
        return num_tokens >= self.max_model_len

    def check_stop(self, req: SamplingRequest, seq: Sequence, token: int,
                   reaches_length: bool | None = None) -> tuple[SequenceStatus | None, Any]:
        """vLLM's order: EOS, stop token ids, stop strings (after min_tokens), then length.

        `reaches_length`, when known already, stands in for `reaches_length_limit`."""
        p = req.params
        n_out = len(seq.token_ids) - seq.num_prompt_tokens
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
        if reaches_length is None:
            reaches_length = self.reaches_length_limit(req, seq)
        if reaches_length:
            return SequenceStatus.FINISHED_LENGTH, None
        return None, None

    # ---- outputs --------------------------------------------------------------------------
    def make_output(self, req: EngineRequest) -> RequestOutput:
        """The request's current RequestOutput; finished best_of requests keep their n best."""
        p = req.params
        if p.output_kind is RequestOutputKind.DELTA:
            return self._make_delta(req)
        texts = getattr(req, "texts", {})
        logprobs = getattr(req, "logprobs", {})
        comps = []
        for i, s in enumerate(req.samples):
            ids = s.output_token_ids
            if s.num_pending_tokens:          # not known on the host yet
                ids = ids[:len(ids) - s.num_pending_tokens]
            text = texts.get(s.seq_id)
            if text is None:
                text = (self.tokenizer.decode(ids, skip_special_tokens=True)
                        if (self.tokenizer is not None and p.detokenize) else "")
            comps.append(CompletionOutput(
                index=i, text=text, token_ids=ids,
                cumulative_logprob=s.cumulative_logprob,
                logprobs=logprobs.get(s.seq_id) if p.logprobs is not None else None,
                finish_reason=s.finish_reason if s.status.is_finished() else None,
                stop_reason=s.stop_reason,
                hidden_states=RequestFeatures.hidden_states_of(req.features, s)))
        finished = req.aborted or req.finished
        if finished and p.best_of > p.n and not req.aborted:
            comps.sort(key=lambda c: -(c.cumulative_logprob or 0.0))
            comps = comps[:p.n]
            for i, c in enumerate(comps):
                c.index = i
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, comps, finished,
                             req.num_cached_tokens or 0, req.timing, self._prompt_logprobs(req))

    def _make_delta(self, req: SamplingRequest) -> RequestOutput:
        """output_kind DELTA: each sample that has news since the request's last output, with
        only that news (prompt logprobs with the first output)."""
        p = req.params
        first = not req.emitted   # nothing sent yet (a sent finish is sent with a count)
        detok = self.tokenizer is not None and p.detokenize
        comps = []
        for i, s in enumerate(req.samples):
            key = s.seq_id
            start = req.emitted.get(key, 0)
            known = len(s.token_ids) - s.num_pending_tokens - s.num_prompt_tokens
            done = req.aborted or (s.status.is_finished() and not s.num_pending_tokens)
            if known <= start and (not done or key in req.finish_emitted):
                continue
            ids = s.token_ids[s.num_prompt_tokens + start:s.num_prompt_tokens + known]
            req.emitted[key] = known
            if detok:
                streamed = req.streamed_texts.get(key)
                if streamed is None:
                    streamed = req.streamed_texts[key] = StreamedText(self.tokenizer, p.stop)
                text = streamed.finish(ids, req.texts.get(key)) if done else streamed.push(ids)
            else:   # no text, but a sample a stop string ended brings its whole (cut) text
                text = req.texts.get(key, "") if done else ""   # with its end, as CUMULATIVE
            if done:
                req.finish_emitted.add(key)
            comps.append(CompletionOutput(
                index=i, text=text, token_ids=ids, cumulative_logprob=s.cumulative_logprob,
                logprobs=req.logprobs.get(key, [])[start:known] if p.logprobs is not None else None,
                finish_reason=(s.finish_reason or "abort") if done else None,
                stop_reason=s.stop_reason if done else None,
                hidden_states=RequestFeatures.hidden_states_of(req.features, s, start, known)))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, comps,
                             req.aborted or req.finished, req.num_cached_tokens or 0, req.timing,
                             self._prompt_logprobs(req) if first else None)

    @staticmethod
    def _prompt_logprobs(req: EngineRequest) -> list | None:
        if req.features is not None and req.features.prompt_logprobs is not None:
            return list(req.features.prompt_logprobs)
        return None

"""LLM: the offline API (vLLM's shape): a facade over one engine (`builder.build_engine` makes
it from `EngineArgs`) that drives `LLMEngine` to completion in `generate`, `chat`, `encode`
and `beam_search`.
"""
from __future__ import annotations

import itertools
import logging
from typing import Any, Mapping, Sequence

from paxkv.config import ModelConfig
from paxkv.engine.beam_search import BeamSearchOutput, run_beam_search
from paxkv.engine.llm_engine import LLMEngine, Prompt
from paxkv.engine.request_features import POOLINGS, EncodeSpec, RequestFeatures
from paxkv.engine.validation import check_hidden_layers
from paxkv.engine_args import EngineArgs
from paxkv.field_checks import check_int_list
from paxkv.metrics import Metrics
from paxkv.outputs import EncodeOutput, RequestOutput
from paxkv.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger("paxkv")

__all__ = ["LLM", "LLMEngine"]


class LLM:
    """Offline inference, vLLM-style: LLM(model=...).generate(prompts, SamplingParams(...))."""

    def __init__(self, model: str | ModelConfig = "tiny", **kwargs: Any) -> None:
        """`LLM(model, **kwargs)`: the arguments are `EngineArgs`' (vLLM's names; a name it
        does not have is a TypeError), built by `builder.build_engine`."""
        from paxkv.builder import build_engine
        built = build_engine(EngineArgs(model=model, **kwargs))
        self.llm_engine = built.engine
        self.tokenizer = built.tokenizer
        self.config = built.config
        self.compilation_cache_dir = built.compilation_cache_dir
        self._request_counter = itertools.count()

    @property
    def model_config(self) -> ModelConfig:
        """The served model's config, as the engine computes it (with `batch_invariant` set
        when asked): what `paxkv.model.dense.token_logprobs` takes to match the engine."""
        return self.llm_engine.model_config

    @property
    def metrics(self) -> Metrics:
        return self.llm_engine.metrics

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in input order.
        `priority` (one per prompt) orders them under `scheduling_policy="priority"`."""
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
        if priority is None:
            priority = [0] * len(prompts)
        if len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        engine = self.llm_engine
        # Check every request before queueing any: one bad prompt leaves nothing behind.
        intakes = [engine.validate_request(str(next(self._request_counter)), prompt, sp,
                                           priority=p)
                   for prompt, sp, p in zip(prompts, sampling_params, priority)]
        for intake in intakes:
            engine.enqueue(intake)
        return self._run([intake.request_id for intake in intakes], use_tqdm)

    def chat(self, messages: Sequence[Mapping[str, str]] | Sequence[Sequence[Mapping[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or a
        list of them, rendered with the checkpoint's chat template (or `chat_template`) and
        generated like `generate`; one output per conversation."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer: this model was loaded without one "
                             "(pass tokenizer=... or a checkpoint that has tokenizer files)")
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts, "
                             "or a list of such lists")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

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

    # ---- a training loop's rollout engine: weights in place, sleep and wake ----------------
    def _require_idle(self, what: str) -> Any:
        engine = self.llm_engine
        if engine.has_unfinished_requests() or engine._in_flight is not None:
            raise RuntimeError(f"{what}: {engine.get_num_unfinished_requests()} requests are in "
                               "flight; let them finish or abort them first")
        return engine

    def update_weights(self, weights: Any) -> None:
        """New weights in place: (Hugging Face tensor name, array) pairs, any subset of the
        checkpoint's tensors, as vLLM's `load_weights` takes them; or the engine's own
        parameter tree (`llm_engine.runner.params`' structure), whose arrays are taken without
        a copy when already placed as the engine's are (`model/weight_update.py`).

        Refused while requests are in flight (a RuntimeError: finish or abort them; the
        offline engine has no pause). A name, shape or dtype that does not fit is a ValueError
        naming it, and the old weights stay. No step program recompiles. The prefix cache
        (and the host KV tier) is dropped: its blocks hold the old weights' KV."""
        from paxkv.model.weight_update import updated_params
        engine = self._require_idle("update_weights")
        runner = engine.runner
        if runner.asleep:
            raise RuntimeError("update_weights: the engine is asleep; wake_up() first")
        runner.params = updated_params(runner.params, engine.model_config, weights)
        runner.weights_stale = False
        engine.block_manager.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the device for a training step (vLLM's levels): the KV pool always; the weights
        too, kept in host memory (level 1) or dropped (level 2: `update_weights` after
        `wake_up` brings new ones). Refused while requests are in flight."""
        engine = self._require_idle("sleep")
        engine.runner.sleep(level)
        engine.block_manager.reset_prefix_cache()

    def wake_up(self) -> None:
        """Weights and an empty KV pool back on the device; after level 1 the outputs are as
        before sleeping. After level 2 the weights are zeros until `update_weights`."""
        runner = self.llm_engine.runner
        level = runner.asleep
        runner.wake_up()
        runner.weights_stale = level == 2

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block (device and host tier); returns how many device
        blocks went back to the free pool."""
        return self._require_idle("reset_prefix_cache").block_manager.reset_prefix_cache()

    def beam_search(self, prompts: Sequence[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        return run_beam_search(self.llm_engine, prompts, params)

    def shutdown(self) -> None:
        """Release the device memory (weights, KV pool) now; the LLM is unusable after."""
        engine = getattr(self, "llm_engine", None)
        if engine is None:
            return
        close = getattr(engine.runner, "close", None)   # multi-host: end it on the workers
        engine.shutdown()
        if close is not None:
            close()
        self.llm_engine = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


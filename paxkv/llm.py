"""LLM: the offline API (vLLM's shape). It builds the engine: loads the model, sizes the KV
pool, makes the runner, and drives `LLMEngine` to completion in `generate`.
"""
from __future__ import annotations

import itertools
import logging
import os
from typing import Any, Mapping, Sequence

from paxkv.config import (CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, default_batch_limits,
                          resolve_dtype, runner_config)
from paxkv.engine.beam_search import BeamSearchOutput, run_beam_search
from paxkv.engine.llm_engine import LLMEngine, Prompt
from paxkv.engine.request_features import POOLINGS, EncodeSpec, RequestFeatures
from paxkv.engine.validation import DEFAULT_MAX_LOGPROBS, check_hidden_layers
from paxkv.field_checks import check_int_list
from paxkv.metrics import Metrics
from paxkv.outputs import EncodeOutput, RequestOutput
from paxkv.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger("paxkv")

__all__ = ["LLM", "LLMEngine"]


def _resolve_model(model: str | ModelConfig) -> tuple[str | None, ModelConfig | None]:
    """A checkpoint directory or GGUF file -> (path, None); a preset name -> (path-or-None,
    config): the real model's preset names its GGUF file."""
    from paxkv.config import PRESETS, get_preset
    if isinstance(model, ModelConfig):
        return None, model
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a checkpoint directory, a GGUF file, a preset name or "
                         f"a ModelConfig, got {type(model).__name__}")
    model = os.fspath(model)
    if os.path.isdir(model) or model.endswith(".gguf"):
        if not os.path.exists(model):
            raise ValueError(f"model {model!r}: no such file")
        return model, None
    from paxkv.assets import SMOLLM2_PRESET, smollm2_path
    if model == SMOLLM2_PRESET:
        return smollm2_path(), None
    if model == "tiny":
        from paxkv.assets import tiny_model_dir
        path = tiny_model_dir()
        if path is not None:
            return path, None
    if model == "tiny":   # not trained yet: its shape with random weights
        return None, get_preset("tiny-random")
    if model in PRESETS:
        return None, get_preset(model)
    raise ValueError(f"model {model!r} is neither a checkpoint directory, a GGUF file nor a "
                     f"preset ({sorted(PRESETS) + ['tiny', SMOLLM2_PRESET]})")


class LLM:
    """Offline inference, vLLM-style: LLM(model=...).generate(prompts, SamplingParams(...))."""

    def __init__(self, model: str | ModelConfig = "tiny", *, dtype: str = "auto", block_size: int = 16,
                 gpu_memory_utilization: float = 0.9, num_gpu_blocks_override: int | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, kv_cache_dtype: str = "auto",
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 preemption_mode: str = "recompute", swap_space: float = 4.0,
                 scheduler: str = "continuous", attention_backend: str = "auto",
                 tensor_parallel_size: int = 1, seed: int = 0, params: Any = None,
                 tokenizer: Any = "auto", num_scheduler_steps: int = 1,
                 async_scheduling: bool = True, compilation_cache_dir: str | None = "auto",
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS, precompile: bool = False,
                 distributed_coordinator_address: str | None = None,
                 distributed_num_processes: int | None = None,
                 distributed_process_id: int | None = None) -> None:
        """`async_scheduling`: dispatch step t+1 before reading step t (the fast path; False
        gives the synchronous engine, same outputs). `compilation_cache_dir`: JAX's
        persistent compilation cache ("auto": `PAXKV_COMPILATION_CACHE_DIR` or the user
        cache directory; None or "off": no cache; see `paxkv/runner/compile_cache.py`).
        `precompile`: compile every step shape of a plain workload now, so that requests
        arriving over time never wait on a compilation (GPU only; `paxkv/runner/precompile.py`).

        `max_num_seqs` / `max_num_batched_tokens`: None takes vLLM's defaults for the
        device, 1024 / 16384 on an accelerator of H100 / H200 size, else 256 / 8192
        (`config.default_batch_limits`).

        `tensor_parallel_size` > 1 splits weights and KV pool over that many devices; the
        `distributed_*` arguments join several processes (hosts) into one engine (README:
        "Tensor parallelism and multi-host"). On processes other than 0 the constructor
        builds and serves every engine process 0 builds, and ends the process
        (SystemExit(0)) when process 0's program exits: every host runs the same program."""
        arguments = {k: v for k, v in dict(locals()).items() if k != "self"}   # for the workers
        if (distributed_coordinator_address, distributed_num_processes,
                distributed_process_id) != (None, None, None):
            from paxkv.parallel import multihost   # before JAX touches a device
            multihost.initialize(multihost.DistributedConfig(
                distributed_coordinator_address, distributed_num_processes, distributed_process_id))
            if not multihost.is_driver():
                multihost.run_worker(lambda kwargs: LLM(**kwargs).llm_engine.runner)
                raise SystemExit(0)
            multihost.announce_engine(arguments)
        import jax
        import jax.numpy as jnp

        from paxkv.runner import Runner
        from paxkv.runner.compile_cache import enable_compilation_cache
        from paxkv.runner.memory import (block_bytes_per_device, device_memory_stats, num_kv_blocks,
                                         num_swap_blocks)

        platform = jax.default_backend()
        multi_process = jax.process_count() > 1
        device_bytes = device_memory_stats().get("bytes_limit") if platform == "gpu" else None
        max_num_seqs, max_num_batched_tokens = default_batch_limits(
            max_num_seqs, max_num_batched_tokens, platform, device_bytes)
        if not isinstance(precompile, bool):
            raise TypeError(f"precompile must be a bool, got {precompile!r}")
        if precompile and platform != "gpu":
            raise ValueError(f"precompile needs the GPU's fixed step shapes; JAX runs on {platform!r}")
        self.compilation_cache_dir = enable_compilation_cache(
            compilation_cache_dir,
            sharded_on_cpu=platform == "cpu" and (tensor_parallel_size != 1 or multi_process))

        dtype = resolve_dtype(dtype, platform)
        jdtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
        path, cfg = _resolve_model(model)
        mesh = None
        if tensor_parallel_size != 1 or multi_process:
            from paxkv.parallel.loading import load_model
            mesh, params, cfg = load_model(path, cfg, params, tensor_parallel_size, dtype, seed)
        elif path is not None:
            from paxkv.model.weights import load_checkpoint
            if params is None:
                params, cfg = load_checkpoint(path, dtype=dtype)
            else:
                from paxkv.model.weights import checkpoint_config
                cfg = checkpoint_config(path)
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
        config = EngineConfig(cfg, cache, sched, dtype=dtype, attention_backend=attention_backend,
                              tensor_parallel_size=tensor_parallel_size, seed=seed,
                              num_scheduler_steps=num_scheduler_steps,
                              async_scheduling=async_scheduling, max_logprobs=max_logprobs)
        profile = runner_config(config, platform)   # the pool not sized yet
        num_blocks = num_kv_blocks(cache, params, profile, mesh)
        if multi_process:   # every process must build the same pool: process 0's measure
            from paxkv.parallel import multihost
            num_blocks = multihost.agree(num_blocks)
        self.config = config.with_pool(
            num_blocks, num_swap_blocks(config, block_bytes_per_device(profile)))
        runner = Runner(params, runner_config(self.config, platform), mesh)
        if precompile:   # every process of a multi-host engine compiles the same programs
            compiled = runner.precompile(num_scheduler_steps)
            logger.info("precompiled %d step programs in %.1f s", compiled, runner.compile_time_s)
        if multi_process and multihost.is_driver():   # announce each device call to the workers
            runner = multihost.DriverRunner(runner)
        self.llm_engine = LLMEngine(self.config, runner, tokenizer)
        self._request_counter = itertools.count()

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


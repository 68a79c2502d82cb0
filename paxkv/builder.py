"""One engine builder: `EngineArgs` -> a running `LLMEngine`, in the order the parts depend on
each other.

1. Join the other hosts of a multi-host engine (before JAX touches a device).
2. Resolve the model, load or draw its weights (sharded under tensor parallelism), fuse
   its projections into the serving layout, load its tokenizer.
3. Derive the configs: batch limits from the device, `EngineConfig` (every cross-config
   check), `runner_config` (dtypes, backend, shape buckets).
4. Load a draft model's weights (speculative `draft_model`) or an EAGLE head (`eagle`),
   then size the KV pool from what the weights and a profile step leave (a block costs the
   target's bytes plus the draft's), and the host swap pool.
5. Build the runner (and precompile its programs), the draft model's runner over its own
   pool of the same blocks or the EAGLE drafter over the target's embedding, then the
   engine around them.

`LLM(...)` is a thin facade over `build_engine`; `paxkv serve` builds its engine the same way.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from paxkv.config import (CacheConfig, EngineConfig, ModelConfig, SchedulerConfig,
                          default_batch_limits, resolve_dtype, runner_config)
from paxkv.engine.llm_engine import LLMEngine
from paxkv.engine_args import EngineArgs
from paxkv.spec_decode.config import parse_speculative_config

logger = logging.getLogger("paxkv")


@dataclasses.dataclass
class BuiltEngine:
    engine: LLMEngine
    tokenizer: Any
    config: EngineConfig           # with the pool sized
    compilation_cache_dir: str | None


def build_engine(args: EngineArgs) -> BuiltEngine:
    """Everything `args` asks for, built (see the module docstring for the order)."""
    if args.distributed:
        _join_hosts(args)            # ends the process on every host but process 0
    import jax

    from paxkv.runner.compile_cache import enable_compilation_cache
    platform = jax.default_backend()
    multi_process = jax.process_count() > 1
    if not isinstance(args.precompile, bool):
        raise TypeError(f"precompile must be a bool, got {args.precompile!r}")
    if args.precompile and platform != "gpu":
        raise ValueError(f"precompile needs the GPU's fixed step shapes; JAX runs on {platform!r}")
    cache_dir = enable_compilation_cache(
        args.compilation_cache_dir,
        sharded_on_cpu=platform == "cpu" and (args.tensor_parallel_size != 1 or multi_process))
    dtype = resolve_dtype(args.dtype, platform)
    path, cfg, params, mesh = load_weights(args, dtype, multi_process)
    tokenizer = args.tokenizer
    if tokenizer == "auto":
        from paxkv.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(path) if path is not None else None
    config = engine_config(args, cfg, dtype, platform)
    draft = head = None
    method = config.speculative.method if config.speculative is not None else None
    if method == "draft_model":
        draft = load_draft(args, config, dtype, multi_process)
    elif method == "eagle":
        head = load_eagle_head(config, multi_process)
    config = size_pools(config, params, mesh, platform, multi_process,
                        draft_config=draft[0] if draft else None)
    runner = make_runner(args, config, params, mesh, platform, multi_process)
    proposer = None
    if draft is not None:
        proposer = make_draft_proposer(config, *draft, platform)
    elif head is not None:
        proposer = make_eagle_proposer(config, head, runner, mesh)
    return BuiltEngine(LLMEngine(config, runner, tokenizer, proposer), tokenizer, config,
                       cache_dir)


def _join_hosts(args: EngineArgs) -> None:
    """Make this process part of a multi-host engine: on workers, serve every engine process
    0 builds and end the process when its program ends; on process 0, tell the workers."""
    from paxkv.parallel import multihost
    multihost.initialize(multihost.DistributedConfig(
        args.distributed_coordinator_address, args.distributed_num_processes,
        args.distributed_process_id))
    if not multihost.is_driver():
        multihost.run_worker(lambda kwargs: build_engine(EngineArgs(**kwargs)).engine.runner)
        raise SystemExit(0)
    multihost.announce_engine(args.as_kwargs())


def resolve_model(model: str | ModelConfig) -> tuple[str | None, ModelConfig | None]:
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


def load_weights(args: EngineArgs, dtype: str, multi_process: bool
                 ) -> tuple[str | None, ModelConfig, Any, Any]:
    """(checkpoint path or None, model config, params in the serving layout, mesh or None)."""
    import jax
    import jax.numpy as jnp

    from paxkv.model.fusion import fuse_projections
    path, cfg = resolve_model(args.model)
    params, mesh = args.params, None
    if args.tensor_parallel_size != 1 or multi_process:
        from paxkv.parallel.loading import load_model
        mesh, params, cfg = load_model(path, cfg, params, args.tensor_parallel_size, dtype,
                                       args.seed)
    elif path is not None:
        from paxkv.model.weights import checkpoint_config, load_checkpoint
        if params is None:
            params, cfg = load_checkpoint(path, dtype=dtype)
        else:
            cfg = checkpoint_config(path)
    elif params is None:
        from paxkv.model.weights import random_params
        params = random_params(cfg, jax.random.PRNGKey(args.seed),
                               jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
    # Serve from the fused weight layout (two matmuls per layer instead of five); nothing
    # else holds the separate tensors, so only one copy of the weights stays resident.
    return path, _with_numerics(cfg, args), fuse_projections(params), mesh


def _with_numerics(cfg: ModelConfig | None, args: EngineArgs) -> ModelConfig | None:
    """`cfg` computing as `args` asks (`ModelConfig.batch_invariant`)."""
    if cfg is None or not args.batch_invariant:
        return cfg
    if not isinstance(args.batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {args.batch_invariant!r}")
    if args.kv_cache_dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"batch_invariant reads unquantized pages; kv_cache_dtype "
                         f"{args.kv_cache_dtype!r} quantizes them")
    return dataclasses.replace(cfg, batch_invariant=True)


def engine_config(args: EngineArgs, cfg: ModelConfig, dtype: str, platform: str) -> EngineConfig:
    """The engine's configs, the pool not sized yet; batch limits default by device."""
    from paxkv.runner.memory import device_memory_stats
    device_bytes = device_memory_stats().get("bytes_limit") if platform == "gpu" else None
    max_num_seqs, max_num_batched_tokens = default_batch_limits(
        args.max_num_seqs, args.max_num_batched_tokens, platform, device_bytes)
    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = min(cfg.max_position_embeddings, 8192)
    cache = CacheConfig(block_size=args.block_size,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        num_gpu_blocks_override=args.num_gpu_blocks_override,
                        kv_cache_dtype=args.kv_cache_dtype,
                        enable_prefix_caching=args.enable_prefix_caching,
                        swap_space=args.swap_space, kv_offloading_size=args.kv_offloading_size)
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(max_num_batched_tokens,
                                   0 if args.enable_chunked_prefill else max_model_len),
        max_model_len=max_model_len, policy=args.scheduler,
        scheduling_policy=args.scheduling_policy, preemption_mode=args.preemption_mode,
        enable_chunked_prefill=args.enable_chunked_prefill)
    return EngineConfig(cfg, cache, sched, dtype=dtype, attention_backend=args.attention_backend,
                        tensor_parallel_size=args.tensor_parallel_size, seed=args.seed,
                        num_scheduler_steps=args.num_scheduler_steps,
                        async_scheduling=args.async_scheduling, max_logprobs=args.max_logprobs,
                        speculative=parse_speculative_config(args.speculative_config))


def load_draft(args: EngineArgs, config: EngineConfig, dtype: str, multi_process: bool
               ) -> tuple[EngineConfig, Any, Any]:
    """The draft model of `speculative_config.model`: (its engine config, the target's with
    the draft's model, unsized; its params; its mesh). It must share the target's vocabulary
    and fit `max_model_len`, in one KV group (no sliding windows), on one process."""
    from paxkv.cache.kv_layout import kv_layout
    spec = config.speculative
    if multi_process:
        raise ValueError("speculative_config.method 'draft_model' runs on one host only")
    try:       # the draft's config first (cheap), its weights once it passes the checks
        path, cfg = resolve_model(spec.model)
        if cfg is None:
            from paxkv.model.weights import checkpoint_config
            cfg = checkpoint_config(path)
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    target = config.model
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model {spec.model!r} has a vocabulary of "
                         f"{cfg.vocab_size} tokens, the target {target.vocab_size}: a draft "
                         f"model shares the target's tokenizer")
    if kv_layout(cfg).windows() != (None,):
        raise ValueError(f"speculative_config.model {spec.model!r} has sliding-window layers; "
                         f"a draft model reads the target's block tables, one KV group")
    if config.scheduler.max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"speculative_config.model {spec.model!r} holds "
                         f"{cfg.max_position_embeddings} positions, less than max_model_len "
                         f"{config.scheduler.max_model_len}")
    draft_args = dataclasses.replace(args, model=spec.model, params=None, speculative_config=None)
    _, cfg, params, mesh = load_weights(draft_args, dtype, multi_process)
    return dataclasses.replace(config, model=cfg, speculative=None), params, mesh


def make_draft_proposer(config: EngineConfig, draft_config: EngineConfig, params: Any,
                        mesh: Any, platform: str) -> Any:
    """The draft model's runner over a pool of the target's sized block count, in its
    proposer."""
    from paxkv.runner import Runner
    from paxkv.spec_decode.proposers import make_proposer
    sized = draft_config.with_pool(config.cache.num_gpu_blocks)
    runner = Runner(params, runner_config(sized, platform), mesh)
    sched = config.scheduler
    return make_proposer(config.speculative, runner, sched.max_num_batched_tokens,
                         sched.max_num_seqs)


def load_eagle_head(config: EngineConfig, multi_process: bool) -> Any:
    """The EAGLE head of `speculative_config.model` (a safetensors file `train_eagle.py`
    writes), checked against the target: its params. It drafts through the target's tied
    embedding, one host (under tensor parallelism it runs replicated)."""
    from paxkv.spec_decode.eagle import load_head
    spec, target = config.speculative, config.model
    if multi_process:
        raise ValueError("speculative_config.method 'eagle' runs on one host only")
    if not target.tie_word_embeddings:
        raise ValueError(f"speculative_config.method 'eagle': the head drafts through the "
                         f"target's tied embedding, and {target.name} has a separate LM head")
    if not os.path.isfile(spec.model):
        raise ValueError(f"speculative_config.model {spec.model!r}: no such file (an EAGLE "
                         f"head's safetensors file, scripts/train_eagle.py)")
    try:
        return load_head(spec.model, target)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"speculative_config.model {spec.model!r}: {e}") from None


def make_eagle_proposer(config: EngineConfig, head: Any, runner: Any, mesh: Any) -> Any:
    """The EAGLE drafter (the head over the runner's embedding) in its proposer."""
    from paxkv.spec_decode.eagle_drafter import EagleDrafter
    from paxkv.spec_decode.proposers import make_proposer
    spec, target = config.speculative, config.model
    drafter = EagleDrafter(head, target, lambda: runner.params["embed_tokens"]["embedding"],
                           spec.num_speculative_tokens, mesh)
    return make_proposer(spec, max_num_seqs=config.scheduler.max_num_seqs,
                         eagle_drafter=drafter, feature_layer=target.num_layers)


def size_pools(config: EngineConfig, params: Any, mesh: Any, platform: str,
               multi_process: bool, draft_config: EngineConfig | None = None) -> EngineConfig:
    """`config` with its KV pool sized (`runner/memory.py`) and its host swap pool. With a
    draft model (already loaded, its weights counted as in use) each block also holds the
    draft's pages."""
    from paxkv.runner.memory import block_bytes_per_device, num_kv_blocks, num_swap_blocks
    profile = runner_config(config, platform)   # the pool not sized yet
    extra = block_bytes_per_device(runner_config(draft_config, platform)) if draft_config else 0
    num_blocks = num_kv_blocks(config.cache, params, profile, mesh, extra_block_bytes=extra)
    if multi_process:   # every process must build the same pool: process 0's measure
        from paxkv.parallel import multihost
        num_blocks = multihost.agree(num_blocks)
    block_bytes = block_bytes_per_device(profile)
    offload = int(config.cache.kv_offloading_size * 2**30 // block_bytes)
    return config.with_pool(num_blocks, num_swap_blocks(config, block_bytes), offload)


def make_runner(args: EngineArgs, config: EngineConfig, params: Any, mesh: Any, platform: str,
                multi_process: bool) -> Any:
    """The runner over the sized pool; its programs precompiled when asked."""
    from paxkv.runner import Runner
    runner = Runner(params, runner_config(config, platform), mesh)
    if args.precompile:   # every process of a multi-host engine compiles the same programs
        compiled = runner.precompile(args.num_scheduler_steps)
        logger.info("precompiled %d step programs in %.1f s", compiled, runner.compile_time_s)
    if multi_process:
        from paxkv.parallel import multihost
        if multihost.is_driver():   # announce each device call to the workers
            runner = multihost.DriverRunner(runner)
    return runner

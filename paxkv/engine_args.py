"""Every argument an engine is built from, under vLLM's names: `LLM(model, **kwargs)` and
`paxkv serve` take exactly these. Host-only: no JAX; `builder.build_engine` turns them into
an engine.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from paxkv.engine.validation import DEFAULT_MAX_LOGPROBS


@dataclasses.dataclass
class EngineArgs:
    """What `LLM(...)` takes.

    - `model`: a preset name ("tiny", "llama3-8b", ..., "smollm2-135m-instruct"), a Hugging
      Face checkpoint directory, a GGUF file, or a `ModelConfig` (random weights).
    - `max_num_seqs` / `max_num_batched_tokens`: None takes vLLM's defaults for the device,
      1024 / 16384 on an accelerator of H100 / H200 size, else 256 / 8192
      (`config.default_batch_limits`).
    - `scheduler`: "continuous" (iteration-level batching) or "static" (request-level, the
      paper's baseline); `scheduling_policy`: "fcfs" or "priority" (the waiting queue,
      `engine/request_queue.py`; `generate(..., priority=[...])`, smaller first).
    - `async_scheduling`: dispatch step t+1 before reading step t (the fast path; False gives
      the synchronous engine, same outputs).
    - `compilation_cache_dir`: JAX's persistent compilation cache ("auto":
      `PAXKV_COMPILATION_CACHE_DIR` or the user cache directory; None or "off": no cache;
      `runner/compile_cache.py`).
    - `precompile`: compile every step shape of a plain workload now, so that requests
      arriving over time never wait on a compilation (GPU only; `runner/precompile.py`).
    - `tensor_parallel_size` > 1 splits weights and KV pool over that many devices; the
      `distributed_*` arguments join several processes (hosts) into one engine
      (docs/tensor_parallel.md). On processes other than 0 the constructor
      builds and serves every engine process 0 builds, and ends the process (SystemExit(0))
      when process 0's program exits: every host runs the same program.
    - `kv_offloading_size`: GiB of host memory for the host KV tier: cached blocks the device
      pool evicts are copied there, and a later prefix hit copies them back instead of
      computing them again (`cache/host_tier.py`; 0: none).
    - `batch_invariant`: a request's tokens and logprobs are bitwise the same whatever shares
      its batch and however its prefill is chunked, and equal to the trainer's
      `paxkv.model.dense.token_logprobs` on `llm.model_config` (`model/batch_invariant.py`;
      dense models, unquantized pages; slower: docs/rollouts.md).
    - `speculative_config`: vLLM's dict, e.g. `{"method": "ngram", "num_speculative_tokens":
      4}` (docs/speculative_decoding.md; "ngram", "draft_model" and "eagle" run).
    - `params`: weights to serve instead of loading or drawing them (any layout).
    - `tokenizer`: "auto" (the checkpoint's), None, or a `paxkv.tokenizer.Tokenizer`.
    """

    model: Any = "tiny"
    dtype: str = "auto"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    swap_space: float = 4.0
    kv_offloading_size: float = 0.0
    scheduler: str = "continuous"
    scheduling_policy: str = "fcfs"
    attention_backend: str = "auto"
    tensor_parallel_size: int = 1
    seed: int = 0
    params: Any = None
    tokenizer: Any = "auto"
    num_scheduler_steps: int = 1
    async_scheduling: bool = True
    compilation_cache_dir: str | None = "auto"
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    precompile: bool = False
    batch_invariant: bool = False
    speculative_config: dict | None = None
    distributed_coordinator_address: str | None = None
    distributed_num_processes: int | None = None
    distributed_process_id: int | None = None

    @property
    def distributed(self) -> bool:
        return (self.distributed_coordinator_address, self.distributed_num_processes,
                self.distributed_process_id) != (None, None, None)

    def as_kwargs(self) -> dict[str, Any]:
        """The arguments as `LLM(**kwargs)` takes them (no copies of `params`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

"""Probe: does the Llama-3-8B engine at its defaults fit the device it sized its KV pool on?

Builds `LLM("llama3-8b")` (random bf16 weights) with the persistent compilation cache off, so
every program compiles (and XLA autotunes its matmuls) while the pool is live, prints the
allocator's figures (in use, peak, the largest free block) after each phase, then runs one
stream of 128 in / 512 out twice and 1,024 sampled requests of 128 in / 32 out (a 1,024-row
sampled decode step). Prints FAILED and the allocator's figures at the first error.

    PAXKV_COMPILATION_CACHE_DIR=off PYTHONPATH=. python3 scripts/probes/probe_pool_memory.py
    ... scripts/probes/probe_pool_memory.py --precompile          # every reachable step shape first
    ... scripts/probes/probe_pool_memory.py --autotune_reserve 0  # no room kept for autotuning
"""
from __future__ import annotations

import argparse
import logging
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--autotune_reserve", type=int, default=None,
                        help="memory.AUTOTUNE_RESERVE_WEIGHTS (default: the library's)")
    parser.add_argument("--gpu_memory_utilization", type=float, default=0.9)
    parser.add_argument("--precompile", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)

    import jax

    import paxkv.runner.memory as memory
    from paxkv import LLM, SamplingParams
    if args.autotune_reserve is not None:
        memory.AUTOTUNE_RESERVE_WEIGHTS = args.autotune_reserve

    def stats(tag: str) -> None:
        s = jax.local_devices()[0].memory_stats() or {}
        print(tag, {k: round(v / 2**30, 2) for k, v in s.items() if "bytes" in k}, flush=True)

    print("autotune reserve", memory.AUTOTUNE_RESERVE_WEIGHTS, "utilization",
          args.gpu_memory_utilization, "precompile", args.precompile,
          jax.devices()[0].device_kind, flush=True)
    t0 = time.perf_counter()
    llm = LLM("llama3-8b", tokenizer=None, seed=0,
              gpu_memory_utilization=args.gpu_memory_utilization, precompile=args.precompile)
    print("setup_s", round(time.perf_counter() - t0, 1), "blocks",
          llm.config.cache.num_gpu_blocks, flush=True)
    stats("after LLM()")
    prompt = list(range(100, 228))
    greedy = SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True, detokenize=False)
    try:
        llm.generate([prompt], greedy, use_tqdm=False)
        stats("after warm-up")
        t = time.perf_counter()
        llm.generate([prompt], greedy, use_tqdm=False)
        print(f"one stream tok/s {512 / (time.perf_counter() - t):.1f}", flush=True)
        batch = [list(range(100 + i, 228 + i)) for i in range(1024)]
        sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=32, ignore_eos=True,
                                 detokenize=False, seed=1)
        t = time.perf_counter()
        llm.generate(batch, sampled, use_tqdm=False)
        print(f"1024 x 128/32 sampled {1024 / (time.perf_counter() - t):.2f} req/s "
              f"(compile included)", flush=True)
        stats("after batch")
        print("OK", flush=True)
    except Exception as e:   # report and show the allocator's state, not a traceback
        print("FAILED", type(e).__name__, str(e).splitlines()[0][:300], flush=True)
        stats("at failure")


if __name__ == "__main__":
    main()

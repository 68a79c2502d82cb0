"""Tensor parallelism on several GPUs: Llama-3-8B scaling, Llama-3-70B built sharded, one
131,072-token context, all in one run on one machine.

Parts (`--parts`, each in its own process so a size's memory is gone before the next):
- `8b`: Llama-3-8B (random bf16 weights) at each of `--tp_sizes`: one stream of 128 in / 512
  out (tok/s against the weights-read roofline of N devices) and 1000 x 256/256 (requests/s),
  through `scripts/bench_throughput.py --tensor_parallel_size N`;
- `profile`: the decode step at batch 256 at each size, traced (`scripts/profile_step.py`) and
  split into matmul, attention and all-reduce kernel time per device;
- `70b`: Llama-3-70B (random bf16 weights built straight into their shards) at `--tp_sizes_70b`:
  the same two figures and the KV pool's size in tokens;
- `long`: Llama-3.1-8B at `--long_context` tokens on `--long_tp` devices with FP8 KV: one
  prompt prefilled in chunks, then decoded; time to first token and decode tok/s.
The device copy bandwidth is measured in each part's process (bench_throughput does it).
NCCL's NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is set for every child.

    PYTHONPATH=. python3 scripts/bench_tensor_parallel.py --out_dir DIR                  # all parts
    PYTHONPATH=. python3 scripts/bench_tensor_parallel.py --out_dir DIR --parts 8b --tp_sizes 1,2
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "scratch/results/tensor_parallel", "where every part's json and the summary go (--out_dir=results/tensor_parallel updates the committed results)")
flags.DEFINE_list("parts", ["8b", "profile", "70b", "long"], "which parts to run, in order")
flags.DEFINE_list("tp_sizes", ["1", "2", "4", "8"], "8B: tensor-parallel sizes (those above the GPU count are skipped)")
flags.DEFINE_list("tp_sizes_70b", ["4", "8"], "70B: tensor-parallel sizes")
flags.DEFINE_integer("num_prompts", 1000, "requests of the 256/256 workload")
flags.DEFINE_integer("num_scheduler_steps", 8, "decode steps per host round trip (throughput runs)")
flags.DEFINE_integer("latency_steps", 32, "decode steps per host round trip (one-stream runs)")
flags.DEFINE_integer("long_context", 131072, "long part: tokens of prompt + output")
flags.DEFINE_integer("long_output", 256, "long part: tokens generated")
flags.DEFINE_integer("long_tp", 2, "long part: tensor-parallel size")
flags.DEFINE_integer("part_timeout_s", 3000, "a part's process is stopped after this long")
flags.DEFINE_bool("long_worker", False, "internal: run the long part in this process")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def num_gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def child(args: list[str], log: str) -> dict:
    """Run one part's process (repository root, NVLS off); its exit status and wall time."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=ROOT)
    t = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT, timeout=FLAGS.part_timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {"args": args, "rc": rc, "wall_s": time.perf_counter() - t, "log": log}


def throughput(model: str, tp: int, out: str) -> dict:
    return child(["scripts/bench_throughput.py", f"--model={model}", f"--tensor_parallel_size={tp}",
                  "--workloads=fixed", f"--num_prompts={FLAGS.num_prompts}", "--latency",
                  f"--num_scheduler_steps={FLAGS.num_scheduler_steps}",
                  f"--latency_steps={FLAGS.latency_steps}", f"--out_dir={out}"], out + ".log")


def profile(tp: int, out: str) -> dict:
    return child(["scripts/profile_step.py", "--model=llama3-8b", f"--tensor_parallel_size={tp}",
                  "--batches=256", "--context=512", "--multi_steps=0", "--matmuls=false",
                  f"--out_dir={out}"], out + ".log")


def long_context() -> dict:
    """One prompt of `long_context - long_output` tokens, prefilled in 8192-token chunks, then
    decoded: TTFT and decode tok/s (compilation, if any in the timed run, reported apart)."""
    import jax

    from paxkv import LLM, SamplingParams
    out_len, total = FLAGS.long_output, FLAGS.long_context
    llm = LLM("llama3.1-8b", tensor_parallel_size=FLAGS.long_tp, kv_cache_dtype="fp8",
              max_model_len=total, max_num_seqs=8, max_num_batched_tokens=8192, tokenizer=None,
              num_scheduler_steps=FLAGS.latency_steps)
    engine = llm.llm_engine
    prompt_len = total - out_len - 1
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, detokenize=False)
    # Warm-up: the same chunk shapes (one full chunk and the same last chunk), so the timed
    # run compiles nothing.
    warm_len = 8192 + prompt_len % 8192
    llm.generate([[100 + i % 1000 for i in range(warm_len)]], sp, use_tqdm=False)
    engine.metrics.reset()
    t = time.perf_counter()
    res = llm.generate([[100 + i % 1000 for i in range(prompt_len)]], sp, use_tqdm=False)[0]
    wall = time.perf_counter() - t
    m = res.metrics
    summary = engine.metrics.summary()
    return {"model": "llama3.1-8b", "tensor_parallel_size": FLAGS.long_tp, "kv_cache_dtype": "fp8",
            "prompt_tokens": prompt_len, "output_tokens": len(res.outputs[0].token_ids),
            "ttft_s": m.first_token_time - m.arrival_time,
            "decode_tokens_per_s": (len(res.outputs[0].token_ids) - 1) / (m.finished_time - m.first_token_time),
            "wall_s": wall, "compile_s_in_timed_run": summary["compile_s"],
            "num_kv_blocks": engine.metrics.num_blocks - 1, "block_size": engine.config.cache.block_size,
            "jax": jax.__version__, "devices": [str(d.device_kind) for d in jax.devices()]}


def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _table_section(title: str, header: list[str], rows: list[list]) -> list[str]:
    """The report lines of one part: its heading, a markdown table of `rows`, a blank line."""
    return [f"## {title}", "", "| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |",
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows), ""]


def summarize(out_dir: str, runs: dict) -> str:
    """Every part's figures in one table per part (markdown), from the parts' json files."""
    lines = ["# Tensor parallelism on several H200s", "",
             f"Command: `{' '.join(['PYTHONPATH=. python3'] + sys.argv)}` (NCCL_NVLS_ENABLE=0 in every part)", ""]
    rows = []
    for key, run in runs.items():
        if not key.startswith(("8b-", "70b-")):
            continue
        r = _load(os.path.join(run["out"], "throughput.json")) or {}
        lat, fixed = r.get("latency", {}), r.get("paxkv_fixed", {})
        bw = r.get("bandwidth", {}).get("ceiling_TBps")
        rows.append([key, r.get("device", "?"), r.get("jax", "?"),
                     f"{lat.get('decode_tokens_per_s', float('nan')):.1f}",
                     f"{lat.get('roofline_tokens_per_s', float('nan')):.1f}",
                     f"{fixed.get('requests_per_s', float('nan')):.2f}",
                     f"{(r.get('num_kv_blocks') or 0) * 16:,}", f"{bw}", run["rc"]])
    if rows:
        lines += _table_section("One stream 128/512 and 1000 x 256/256",
                                ["run", "device", "JAX", "one stream tok/s", "roofline tok/s (N devices)",
                                 "requests/s", "KV pool tokens", "copy TB/s", "rc"], rows)
    prof = []
    for key, run in runs.items():
        if key.startswith("profile-"):
            p = _load(os.path.join(run["out"], "profile_step.json")) or {}
            for step in p.get("steps", []):
                kinds = step.get("trace", {}).get("ms_per_step_per_device_by_kind", {})
                prof.append([key, step.get("batch"), f"{step.get('back_to_back_step_ms', float('nan')):.2f}"]
                            + [f"{kinds.get(k, 0.0):.2f}" for k in ("matmul", "attention", "all-reduce", "other")])
    if prof:
        lines += _table_section("Decode step at batch 256 (context 512), kernel time per device",
                                ["run", "batch", "step ms (back to back)", "matmul ms", "attention ms",
                                 "all-reduce ms", "other ms"], prof)
    if "long" in runs:
        r = _load(os.path.join(runs["long"]["out"], "long_context.json")) or {}
        lines += ["## One long context", "", "```", json.dumps(r, indent=1), "```", ""]
    return "\n".join(lines)


def main(argv):
    del argv
    if FLAGS.long_worker:
        result = long_context()
        os.makedirs(FLAGS.out_dir, exist_ok=True)
        with open(os.path.join(FLAGS.out_dir, "long_context.json"), "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result), flush=True)
        return
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    gpus = num_gpus()
    runs: dict[str, dict] = {}
    for part in FLAGS.parts:
        sizes = {"8b": FLAGS.tp_sizes, "profile": FLAGS.tp_sizes, "70b": FLAGS.tp_sizes_70b,
                 "long": [str(FLAGS.long_tp)]}[part]
        for tp in (int(s) for s in sizes):
            if tp > gpus:
                print(f"skip {part} at TP={tp}: {gpus} GPUs", flush=True)
                continue
            key = part if part == "long" else f"{part}-tp{tp}"
            out = os.path.join(FLAGS.out_dir, key)
            if part == "8b":
                run = throughput("llama3-8b", tp, out)
            elif part == "70b":
                run = throughput("llama3-70b", tp, out)
            elif part == "profile":
                run = profile(tp, out)
            else:
                run = child(["scripts/bench_tensor_parallel.py", "--long_worker", f"--out_dir={out}",
                             f"--long_context={FLAGS.long_context}", f"--long_output={FLAGS.long_output}",
                             f"--long_tp={FLAGS.long_tp}", f"--latency_steps={FLAGS.latency_steps}"],
                            out + ".log")
            run["out"] = out
            runs[key] = run
            print(key, run["rc"], f"{run['wall_s']:.0f}s", flush=True)
            with open(os.path.join(FLAGS.out_dir, "runs.json"), "w") as f:
                json.dump(runs, f, indent=1)
            with open(os.path.join(FLAGS.out_dir, "tensor_parallel.md"), "w") as f:
                f.write(summarize(FLAGS.out_dir, runs))
    print(summarize(FLAGS.out_dir, runs))


if __name__ == "__main__":
    app.run(main)

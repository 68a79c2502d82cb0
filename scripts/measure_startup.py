"""Time from `LLM(...)` to the first token, in a first process and in a second one that
finds the first one's persistent compilation cache.

Each process builds the engine (weights, KV pool sizing, runner), then generates one short
request; the time to its first token and the engine's compile count and compile seconds
are recorded. The second process should compile nothing the first compiled.

    PYTHONPATH=. python3 scripts/measure_startup.py --model llama3-8b --out_dir results/startup
    PYTHONPATH=. python3 scripts/measure_startup.py --model tiny     # CPU
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "preset or checkpoint directory")
flags.DEFINE_string("out_dir", "scratch/results/startup", "where startup.json and startup.md go (--out_dir=results/startup updates the committed results)")
flags.DEFINE_integer("processes", 2, "how many processes in a row share one cache")
flags.DEFINE_bool("child", False, "internal: run one measurement and print it as json")
flags.DEFINE_string("cache_dir", "", "internal: the compilation cache of the child")


def child() -> None:
    t0 = time.perf_counter()
    import jax

    from paxkv import LLM, SamplingParams
    events: dict[str, int] = {}

    def count(event: str, **_: object) -> None:
        if event.startswith("/jax/compilation_cache/"):
            events[event.rsplit("/", 1)[-1]] = events.get(event.rsplit("/", 1)[-1], 0) + 1

    jax.monitoring.register_event_listener(count)
    llm = LLM(FLAGS.model, tokenizer=None, compilation_cache_dir=FLAGS.cache_dir)
    t_built = time.perf_counter()
    out = llm.generate([list(range(100, 228))], SamplingParams(temperature=0.0, max_tokens=16,
                                                               ignore_eos=True, detokenize=False),
                       use_tqdm=False)[0]
    m = out.metrics
    t_first = t_built + (m.first_token_time - m.arrival_time)
    runner = llm.llm_engine.runner
    print(json.dumps({"build_s": t_built - t0, "to_first_token_s": t_first - t0,
                      "new_buckets": runner.num_compilations, "compile_s": runner.compile_time_s,
                      "cache_hits": events.get("cache_hits", 0),
                      "cache_misses": events.get("cache_misses", 0),
                      "jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}))


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.child:
        child()
        return
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    cache = tempfile.mkdtemp(prefix="paxkv-xla-")
    runs = []
    for i in range(FLAGS.processes):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", f"--model={FLAGS.model}",
               f"--cache_dir={cache}"]
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"process {i} failed")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row["process_wall_s"] = time.perf_counter() - t
        runs.append(row)
        print(f"process {i + 1}: {row}", flush=True)
    files = sum(len(f) for _, _, f in os.walk(cache))
    result = {"command": " ".join(["scripts/measure_startup.py"] + sys.argv[1:]), "model": FLAGS.model,
              "runs": runs, "cache_entries": files}
    with open(os.path.join(FLAGS.out_dir, "startup.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Start-up time, {FLAGS.model} ({runs[0]['device']}, JAX {runs[0]['jax']})", "",
             f"Command: `PYTHONPATH=. python3 {result['command']}`", "",
             "| process | LLM(...) built (s) | to first token (s) | step buckets first called "
             "| their compile + load s | cache hits | cache misses (compiled) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for i, r in enumerate(runs):
        lines.append(f"| {i + 1} | {r['build_s']:.1f} | {r['to_first_token_s']:.1f} | "
                     f"{r['new_buckets']} | {r['compile_s']:.1f} | {r['cache_hits']} | "
                     f"{r['cache_misses']} |")
    lines.append("")
    lines.append(f"Persistent cache entries after the runs: {files}.")
    with open(os.path.join(FLAGS.out_dir, "startup.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    app.run(main)

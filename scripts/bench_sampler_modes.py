"""What each sampler path costs: greedy, temperature only (no sort), and the sort that top-k,
top-p and min-p need, alone and inside a batch-256 decode step.

The sampler picks the cheapest path a step's rows need (`sampling.rows.sampling_mode`). Rows
with a temperature and no filter (the OpenAI API's defaults) take Gumbel-max over the whole
vocabulary; only a step with some top-k, top-p or min-p row sorts each row. Before the paths
were split, temperature-only rows took the sort as well: the `temperature, sorted` case forces
that path on the same rows (`Runner.dispatch(force_sampling_mode="filtered")`), so the run
measures what the split saves against what it replaced, side by side. Greedy is the floor.

Checked first, on the same logits: the unsorted and the sorted path pick the same token for
every temperature-only row (both take Gumbel-max over the same per-token draws); the run stops
loudly otherwise, and when the temperature-only step misses its target against greedy.

Part 1 times the sampler alone (jitted `sampler.sample` on random float32 logits of the
model's vocabulary) at several row counts. Part 2 times the runner's decode step pipelined, as
the asynchronous engine runs it (step i+1 dispatched before step i is read), every row at the
same context, the cases interleaved over `--rounds` rounds.

    PYTHONPATH=. python3 scripts/bench_sampler_modes.py --out_dir results
    PYTHONPATH=. python3 scripts/bench_sampler_modes.py --smoke --out_dir /tmp/s   # CPU
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import decode_batch_engine, pipelined_rounds  # noqa: E402  (shared with bench_sampling)

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "llama3-8b", "preset (random bf16 weights)")
flags.DEFINE_integer("batch", 256, "decode rows of the step")
flags.DEFINE_integer("context", 512, "tokens of context per row")
flags.DEFINE_list("alone_rows", ["8", "256", "1024"], "row counts for the sampler alone")
flags.DEFINE_integer("steps", 20, "pipelined steps per case and round")
flags.DEFINE_integer("rounds", 6, "rounds over the cases, interleaved")
flags.DEFINE_integer("reps", 15, "timed calls of the sampler alone per case")
flags.DEFINE_float("max_temperature_cost", 0.05,
                   "target: the temperature-only step at most this much slower than greedy")
flags.DEFINE_bool("smoke", False, "CPU check: tiny-random, batch 8, context 40")
flags.DEFINE_string("out_dir", "scratch/results", "where sampler_modes.md/.json/.png go (--out_dir=results updates the committed results)")

# name -> (temperature, top_p, forced path or None)
CASES = {"greedy": (0.0, 1.0, None),
         "temperature": (1.0, 1.0, None),
         "temperature, sorted": (1.0, 1.0, "filtered"),
         "top-p 0.95": (1.0, 0.95, None)}


def rows_for(case: str, n: int) -> list:
    from paxkv.engine.step_io import SampleRow
    temperature, top_p, _ = CASES[case]
    return [SampleRow(i, temperature, top_p=top_p, seed=i) for i in range(n)]


def sampler_alone(runner, vocab: int, num_rows: int, reps: int) -> dict:
    """ms per jitted `sample` call on [num_rows, vocab] float32 logits, by case; checks that the
    unsorted and sorted paths agree token for token on temperature-only rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from paxkv.sampler import sample
    from paxkv.sampling.rows import widen_sampling_mode

    logits = jnp.asarray(np.random.default_rng(num_rows).standard_normal((num_rows, vocab)),
                         jnp.float32)
    out, tokens = {}, {}
    for case in CASES:
        st, mode, _ = runner.pack_sampling(rows_for(case, num_rows))
        st = jax.tree.map(jnp.asarray, st)
        mode = widen_sampling_mode(mode, CASES[case][2])
        fn = jax.jit(lambda x, st, mode=mode: sample(x, st, mode=mode, num_logprobs=0).tokens)
        tokens[case] = np.asarray(fn(logits, st))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(logits, st).block_until_ready()
            times.append(time.perf_counter() - t0)
        out[case] = {"mode": mode, "median_ms": 1e3 * statistics.median(times)}
    if not np.array_equal(tokens["temperature"], tokens["temperature, sorted"]):
        raise SystemExit(f"FAIL: at {num_rows} rows the unsorted and sorted paths picked "
                         "different tokens for temperature-only rows")
    return out


def main(argv) -> None:
    del argv
    import jax
    import numpy as np

    model, batch, ctx, steps, rounds = FLAGS.model, FLAGS.batch, FLAGS.context, FLAGS.steps, FLAGS.rounds
    alone_rows = [int(r) for r in FLAGS.alone_rows]
    reps = FLAGS.reps
    if FLAGS.smoke:
        model, batch, ctx, steps, rounds, alone_rows, reps = "tiny-random", 8, 40, 3, 2, [8], 3
    llm, items = decode_batch_engine(model, batch, ctx, FLAGS.smoke, np.random.default_rng(0))
    runner = llm.llm_engine.runner
    vocab = runner.cfg.vocab_size
    results = {"model": model, "batch": batch, "context": ctx, "vocab": vocab,
               "jax": jax.__version__,
               "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
               "steps_per_round": steps, "rounds": rounds, "reps": reps}

    results["alone"] = {}
    for n in alone_rows:
        results["alone"][n] = sampler_alone(runner, vocab, n, reps)
        print("alone", n, {c: round(r["median_ms"], 3) for c, r in results["alone"][n].items()},
              flush=True)

    cases = {}
    for case in CASES:
        rows, forced = rows_for(case, batch), CASES[case][2]
        cases[case] = (lambda rows=rows, forced=forced:
                       runner.dispatch(items, rows, force_sampling_mode=forced), runner.fetch)
    results["step"] = pipelined_rounds(cases, steps, rounds, "greedy")
    write_report(results)
    cost = results["step"]["temperature"]["ratio_to_base"] - 1.0
    if not FLAGS.smoke and cost > FLAGS.max_temperature_cost:
        raise SystemExit(f"FAIL: the temperature-only step costs {100 * cost:+.1f}% over greedy "
                         f"(target <= {100 * FLAGS.max_temperature_cost:+.0f}%)")


def write_report(results: dict) -> None:
    alone, step = results["alone"], results["step"]
    lines = [f"# Sampler paths: what sorting the vocabulary costs ({results['device']})", "",
             f"Command: `PYTHONPATH=. python3 scripts/bench_sampler_modes.py --out_dir DIR` "
             f"({results['model']}, random bf16 weights, vocabulary {results['vocab']:,}); "
             f"JAX {results['jax']}. `temperature, sorted` is the same temperature-only rows "
             "forced through the sort, the path they took before the sampler's paths were split.",
             "", "## The sampler alone (ms per call, median of "
             f"{results['reps']})", "",
             "| rows | " + " | ".join(CASES) + " | sorted / unsorted |",
             "| --- | " + " | ".join("---" for _ in CASES) + " | --- |"]
    for n, r in alone.items():
        ratio = r["temperature, sorted"]["median_ms"] / r["temperature"]["median_ms"]
        lines.append(f"| {n} | " + " | ".join(f"{r[c]['median_ms']:.3f}" for c in CASES)
                     + f" | {ratio:.1f}x |")
    lines += ["", f"## Decode step, batch {results['batch']} at context {results['context']}, "
              f"pipelined ({results['rounds']} rounds of {results['steps_per_round']} steps, "
              "interleaved)", "",
              "| case | ms per step | vs greedy (range over rounds) | target |",
              "| --- | --- | --- | --- |"]
    targets = {"temperature": f"<= +{100 * FLAGS.max_temperature_cost:.0f}%"}
    for case in CASES:
        r = step[case]
        lo, hi = (100.0 * (x - 1.0) for x in r["ratio_spread"])
        lines.append(f"| {case} | {r['median_ms']:.3f} | {100.0 * (r['ratio_to_base'] - 1.0):+.1f}% "
                     f"[{lo:+.1f}, {hi:+.1f}] | {targets.get(case, '')} |")
    saved = step["temperature, sorted"]["median_ms"] / step["temperature"]["median_ms"]
    lines += ["", f"Temperature-only steps: {saved:.2f}x faster than through the sort."]
    text = "\n".join(lines) + "\n"
    print(text)
    if not FLAGS.out_dir:
        return
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    with open(os.path.join(FLAGS.out_dir, "sampler_modes.md"), "w") as f:
        f.write(text)
    with open(os.path.join(FLAGS.out_dir, "sampler_modes.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(FLAGS.out_dir, "sampler_modes.png"))


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(CASES)
    width = 0.8 / len(results["alone"])
    for j, (n, r) in enumerate(results["alone"].items()):
        ax1.bar([i + j * width for i in range(len(names))], [r[c]["median_ms"] for c in names],
                width, label=f"{n} rows")
    ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=15)
    ax1.set_ylabel("ms per call")
    ax1.set_yscale("log")
    ax1.set_title("sampler alone")
    ax1.legend()
    ax2.bar(names, [results["step"][c]["median_ms"] for c in names])
    ax2.set_ylabel("ms per step")
    ax2.set_title(f"decode step, batch {results['batch']}")
    ax2.tick_params(axis="x", rotation=15)
    fig.suptitle(f"{results['model']} sampler paths, {results['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    app.run(main)

"""Speculative decoding's price: a verify step of 1 + k tokens per sequence against a plain
decode step, on the device alone, and what one stream would decode at a given acceptance.

For each batch and k: the runner's verify program (`Runner.dispatch_verify`: one forward
over every sequence's last token and its k drafts, logits at each, rejection sampling on
the device) and its plain decode step, each dispatched back to back N times with the last
one waited for (the device alone, no host work between), median over trials, every sequence
at `--context` tokens. Random weights: acceptance does not enter the cost.

Projections for one stream (batch 1), device time only:
- the oracle: a draft that is always right (the target's own greedy continuation), k + 1
  tokens per verify step: the mechanism's upper bound, not a proposer;
- `--acceptance_lengths`: tokens per verify step measured on the real model (results/
  spec_acceptance.md), each over the verify step of its k.

    PYTHONPATH=. python3 scripts/bench_verify_step.py --out_dir DIR                # GPU
    PYTHONPATH=. python3 scripts/bench_verify_step.py --smoke --out_dir DIR        # CPU check
"""
from __future__ import annotations

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "llama3-8b", "preset (random weights)")
flags.DEFINE_list("batches", ["1", "8", "64"], "sequences per step")
flags.DEFINE_list("ks", ["1", "2", "3", "4", "5", "6", "7", "8"], "draft tokens per sequence")
flags.DEFINE_integer("context", 512, "tokens of each sequence before the step")
flags.DEFINE_integer("steps", 20, "back-to-back dispatches per trial")
flags.DEFINE_integer("trials", 5, "trials (the median is reported)")
flags.DEFINE_list("acceptance_lengths", ["4:1.51", "4:1.82", "4:2.47"],
                  "k:tokens per verify step measured on the real model, to project")
flags.DEFINE_bool("smoke", False, "tiny model, two shapes, for the CPU")
flags.DEFINE_string("out_dir", "scratch/verify_step", "where the json, markdown and png go")


def main(argv):
    del argv
    import math

    from tqdm import tqdm

    from experiments.common import command_line, device_hardware, markdown_table, write_results
    from paxkv import LLM
    from scripts.bench_common import dispatched_ms
    from paxkv.engine.step_io import SampleRow, WorkItem

    model = "tiny-random" if FLAGS.smoke else FLAGS.model
    batches = [1, 2] if FLAGS.smoke else [int(b) for b in FLAGS.batches]
    ks = [1, 2] if FLAGS.smoke else [int(k) for k in FLAGS.ks]
    context = 40 if FLAGS.smoke else FLAGS.context
    steps, trials = (2, 2) if FLAGS.smoke else (FLAGS.steps, FLAGS.trials)
    bs = 16
    per_seq = math.ceil((context + max(ks) + 1) / bs)
    max_model_len = 128 if FLAGS.smoke else 2048
    llm = LLM(model, tokenizer=None, max_num_seqs=max(batches), block_size=bs,
              num_gpu_blocks_override=max(batches) * per_seq + max_model_len // bs + 2,
              max_model_len=max_model_len, enable_prefix_caching=False)
    runner = llm.llm_engine.runner

    def items(b: int, k: int) -> list:
        return [WorkItem([7] * (k + 1), context - 1,
                         list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))) for i in range(b)]

    results = []
    cases = [(b, k) for b in batches for k in [0] + ks]
    for b, k in tqdm(cases, desc="batch x k"):
        rows = [SampleRow(i) for i in range(b)]
        work = items(b, k)
        if k == 0:
            ms = dispatched_ms(lambda: runner.dispatch(work, rows), runner.fetch, steps, trials)
        else:
            ms = dispatched_ms(lambda: runner.dispatch_verify(work, rows, k), runner.fetch,
                               steps, trials)
        results.append({"batch": b, "k": k, "ms": ms})
        print(results[-1], flush=True)
    plain = {r["batch"]: r["ms"] for r in results if r["k"] == 0}
    for r in results:
        r["vs_decode"] = r["ms"] / plain[r["batch"]]

    header = ["batch"] + ["decode ms"] + [f"k={k}" for k in ks]
    table = markdown_table(header, [
        [b, f"{plain[b]:.2f}"] + [f"{r['ms']:.2f} ({r['vs_decode']:.2f}x)"
                                  for r in results if r["batch"] == b and r["k"] > 0]
        for b in batches])
    one = {r["k"]: r["ms"] for r in results if r["batch"] == batches[0]}
    proj_rows = [["none", 1.0, f"{1e3 / one[0]:.0f}", "1.00x"]]
    projections = []
    for k in ks:
        tok_s = (k + 1) * 1e3 / one[k]
        projections.append({"what": "oracle", "k": k, "tokens_per_step": k + 1, "tok_s": tok_s})
        proj_rows.append([f"oracle, k = {k}", k + 1, f"{tok_s:.0f}",
                          f"{tok_s * one[0] / 1e3:.2f}x"])
    for spec in FLAGS.acceptance_lengths:
        k, length = int(spec.split(":")[0]), float(spec.split(":")[1])
        if k in one:
            tok_s = length * 1e3 / one[k]
            projections.append({"what": "measured acceptance", "k": k, "tokens_per_step": length,
                                "tok_s": tok_s})
            proj_rows.append([f"measured acceptance, k = {k}", length, f"{tok_s:.0f}",
                              f"{tok_s * one[0] / 1e3:.2f}x"])
    proj = markdown_table([f"one stream (batch {batches[0]})", "tokens per step",
                           "tok/s (device time)", "vs no speculation"], proj_rows)
    print(table)
    print(proj)

    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for b in batches:
        ax.plot([0] + ks, [r["vs_decode"] for r in results if r["batch"] == b], marker="o",
                label=f"batch {b}")
    ax.axhline(1.15, color="grey", ls=":", label="1.15x")
    ax.set_xlabel("draft tokens k (the step computes k + 1 per sequence)")
    ax.set_ylabel("verify step / decode step")
    ax.set_title(f"{model}: the verify step's cost, {context}-token context")
    ax.legend()
    paths = write_results("verify_step", FLAGS.out_dir,
                          title=f"The verify step's cost: {model}",
                          command=command_line(), hardware=device_hardware(),
                          settings={"model": model, "batches": batches, "ks": ks,
                                    "context": context, "steps": steps, "trials": trials},
                          results={"steps": results, "projections": projections},
                          table=table + "\n\n" + proj, notes="", figure=fig)
    print("wrote", ", ".join(paths.values()))


if __name__ == "__main__":
    app.run(main)

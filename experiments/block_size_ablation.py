"""Throughput and latency against the KV block size, at a fixed pool capacity (paper Fig. 18b:
block sizes 16-128 do best on ShareGPT, 16-32 on Alpaca; vLLM picks 16).

For each block size an engine with the same KV pool capacity in token slots (so fewer,
larger blocks as the block grows) serves a ShareGPT-like and an Alpaca-like trace, every
request queued at once. Small blocks cost more block-table work per token (and, on a GPU,
shorter contiguous reads for the kernel); large blocks waste the unfilled tail of every
sequence's last block, which shrinks the batch the pool can hold.

    PYTHONPATH=. python3 experiments/block_size_ablation.py                 # tiny model, CPU
    PYTHONPATH=. python3 experiments/block_size_ablation.py --setting=gpu   # Llama-3-8B shapes
"""
from __future__ import annotations

import dataclasses
import gc
from typing import Any

from absl import app, flags
from tqdm import tqdm

from configs import experiments as configs
from experiments import common, serving
from paxkv.sim import workloads

FLAGS = flags.FLAGS
common.define_serving_flags()
flags.adopt_module_key_flags(common)   # its flags in --help too
flags.DEFINE_list("block_sizes", None, "Override the block sizes (run in the given order).")

NAME = "block_size_ablation"
# The share of the best throughput a block size must reach to count among the best.
NEAR_BEST = 0.95


def point_key(row: dict[str, Any]) -> tuple:
    return row["trace"], row["block_size"]


def sweep(s: configs.BlockSizeSettings, log: serving.SweepLog | None = None,
          progress: bool = True) -> tuple[list[dict[str, Any]], list[str]]:
    """Every (trace, block size) point not in `log` yet, block sizes in priority order while
    the budget lasts; returns all of `log`'s points and the skipped block sizes."""
    log = log or serving.SweepLog(point_key)
    budget = serving.Budget(s.time_budget_s)
    traces = {t: serving.settings_trace(s, t, n) for t, n in s.traces}
    todo = [bs for bs in s.block_sizes if not all(log.done(t, bs) for t, _ in s.traces)]
    for bs in budget.points(tqdm(todo, desc=NAME, disable=not progress), lambda bs: f"block {bs}"):
        llm = serving.make_llm(s.engine, block_size=bs)
        vocab = llm.config.model.vocab_size
        for trace, _ in s.traces:
            if log.done(trace, bs):
                continue
            make = lambda seed, t=trace: serving.trace_work(traces[t], vocab, seed)  # noqa: E731
            st = serving.run_offline_twice(llm, make, s.seed)
            log.add({"trace": trace, "block_size": bs, "num_blocks": s.engine.pool_tokens // bs, **st.summary()})
        del llm
        gc.collect()
    return log.rows, budget.skipped


def best_sizes(rows: list[dict[str, Any]], trace: str) -> tuple[int, list[int]]:
    """The block size of the highest throughput, and every size within NEAR_BEST of it."""
    rs = [r for r in rows if r["trace"] == trace]
    top = max(rs, key=lambda r: r["requests_per_s"])
    near = sorted(r["block_size"] for r in rs if r["requests_per_s"] >= NEAR_BEST * top["requests_per_s"])
    return top["block_size"], near


def _fig(rows: list[dict[str, Any]], s: configs.BlockSizeSettings):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    for trace, _ in s.traces:
        rs = sorted((r for r in rows if r["trace"] == trace), key=lambda r: r["block_size"])
        if not rs:
            continue
        x = [r["block_size"] for r in rs]
        axes[0].plot(x, [r["mean_normalized_latency_s"] * 1e3 for r in rs], "o-", label=trace)
        best = max(r["requests_per_s"] for r in rs)
        axes[1].plot(x, [r["requests_per_s"] / best for r in rs], "o-",
                     label=f"{trace} (best {best:.2f} requests/s)")
        axes[2].plot(x, [r["mean_batch"] for r in rs], "o-", label=trace)
        lo, hi = common.PAPER["block_size_best"][trace]
        color = axes[1].lines[-1].get_color()
        for ax in axes[:2]:
            ax.axvspan(lo, hi, color=color, alpha=0.08)
    titles = ("Normalized latency (ms/token)", "Throughput, relative to the trace's best", "Mean sequences per step")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[0].text(0.02, 0.97, "shaded: the paper's best range per trace", transform=axes[0].transAxes,
                 fontsize=7, va="top")
    fig.tight_layout()
    return fig


def _tables(rows: list[dict[str, Any]], s: configs.BlockSizeSettings, skipped: list[str]) -> tuple[str, str]:
    head = []
    for trace, _ in s.traces:
        if not any(r["trace"] == trace for r in rows):
            continue
        top, near = best_sizes(rows, trace)
        lo, hi = common.PAPER["block_size_best"][trace]
        head.append([trace, f"{lo}-{hi}", top, ", ".join(map(str, near))])
    table = "## Against the paper (Fig. 18b)\n\n" + common.markdown_table(
        ["trace", "paper: best block sizes", "paxkv: highest throughput",
         f"paxkv: within {100 * (1 - NEAR_BEST):.0f}% of it"], head)
    lines = []
    for trace, _ in s.traces:
        rs = sorted((r for r in rows if r["trace"] == trace), key=lambda r: r["block_size"])
        best = max((r["requests_per_s"] for r in rs), default=0.0)
        for r in rs:
            lines.append([trace, r["block_size"], r["num_blocks"], f"{r['requests_per_s']:.2f}",
                          f"{r['requests_per_s'] / best:.2f}" if best else "-",
                          f"{r['output_tokens_per_s']:.0f}", serving.fmt_s(r["mean_normalized_latency_s"]),
                          f"{r['mean_batch']:.1f}", r["preemptions"], r["compiles_during_run"]])
    table += "\n\n## Every run\n\n" + common.markdown_table(
        ["trace", "block size", "blocks in pool", "requests/s", "of best", "output tokens/s",
         "normalized latency", "mean batch", "preemptions", "compiles while timed"], lines)
    g = s.engine
    counts = ", ".join(f"{n} {t}-like" for t, n in s.traces)
    notes = (
        f"Requests: {counts} (`paxkv/sim/workloads.py`, seed {s.seed}), prompts and outputs clipped to "
        f"{s.max_prompt_len} / {s.max_output_len} tokens, random token ids, greedy with EOS ignored, all queued at "
        f"once. {serving.engine_note(g, 'at every block size')}, "
        "recompute preemption, prefix caching off. Each point is the second of two identical runs (the first "
        "compiles every shape); requests/s = requests / time to drain the trace; normalized latency = mean over "
        "requests of (finish - submission) / output tokens, so it includes queueing."
        + serving.skipped_note(skipped))
    return table, notes


def write(s: configs.BlockSizeSettings, rows: list[dict[str, Any]], skipped: list[str], final: bool = True) -> None:
    table, notes = _tables(rows, s, skipped)
    traces = {t: workloads.summarize(serving.settings_trace(s, t, n)) for t, n in s.traces}
    serving.write_serving_results(
        NAME, s,
        title="Block size: throughput and latency at a fixed KV pool (paper Fig. 18b)",
        results={"runs": rows, **serving.completion_fields(skipped, final), "traces": traces,
                 "best": {t: dict(zip(("highest", "near_best"), best_sizes(rows, t)))
                          for t, _ in s.traces if any(r["trace"] == t for r in rows)},
                 "paper": {"block_size_best": common.PAPER["block_size_best"]}},
        table=table, notes=notes, figure=_fig(rows, s), quiet=not final)


def main(argv: list[str]) -> None:
    del argv
    s = serving.settings_from_flags(NAME)
    if FLAGS.block_sizes:
        s = dataclasses.replace(s, block_sizes=tuple(int(b) for b in FLAGS.block_sizes))
    serving.run_resumable(NAME, s, point_key, ("block_sizes",), sweep, write)


if __name__ == "__main__":
    app.run(main)

"""Preemption by recomputation against preemption by swapping, across block sizes (the
paper's Fig. 19: recomputation never costs more than 20% over swapping, and the two are
comparable at block sizes 16-64; swapping suffers at small blocks, many small transfers).

A ShareGPT-like trace is queued at once into a KV pool far too small for its requests, so
the scheduler keeps preempting the newest running request when the pool runs dry. With
"recompute" the victim's blocks are freed and its prompt and outputs so far are prefilled
again when it is readmitted; with "swap" its blocks are copied to a host pool and back. The
same trace runs under both at every block size (same pool capacity in tokens).

    PYTHONPATH=. python3 experiments/preemption.py                 # tiny model, CPU
    PYTHONPATH=. python3 experiments/preemption.py --setting=gpu   # Llama-3-8B shapes
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

NAME = "preemption"


def run_mode(s: configs.PreemptionSettings, bs: int, mode: str, trace: list[workloads.Request]) -> dict[str, Any]:
    """Warm-up pass, then the timed pass, of the trace under one preemption mode."""
    llm = serving.make_llm(s.engine, block_size=bs, preemption_mode=mode, swap_space=s.swap_space_gib)
    vocab = llm.config.model.vocab_size
    timer = serving.SwapTimer(llm)
    sched = llm.llm_engine.scheduler
    serving.run(llm, serving.trace_work(trace, vocab, s.seed + 7919))
    timer.reset()
    rec0, swp0 = sched.num_recompute_preemptions, sched.num_swap_preemptions
    st = serving.run(llm, serving.trace_work(trace, vocab, s.seed))
    prompt_tokens = sum(r.prompt_len for r in trace)
    row = {"block_size": bs, "mode": mode, "num_blocks": s.engine.pool_tokens // bs, **st.summary(),
           **timer.summary(),
           "recompute_preemptions": sched.num_recompute_preemptions - rec0,
           "swap_preemptions": sched.num_swap_preemptions - swp0,
           "recomputed_tokens": st.prefill_tokens - prompt_tokens}
    del llm, timer
    gc.collect()
    return row


def point_key(row: dict[str, Any]) -> tuple:
    return row["block_size"], row["mode"]


def sweep(s: configs.PreemptionSettings, log: serving.SweepLog | None = None,
          progress: bool = True) -> tuple[list[dict[str, Any]], list[str]]:
    """Every (block size, mode) point not in `log` yet, block sizes in priority order while
    the budget lasts; returns all of `log`'s points and the skipped block sizes."""
    log = log or serving.SweepLog(point_key)
    budget = serving.Budget(s.time_budget_s)
    trace = serving.settings_trace(s, s.trace, s.num_requests)
    todo = [bs for bs in s.block_sizes if not all(log.done(bs, m) for m in s.modes)]
    for bs in budget.points(tqdm(todo, desc=NAME, disable=not progress), lambda bs: f"block {bs}"):
        for mode in s.modes:
            if not log.done(bs, mode):
                log.add(run_mode(s, bs, mode, trace))
    return log.rows, budget.skipped


def pairs(rows: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any], dict[str, Any]]]:
    """(block size, recompute row, swap row) for every block size that ran both."""
    by = {(r["block_size"], r["mode"]): r for r in rows}
    return [(bs, by[(bs, "recompute")], by[(bs, "swap")]) for bs in sorted({r["block_size"] for r in rows})
            if (bs, "recompute") in by and (bs, "swap") in by]


def _fig(rows: list[dict[str, Any]], s: configs.PreemptionSettings):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    for mode, color in (("recompute", "#1f77b4"), ("swap", "#ff7f0e")):
        rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["block_size"])
        if not rs:
            continue
        x = [r["block_size"] for r in rs]
        axes[0].plot(x, [r["wall_s"] for r in rs], "o-", color=color, label=mode)
        axes[1].plot(x, [r["mean_normalized_latency_s"] * 1e3 for r in rs], "o-", color=color, label=mode)
        if mode == "swap":
            axes[2].plot(x, [r["swap_s"] for r in rs], "o-", color=color, label="swap: time copying blocks (s)")
        else:
            axes[2].plot(x, [r["recomputed_tokens"] / 1000 for r in rs], "o-", color=color,
                         label="recompute: tokens prefilled again (thousands)")
    p = pairs(rows)
    if p:
        ax = axes[0].twinx()
        ax.plot([bs for bs, _, _ in p], [rc["wall_s"] / sw["wall_s"] for _, rc, sw in p], "k:", lw=1)
        ax.axhline(1 + common.PAPER["recompute_max_overhead_vs_swap"], color="grey", ls="--", lw=1)
        ax.set_ylabel("recompute / swap (dotted); paper's bound 1.2 (dashed)", fontsize=7)
    for ax, title in zip(axes, ("Time to drain the trace (s)", "Normalized latency (ms/token)",
                                "Where the preemption cost goes")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _tables(rows: list[dict[str, Any]], s: configs.PreemptionSettings, skipped: list[str]) -> tuple[str, str]:
    bound = common.PAPER["recompute_max_overhead_vs_swap"]
    p = pairs(rows)
    ratios = [rc["wall_s"] / sw["wall_s"] for _, rc, sw in p]
    head = []
    if p:
        worst = max(ratios)
        near = [bs for (bs, _, _), r in zip(p, ratios) if abs(r - 1) <= 0.1]
        head = [["recompute's time over swap's, worst block size", f"at most {1 + bound:.2f}x",
                 f"{worst:.2f}x (block {p[ratios.index(worst)][0]})"],
                ["recompute / swap at every block size", "-",
                 ", ".join(f"{bs}: {r:.2f}x" for (bs, _, _), r in zip(p, ratios))],
                ["block sizes where the two are within 10%", "16-64 comparable",
                 ", ".join(map(str, near)) or "none"]]
    table = "## Against the paper (Fig. 19)\n\n" + common.markdown_table(["what", "paper", "paxkv"], head)
    lines = []
    for r in sorted(rows, key=lambda r: (r["block_size"], r["mode"])):
        lines.append([r["block_size"], r["mode"], f"{r['wall_s']:.2f}", serving.fmt_s(r["mean_normalized_latency_s"]),
                      r["preemptions"], f"{r['swap_preemptions']} / {r['recompute_preemptions']}",
                      r["recomputed_tokens"], f"{r['blocks_swapped_out']} / {r['blocks_swapped_in']}",
                      serving.fmt_s(r["swap_s"]), f"{r['mean_batch']:.1f}", f"{r['requests_per_s']:.2f}"])
    table += "\n\n## Every run\n\n" + common.markdown_table(
        ["block size", "mode", "time to drain (s)", "normalized latency", "preemptions",
         "by swap / by recompute", "tokens recomputed", "blocks out / in", "time copying blocks", "mean batch",
         "requests/s"], lines)
    g = s.engine
    notes = (
        f"Requests: {s.num_requests} {s.trace}-like (`paxkv/sim/workloads.py`, seed {s.seed}), clipped to "
        f"{s.max_prompt_len} / {s.max_output_len} tokens, random token ids, greedy with EOS ignored, all queued at "
        f"once. {serving.engine_note(g, 'at every block size')}, "
        f"host swap space {s.swap_space_gib:g} GiB (a swap falls back to recompute when it is full: the \"by swap / "
        "by recompute\" column), prefix caching off. \"tokens recomputed\" = prefill tokens beyond the prompts; "
        "\"time copying blocks\" = time in the runner's swap-out and swap-in copies (timed until each has landed). "
        "Each point is the second of two identical runs (the first compiles every shape, the swap copies' too)."
        + serving.skipped_note(skipped))
    return table, notes


def write(s: configs.PreemptionSettings, rows: list[dict[str, Any]], skipped: list[str], final: bool = True) -> None:
    table, notes = _tables(rows, s, skipped)
    trace = serving.settings_trace(s, s.trace, s.num_requests)
    serving.write_serving_results(
        NAME, s,
        title="Preemption: recomputation against swapping (paper Fig. 19)",
        results={"runs": rows, **serving.completion_fields(skipped, final), "trace": workloads.summarize(trace),
                 "recompute_over_swap": {bs: rc["wall_s"] / sw["wall_s"] for bs, rc, sw in pairs(rows)},
                 "paper": {"recompute_max_overhead_vs_swap": common.PAPER["recompute_max_overhead_vs_swap"]}},
        table=table, notes=notes, figure=_fig(rows, s), quiet=not final)


def main(argv: list[str]) -> None:
    del argv
    s = serving.settings_from_flags(NAME)
    if FLAGS.block_sizes:
        s = dataclasses.replace(s, block_sizes=tuple(int(b) for b in FLAGS.block_sizes))
    serving.run_resumable(NAME, s, point_key, ("block_sizes",), sweep, write)


if __name__ == "__main__":
    app.run(main)

"""Normalized latency against request rate: continuous batching with paging against static
batching (the paper's Fig. 12: vLLM sustains 2-4x the request rate of Orca / FasterTransformer).

Requests of an Alpaca-like trace arrive as a Poisson process. The engine is driven in real
time: a request is submitted once the clock passes its arrival, the engine steps while it
has work and sleeps otherwise. The figure of merit is the paper's normalized latency: the
mean over requests of (finish - arrival) / output tokens, in seconds per token. Two engines
with the same weights and the same KV pool: paged continuous batching (the engine's default)
and the static policy (a batch is admitted together, each request reserving `max_model_len`
slots, and nothing joins until the whole batch is done). The sustained rate of a policy is
where its normalized latency crosses a threshold (a multiple of the unloaded latency).

    PYTHONPATH=. python3 experiments/throughput_vs_rate.py                 # tiny model, CPU
    PYTHONPATH=. python3 experiments/throughput_vs_rate.py --setting=gpu   # Llama-3-8B shapes
"""
from __future__ import annotations

import dataclasses
from typing import Any

from absl import app, flags

from configs import experiments as configs
from experiments import common, load_sweep, serving
from paxkv.sim import workloads

FLAGS = flags.FLAGS
common.define_serving_flags()
flags.adopt_module_key_flags(common)   # its flags in --help too
flags.DEFINE_list("rates", None, "Override the request rates (requests/s).")

NAME = "throughput_vs_rate"
LABELS = {"continuous": "paged, continuous batching (vLLM)",
          "static": "static batching, reserve max_model_len (FasterTransformer-like)"}


def rate_trace(s: configs.ThroughputVsRateSettings, rate: float) -> list[workloads.Request]:
    n = max(s.min_requests, int(round(rate * s.window_s)))
    trace = workloads.make_trace(s.trace, n, s.seed, rate=rate)
    return serving.clip_trace(trace, s.max_prompt_len, s.max_output_len)


def static_capacity(g: configs.EngineGeometry) -> int:
    return load_sweep.static_capacity(g)


def sweep(s: configs.ThroughputVsRateSettings, log: serving.SweepLog | None = None,
          progress: bool = True) -> tuple[list[dict[str, Any]], list[str], dict]:
    """Every (policy, rate) point not in `log` yet, rates rising, while the budget lasts."""
    log = log or serving.SweepLog(load_sweep.point_key)
    budget = serving.Budget(s.time_budget_s)
    if not budget.allows(0.0, "everything (no time left)"):
        return log.rows, budget.skipped, {}
    load = load_sweep.Load(rates=s.rates, trace=lambda rate: rate_trace(s, rate), work=serving.trace_work,
                           warmup=load_sweep.warmup_requests(s))
    warm = load_sweep.sweep(name=NAME, loads={"": load}, policies=s.policies,
                            make_llm=lambda p: serving.make_llm(s.engine, scheduler=p), drain_s=s.drain_s,
                            seed=s.seed, budget=budget, log=log, progress=progress)
    return log.rows, budget.skipped, warm


def analyse(rows: list[dict[str, Any]], s: configs.ThroughputVsRateSettings) -> dict[str, Any]:
    """Sustained rates at every latency threshold, peak throughput, and their ratios."""
    # The latency threshold alone, as when its committed figures were made (results/README.md
    # discusses the cut-off runs it lets through).
    return load_sweep.analyse(rows, s.policies, s.latency_threshold_factors, cut_off_fails=False)


def _fig(rows: list[dict[str, Any]], an: dict[str, Any], s: configs.ThroughputVsRateSettings):
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for p in s.policies:
        rs = sorted((r for r in rows if r["policy"] == p), key=lambda r: r["rate"])
        if not rs:
            continue
        x = [r["rate"] for r in rs]
        line, = ax.plot(x, [r["mean_normalized_latency_s"] for r in rs], "o-", label=LABELS[p])
        cut = [r for r in rs if r["cut_off"]]
        if cut:
            ax.plot([r["rate"] for r in cut], [r["mean_normalized_latency_s"] for r in cut], "x",
                    color=line.get_color(), ms=10, label=f"{p}: cut off (lower bound)")
        ax2.plot(x, [r["requests_per_s"] for r in rs], "o-", color=line.get_color(), label=LABELS[p])
        for th in an["thresholds"]:
            sr = th["policies"].get(p, {})
            if sr.get("sustained_how") == "crossing":
                ax.axvline(sr["sustained_rate"], color=line.get_color(), ls=":", lw=1)
    for th, ls in zip(an["thresholds"], ("--", "-.", ":")):
        ax.axhline(th["threshold_s"], color="grey", ls=ls, lw=1, label=f"threshold: {th['factor']:g}x unloaded")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"{s.trace}-like trace: latency against load")
    ax.legend(fontsize=7)
    top = max(s.rates)
    ax2.plot([0, top], [0, top], color="grey", ls=":", lw=1, label="served = offered")
    ax2.set_xlabel("request rate (requests/s)")
    ax2.set_ylabel("finished requests/s")
    ax2.set_title("Throughput achieved")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _tables(rows: list[dict[str, Any]], an: dict[str, Any], s: configs.ThroughputVsRateSettings,
            skipped: list[str], warm: dict) -> tuple[str, str]:
    paper_lo, paper_hi = common.PAPER["throughput_gain_vs_orca_ft"]
    head = []
    for p in s.policies:
        if p not in an["policies"]:
            continue
        cells = [LABELS[p]]
        for th in an["thresholds"]:
            a = th["policies"][p]
            cells.append(load_sweep.rate_text(a["sustained_rate"], a["sustained_how"]))
        head.append(cells + [f"{an['policies'][p]['peak_requests_per_s']:.1f}/s"])
    if "peak_throughput_ratio" in an:
        cells = [f"ratio continuous / static (paper: {paper_lo:g}-{paper_hi:g}x)"]
        for th in an["thresholds"]:
            cells.append(load_sweep.ratio_text(th))
        head.append(cells + [f"{an['peak_throughput_ratio']:.1f}x"])
    cols = ["policy"] + [f"sustained rate: latency < {th['factor']:g}x unloaded "
                         f"({th['threshold_s'] * 1e3:.1f} ms/token)" for th in an["thresholds"]]
    cols.append("peak finished requests/s")
    table = "## Against the paper (Fig. 12)\n\n" + common.markdown_table(cols, head)
    table += "\n\n## Every rate\n\n" + load_sweep.rate_table(rows, [""], s.policies)
    g = s.engine
    notes = (
        f"Trace: {s.trace}-like requests (`paxkv/sim/workloads.py`), prompts clipped to {s.max_prompt_len} and "
        f"outputs to {s.max_output_len} tokens, random token ids, greedy with EOS ignored so every request "
        f"generates exactly its length; Poisson arrivals over {s.window_s:g} s (at least {s.min_requests} "
        f"requests) per rate. {serving.engine_note(g, f'in blocks of {g.block_size}')}, so the static policy runs at most {static_capacity(g)} requests "
        "at a time. "
        "Normalized latency = mean over requests of (finish - arrival) / output tokens. A run is cut off "
        f"{s.drain_s:g} s after its last arrival; its unfinished requests count with the cut-off as their finish, "
        "so a cut-off point is a lower bound; the sustained rate is where the latency curve crosses a threshold, "
        "interpolated linearly between measured rates. Compilation is excluded: a warm-up run of the busiest trace's "
        f"first {s.warmup_requests} requests ({2 * static_capacity(g)} for the static policy), queued at once, "
        "compiles first, and any step that compiles later pauses the clock (warm-up compiles: "
        + ", ".join(f"{p} {w['compiles']} in {w['compile_s']:.1f} s" for p, w in warm.items()) + ")."
        + serving.skipped_note(skipped))
    return table, notes


def main(argv: list[str]) -> None:
    del argv
    s = serving.settings_from_flags(NAME)
    if FLAGS.rates:
        s = dataclasses.replace(s, rates=tuple(float(r) for r in FLAGS.rates))
    rows, skipped, warm = sweep(s)
    an = analyse(rows, s)
    table, notes = _tables(rows, an, s, skipped, warm)
    serving.write_serving_results(
        NAME, s,
        title="Throughput against request rate: continuous paged against static batching (paper Fig. 12)",
        results={"runs": [{k: v for k, v in r.items()} for r in rows], "analysis": an, "skipped": skipped,
                 "warm_up": warm, "paper": {"throughput_gain_vs_orca_ft": common.PAPER["throughput_gain_vs_orca_ft"]}},
        table=table, notes=notes, figure=_fig(rows, an, s))


if __name__ == "__main__":
    app.run(main)

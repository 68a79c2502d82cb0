"""How much of the reserved KV memory holds real token states (the paper's Fig. 2).

Runs ShareGPT-like and Alpaca-like traces through the engine's host side (the real scheduler
and block manager, dummy tokens, no model: `paxkv.sim.simulate`) under each memory policy, and
measures, at every step, the share of the KV slots held by running requests that store a
token's K/V. Paged at block sizes 8-256 (vLLM) against reservation to `max_model_len`, to
the next power of two of the final length, and to the final length itself (the paper's
Orca Max / Pow2 / Oracle), and the engine's static request-level batching.

    PYTHONPATH=. python3 experiments/kv_utilization.py
    PYTHONPATH=. python3 experiments/kv_utilization.py --setting=tiny --out_dir=DIR
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from absl import app, flags
from tqdm import tqdm

from configs import experiments as configs
from experiments import common
from paxkv.sim import workloads
from paxkv.sim.simulate import simulate

FLAGS = flags.FLAGS
flags.DEFINE_enum("setting", "cpu", ["cpu", "tiny"], "Which settings of configs/experiments.py to use.")
flags.DEFINE_string("out_dir", "scratch/results", "Where to write kv_utilization.json/.png/.md (--out_dir=results updates the committed results)")
flags.DEFINE_integer("num_requests", None, "Override the number of requests of every trace.")
flags.DEFINE_integer("seed", None, "Override the trace seed.")
flags.DEFINE_integer("pool_tokens", None, "Override the KV pool size (token slots).")

NAME = "kv_utilization"

# Display names: the paper's labels for the baselines.
LABELS = {
    "reserve-max": "Orca (Max): reserve max_model_len",
    "reserve-pow2": "Orca (Pow2): reserve next power of 2",
    "reserve-oracle": "Orca (Oracle): reserve final length",
    "static": "static batching, reserve max_model_len",
    "paged": "paged (vLLM)",
}


def run_all(s: configs.KVUtilizationSettings, progress: bool = True) -> list[dict[str, Any]]:
    """Every (trace, policy, block size) run of the settings, as summary dicts."""
    runs = []
    for trace, _ in s.traces:
        for pol in s.static_policies:
            runs.append((trace, f"reserve-{pol}", 1))
        runs.append((trace, "static", s.headline_block_size))
        for bs in s.block_sizes:
            runs.append((trace, "paged", bs))
    out = []
    traces = {t: workloads.make_trace(t, n, s.seed) for t, n in s.traces}
    for trace, policy, bs in tqdm(runs, desc="kv_utilization", disable=not progress):
        res = simulate(traces[trace], policy=policy, block_size=bs, pool_tokens=s.pool_tokens,
                       max_model_len=s.max_model_len, max_num_seqs=s.max_num_seqs,
                       max_num_batched_tokens=s.max_num_batched_tokens, seed=s.seed,
                       record_series=(policy != "paged" or bs == s.headline_block_size))
        row = {"trace": trace, **res.summary()}
        row["num_requests"] = len(traces[trace])
        if res.series is not None:
            row["series_utilization"] = [st / h if h else None for st, h in
                                         zip(res.series["stored"], res.series["held"])]
        out.append(row)
    return out


def _find(rows: list[dict[str, Any]], trace: str, policy: str, bs: int | None = None) -> dict[str, Any]:
    for r in rows:
        if r["trace"] == trace and r["policy"] == policy and (bs is None or r["block_size"] == bs):
            return r
    raise KeyError((trace, policy, bs))


def _fig(rows: list[dict[str, Any]], s: configs.KVUtilizationSettings):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [3, 2, 3]})
    ax = axes[0]
    policies = [f"reserve-{p}" for p in s.static_policies] + ["static", "paged"]
    x = 0
    ticks, labels = [], []
    for trace, _ in s.traces:
        for pol in policies:
            r = _find(rows, trace, pol, s.headline_block_size if pol == "paged" else None)
            parts = [(r["loaded_utilization"], "#2ca02c", "token states"),
                     (r["loaded_reserved_share"], "#ff7f0e", "reserved for later tokens"),
                     (r["loaded_wasted_share"], "#d62728", "never used")]
            bottom = 0.0
            for v, color, lab in parts:
                ax.bar(x, 100 * v, bottom=100 * bottom, color=color, label=lab if x == 0 else None, zorder=2)
                bottom += v
            ax.text(x, 100 * r["loaded_utilization"] / 2, f"{100 * r['loaded_utilization']:.0f}%",
                    ha="center", fontsize=7)
            ticks.append(x)
            short = {"reserve-max": "Orca\nMax", "reserve-pow2": "Orca\nPow2", "reserve-oracle": "Orca\nOracle",
                     "static": "static\nbatch", "paged": f"paged\n{r['block_size']}"}[pol]
            labels.append(f"{trace}\n{short}")
            x += 1
        x += 0.6
    lo, hi = common.PAPER["kv_utilization"]["existing_systems_range"]
    ax.axhspan(100 * lo, 100 * hi, color="grey", alpha=0.2, label="paper: existing systems", zorder=0)
    ax.axhline(100 * common.PAPER["kv_utilization"]["vllm"], color="black", ls="--", lw=1, label="paper: vLLM",
               zorder=3)
    ax.set_xticks(ticks, labels, fontsize=6.5)
    ax.set_ylabel("% of KV slots held by running requests")
    ax.set_title("Where the held KV memory goes (loaded steps)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    ax = axes[1]
    for trace, _ in s.traces:
        ps = [r for r in rows if r["trace"] == trace and r["policy"] == "paged"]
        ps.sort(key=lambda r: r["block_size"])
        ax.plot([r["block_size"] for r in ps], [100 * r["loaded_utilization"] for r in ps], "o-",
                label=f"paged, {trace}")
        orc = _find(rows, trace, "reserve-oracle")
        ax.axhline(100 * orc["loaded_utilization"], ls=":", color=ax.lines[-1].get_color(),
                   label=f"Orca (Oracle), {trace}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("token states / held slots (%)")
    ax.set_title("Paged: utilization against block size")
    ax.legend(fontsize=7)
    ax = axes[2]
    trace = s.traces[0][0]
    for pol in policies:
        r = _find(rows, trace, pol, s.headline_block_size if pol == "paged" else None)
        ser = r.get("series_utilization")
        if not ser:
            continue
        vals = np.array([np.nan if v is None else 100 * v for v in ser])
        w = max(1, len(vals) // 100)  # moving average over 1% of the run
        smooth = np.convolve(np.nan_to_num(vals), np.ones(w) / w, mode="valid")
        ax.plot(np.linspace(0, 1, len(smooth)), smooth, lw=1.2, label=LABELS[pol])
    ax.set_xlabel(f"fraction of the run ({trace})")
    ax.set_ylabel("token states / held slots (%)")
    ax.set_title("Per step (moving average over 1% of the run)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _loaded_pct(r: dict[str, Any], key: str) -> str:
    """A loaded-steps share, or n/a when the run never saturated the server."""
    return common.pct(r["loaded_" + key]) if r["loaded_steps"] else "n/a (never loaded)"


def _tables(rows: list[dict[str, Any]], s: configs.KVUtilizationSettings) -> tuple[str, str]:
    paper = common.PAPER["kv_utilization"]
    paper_of = {"reserve-max": f"{common.pct(paper['existing_worst_max_reservation'])} (Max)",
                "reserve-pow2": "between (Pow2)",
                "reserve-oracle": f"{common.pct(paper['existing_best_oracle_reservation'])} (Oracle)",
                "static": "-", "paged": f"about {common.pct(paper['vllm'], 0)} (block 16)"}
    head = []
    for trace, _ in s.traces:
        for pol in [f"reserve-{p}" for p in s.static_policies] + ["static", "paged"]:
            r = _find(rows, trace, pol, s.headline_block_size if pol == "paged" else None)
            head.append([trace, LABELS[pol] + (f", block {r['block_size']}" if pol == "paged" else ""),
                         _loaded_pct(r, "utilization"), paper_of[pol],
                         _loaded_pct(r, "reserved_share"), _loaded_pct(r, "wasted_share"),
                         _loaded_pct(r, "pool_share_stored"), common.pct(r["utilization"]),
                         f"{r['loaded_mean_batch_size']:.1f}", f"{r['steps']:,}", r["preemptions"]])
    table = "## Against the paper (Fig. 2)\n\n" + common.markdown_table(
        ["trace", "policy", "token states / held", "paper", "reserved for later", "never used",
         "token states / whole pool", "token states / held, all steps", "mean batch", "steps to finish",
         "preemptions"], head)
    bs_rows = []
    for trace, _ in s.traces:
        for r in sorted((r for r in rows if r["trace"] == trace and r["policy"] == "paged"),
                        key=lambda r: r["block_size"]):
            bs_rows.append([trace, r["block_size"], _loaded_pct(r, "utilization"),
                            _loaded_pct(r, "wasted_share"), _loaded_pct(r, "pool_share_stored"),
                            f"{r['loaded_mean_batch_size']:.1f}", f"{r['steps']:,}", r["preemptions"]])
    table += "\n\n## Paged, by block size\n\n" + common.markdown_table(
        ["trace", "block size", "token states / held", "never used", "token states / whole pool",
         "mean batch", "steps to finish", "preemptions"], bs_rows)
    counts = ", ".join(f"{n} {t}" for t, n in s.traces)
    notes = (
        f"Requests: {counts} (seed {s.seed}), all queued at once; KV pool of "
        f"{s.pool_tokens:,} token slots (about the KV room of OPT-13B on an A100-40GB, the paper's "
        f"setting), max_model_len {s.max_model_len}, at most {s.max_num_seqs} sequences and "
        f"{s.max_num_batched_tokens} tokens per step, recompute preemption, no prefix caching. "
        "\"token states / held\" is the time-weighted share of the slots held by running requests "
        "that store a token's K/V (sum over steps of stored tokens / sum of held slots), over the "
        "loaded steps (some request still waiting, the server saturated); the \"all steps\" column "
        "includes the drain at the end of the trace, and mean batch is over loaded steps; "
        "\"reserved for later\" are held slots the request will fill later, \"never used\" those it "
        "never fills (the tail of its last block, or a reservation past its final length); "
        "\"token states / whole pool\" divides by the whole pool, so free memory counts as lost. "
        "Reservations are token-granular and need not be contiguous: external fragmentation, part of "
        "the paper's waste for Orca, is not modelled, so these baselines are upper bounds. "
        "Steps are engine iterations, not time: a step's duration grows with its batch.")
    return table, notes


def main(argv: list[str]) -> None:
    del argv
    s = configs.get(NAME, FLAGS.setting)
    over = {k: getattr(FLAGS, k) for k in ("seed", "pool_tokens") if getattr(FLAGS, k) is not None}
    if FLAGS.num_requests is not None:
        over["traces"] = tuple((t, FLAGS.num_requests) for t, _ in s.traces)
    s = dataclasses.replace(s, **over)
    rows = run_all(s)
    table, notes = _tables(rows, s)
    fig = _fig(rows, s)
    traces = {t: workloads.summarize(workloads.make_trace(t, n, s.seed)) for t, n in s.traces}
    results = {"runs": [{k: v for k, v in r.items() if k != "series_utilization"} for r in rows],
               "traces": traces, "paper": common.PAPER["kv_utilization"]}
    paths = common.write_results(
        NAME, FLAGS.out_dir, title="KV cache utilization: paged against reservation (paper Fig. 2)",
        command=common.command_line(), hardware=common.host_hardware("scheduler and block manager simulated"),
        settings=dataclasses.asdict(s), results=results, table=table, notes=notes, figure=fig)
    print(table)
    print("wrote", ", ".join(paths.values()))


if __name__ == "__main__":
    app.run(main)

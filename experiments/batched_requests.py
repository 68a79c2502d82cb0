"""Single-sequence serving of ShareGPT-like and Alpaca-like traces: normalized latency against
request rate, and how many requests run together (the paper's Fig. 13: at 2 requests/s of
ShareGPT, vLLM batches 2.2x the requests of Orca (Oracle) and 4.3x those of Orca (Max); the
latency curves are Fig. 12's two traces).

Each trace arrives as a Poisson process at a range of rates and is served in real time by
paged continuous batching and by the static request-level policy (each request reserving
`max_model_len` slots), with the same weights and the same KV pool. The mean batch of a run
(sequences per step, averaged over its steps) is the paper's "average number of batched
requests"; the bars are drawn at one rate per trace.

    PYTHONPATH=. python3 experiments/batched_requests.py                 # tiny model, CPU
    PYTHONPATH=. python3 experiments/batched_requests.py --setting=gpu   # Llama-3-8B shapes
"""
from __future__ import annotations

from typing import Any

from absl import app, flags

from configs import experiments as configs
from experiments import common, load_sweep, serving
from paxkv.sim import workloads

FLAGS = flags.FLAGS
common.define_serving_flags()
flags.adopt_module_key_flags(common)   # its flags in --help too

NAME = "batched_requests"
LABELS = {"continuous": "paged, continuous batching (vLLM)",
          "static": "static batching, reserve max_model_len"}


def trace_at(load: configs.TraceLoad, s: configs.BatchedRequestsSettings, rate: float) -> list[workloads.Request]:
    n = load_sweep.num_requests(rate, s.window_s, s.min_requests)
    trace = workloads.make_trace(load.trace, n, s.seed, rate=rate)
    return serving.clip_trace(trace, load.max_prompt_len, load.max_output_len)


def loads(s: configs.BatchedRequestsSettings) -> dict[str, load_sweep.Load]:
    warmup = load_sweep.warmup_requests(s)
    return {ld.trace: load_sweep.Load(rates=ld.rates, trace=lambda rate, ld=ld: trace_at(ld, s, rate),
                                      work=serving.trace_work, warmup=warmup)
            for ld in s.loads}


def bars(rows: list[dict[str, Any]], s: configs.BatchedRequestsSettings) -> dict[str, dict[str, float]]:
    """Mean batch of each policy at each trace's bar rate (the points that ran)."""
    out: dict[str, dict[str, float]] = {}
    for ld in s.loads:
        for r in rows:
            if r["group"] == ld.trace and r["rate"] == ld.bar_rate:
                out.setdefault(ld.trace, {})[r["policy"]] = r["mean_batch"]
    return out


def _draw_bars(b: dict[str, dict[str, float]], s: configs.BatchedRequestsSettings):
    def draw(ax) -> None:
        rates = {ld.trace: ld.bar_rate for ld in s.loads}
        traces = [t for t in rates if t in b]
        width = 0.8 / max(1, len(s.policies))
        for i, p in enumerate(s.policies):
            xs = [j + i * width for j in range(len(traces))]
            ys = [b[t].get(p, 0.0) for t in traces]
            ax.bar(xs, ys, width, label=LABELS[p])
            for x, y in zip(xs, ys):
                ax.text(x, y, f"{y:.1f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks([j + width * (len(s.policies) - 1) / 2 for j in range(len(traces))])
        ax.set_xticklabels([f"{t}-like @ {rates[t]:g}/s" for t in traces])
        ax.set_ylabel("mean batched requests (sequences per step)")
        ax.set_title("Batched requests (paper Fig. 13)", fontsize=10)
        ax.legend(fontsize=7)
    return draw


def write(s: configs.BatchedRequestsSettings, rows: list[dict[str, Any]], skipped: list[str], warm: dict,
          final: bool = True) -> None:
    groups = [ld.trace for ld in s.loads]
    an = {g: load_sweep.analyse([r for r in rows if r["group"] == g], s.policies, s.latency_threshold_factors)
          for g in groups if any(r["group"] == g for r in rows)}
    b = bars(rows, s)
    paper = common.PAPER["batched_requests"]
    head = []
    for ld in s.loads:
        got = b.get(ld.trace, {})
        ratio = (f"{got['continuous'] / got['static']:.1f}x" if got.get("static") and "continuous" in got
                 else "not run")
        cells = [f"{ld.trace}-like @ {ld.bar_rate:g}/s",
                 f"{got['continuous']:.1f}" if "continuous" in got else "not run",
                 f"{got['static']:.1f}" if "static" in got else "not run", ratio]
        if ld.trace == "sharegpt":
            cells.append(f"{paper['sharegpt_vs_orca_oracle']:g}x Orca (Oracle), {paper['sharegpt_vs_orca_max']:g}x "
                         f"Orca (Max), at {paper['sharegpt_rate']:g}/s (OPT-13B)")
        else:
            cells.append(f"bars drawn at {paper['alpaca_rate']:g}/s (OPT-13B)")
        head.append(cells)
    table = "## Against the paper (Fig. 13): requests batched together\n\n" + common.markdown_table(
        ["trace @ rate", "continuous: mean batch", "static: mean batch", "continuous / static", "paper"], head)
    table += ("\n\n## Sustained rates (Fig. 12's curves for these traces)\n\n"
              + load_sweep.sustained_table(an, s.policies, s.latency_threshold_factors, "continuous", "static"))
    table += "\n\n## Every rate\n\n" + load_sweep.rate_table(rows, groups, s.policies)
    g = s.engine
    clips = "; ".join(f"{ld.trace}-like clipped to {ld.max_prompt_len} / {ld.max_output_len} tokens at "
                      f"{', '.join(f'{r:g}' for r in ld.rates)} requests/s" for ld in s.loads)
    notes = (
        f"Traces (`paxkv/sim/workloads.py`, seed {s.seed}): {clips}; random token ids, greedy with EOS ignored so every "
        f"request generates exactly its length; Poisson arrivals over {s.window_s:g} s (at least {s.min_requests} "
        f"requests) per rate. {serving.engine_note(g, f'in blocks of {g.block_size}')}, so the static policy runs at "
        f"most {load_sweep.static_capacity(g)} requests at a time. Mean batch = sequences per engine step, averaged "
        "over the run's steps. Normalized latency = mean over requests of (finish - arrival) / output tokens; a run is "
        f"cut off {s.drain_s:g} s after its last arrival (its unfinished requests count with the cut-off as their "
        "finish: a lower bound). Compilation is excluded (a warm-up run per trace and policy, and any later compile "
        "pauses the clock). " + load_sweep.warm_note(warm) + serving.skipped_note(skipped))
    fig = load_sweep.figure(rows, groups, s.policies, LABELS, an,
                            titles={t: f"{t}-like trace" for t in groups},
                            suptitle="Single-sequence serving: latency against load (paper Figs. 12-13)",
                            extras=[_draw_bars(b, s)])
    serving.write_serving_results(
        NAME, s, title="Single-sequence serving: batched requests and latency against rate (paper Fig. 13)",
        results={"runs": rows, "analysis": an, "batched_requests": b,
                 **serving.completion_fields(skipped, final), "warm_up": warm, "paper": paper},
        table=table, notes=notes, figure=fig, quiet=not final)


def main(argv: list[str]) -> None:
    del argv
    s = serving.settings_from_flags(NAME)
    load_sweep.run(NAME, s, loads(s), s.policies, lambda p: serving.make_llm(s.engine, scheduler=p),
                   point_fields=("loads.rates",), write=lambda *a, **k: write(s, *a, **k))


if __name__ == "__main__":
    app.run(main)

"""Memory saved by sharing KV blocks between the sequences of one request, and the throughput
it buys (the paper's Fig. 15: on Alpaca, 6.1-9.8% for parallel sampling and 37.6-55.2% for
beam search).

Parallel sampling (`SamplingParams(n=...)`) forks the prefilled prompt into n samples that
share its blocks; beam search forks beams that share every block of their common prefix,
copy-on-write. At every engine step we count the physical blocks the pool holds and the
blocks the running sequences' block tables point to (what they would hold with nothing
shared); the saving is 1 - physical / logical, time-weighted over the steps.

The throughput sharing buys is measured in the same fixed pool against the same work done
without sharing: n independent requests with the same prompt and their own seeds instead of
n samples, and W independent greedy requests (with the same top-2W log-probabilities a beam
step computes) instead of a W-beam search. Prefix caching is off, so nothing is shared there.

    PYTHONPATH=. python3 experiments/sharing_savings.py                 # tiny model, CPU
    PYTHONPATH=. python3 experiments/sharing_savings.py --setting=gpu   # Llama-3-8B shapes
"""
from __future__ import annotations

import gc
from typing import Any, Callable

from absl import app, flags
from tqdm import tqdm

from configs import experiments as configs
from experiments import common, serving
from paxkv.sim import workloads
from paxkv.sampling_params import BeamSearchParams, SamplingParams

FLAGS = flags.FLAGS
common.define_serving_flags()
flags.adopt_module_key_flags(common)   # its flags in --help too

NAME = "sharing_savings"


def work_maker(kind: str, width: int, shared: bool, trace: list[workloads.Request], vocab: int,
               s: configs.SharingSettings) -> Callable[[int], list[serving.Work]]:
    """`seed -> work`: the trace's requests as `width` samples or beams, shared or not."""

    def make(seed: int) -> list[serving.Work]:
        prompts = serving.random_prompts([r.prompt_len for r in trace], vocab, seed)
        out = []
        for i, (p, r) in enumerate(zip(prompts, trace)):
            base = (seed * 1_000_003 + i * 7919) % (2**31 - 1)
            if kind == "parallel" and shared:
                sp = SamplingParams(n=width, temperature=s.temperature, seed=base, ignore_eos=True,
                                    max_tokens=r.output_len)
                out.append(serving.Work(p, sp, r.output_len, num_seqs=width))
            elif kind == "parallel":
                for j in range(width):
                    sp = SamplingParams(temperature=s.temperature, seed=(base + j * 104729) % (2**31 - 1),
                                        ignore_eos=True, max_tokens=r.output_len)
                    out.append(serving.Work(list(p), sp, r.output_len))
            elif shared:
                bp = BeamSearchParams(beam_width=width, max_tokens=r.output_len, ignore_eos=True)
                out.append(serving.Work(p, bp, r.output_len, num_seqs=width))
            else:
                for _ in range(width):
                    out.append(serving.Work(list(p), serving.greedy_params(r.output_len, logprobs=2 * width),
                                            r.output_len))
        return out

    return make


def point_key(row: dict[str, Any]) -> tuple:
    return row["kind"], row["width"]


def sweep(s: configs.SharingSettings, log: serving.SweepLog | None = None,
          progress: bool = True) -> tuple[list[dict[str, Any]], list[str]]:
    """Every (kind, width) point not in `log` yet, in priority order while the budget lasts;
    returns all of `log`'s points and the skipped ones."""
    log = log or serving.SweepLog(point_key)
    budget = serving.Budget(s.time_budget_s)
    configs_ = [("parallel", n) for n in s.parallel_n] + [("beam", w) for w in s.beam_widths]
    # Interleave so a short budget still covers both kinds: n=a, beam a, n=b, beam b, ...
    order = sorted(configs_, key=lambda c: (sorted({w for _, w in configs_}).index(c[1]), c[0] != "parallel"))
    order = [c for c in order if not log.done(*c)]
    if not order or not budget.allows(0.0, "everything (no time left)"):
        return log.rows, budget.skipped
    trace = serving.settings_trace(s, s.trace, s.num_requests)
    llm = serving.make_llm(s.engine)
    vocab = llm.config.model.vocab_size
    for kind, width in budget.points(tqdm(order, desc=NAME, disable=not progress), lambda c: f"{c[0]} {c[1]}"):
        row: dict[str, Any] = {"kind": kind, "width": width, "num_requests": len(trace)}
        for shared in (True, False):
            llm.metrics.reset()
            st = serving.run_offline_twice(llm, work_maker(kind, width, shared, trace, vocab, s), s.seed)
            summ = st.summary()
            tag = "shared" if shared else "unshared"
            row[tag] = summ
            row[f"{tag}_requests_per_s"] = len(trace) / st.wall_s if st.wall_s else 0.0
            row[f"{tag}_metrics_sharing_saving"] = llm.metrics.summary()["sharing_saving"]
        row["saving"] = row["shared"]["sharing_saving"]
        row["throughput_gain"] = (row["shared_requests_per_s"] / row["unshared_requests_per_s"]
                                  if row["unshared_requests_per_s"] else float("nan"))
        log.add(row)
        gc.collect()
    return log.rows, budget.skipped


def _fig(rows: list[dict[str, Any]]):
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.3))
    paper = common.PAPER["sharing_savings"]
    for kind, key, color in (("parallel", "parallel_sampling", "#1f77b4"), ("beam", "beam_search", "#d62728")):
        rs = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["width"])
        if not rs:
            continue
        x = [r["width"] for r in rs]
        label = "parallel sampling (n)" if kind == "parallel" else "beam search (width)"
        ax.plot(x, [100 * r["saving"] for r in rs], "o-", color=color, label=f"paxkv: {label}")
        lo, hi = paper[key]
        ax.axhspan(100 * lo, 100 * hi, color=color, alpha=0.12, label=f"paper (Alpaca): {label}")
        ax2.plot(x, [r["throughput_gain"] for r in rs], "o-", color=color, label=label)
    ax.set_xlabel("n / beam width")
    ax.set_ylabel("KV blocks saved by sharing (%)")
    ax.set_title("Memory saving")
    ax.legend(fontsize=7)
    ax2.axhline(1.0, color="grey", ls=":", lw=1)
    ax2.set_xlabel("n / beam width")
    ax2.set_ylabel("requests/s, shared / unshared")
    ax2.set_title("Throughput sharing buys in a fixed pool")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _tables(rows: list[dict[str, Any]], s: configs.SharingSettings, skipped: list[str]) -> tuple[str, str]:
    paper = common.PAPER["sharing_savings"]
    head = []
    for kind, key, label in (("parallel", "parallel_sampling", "parallel sampling"),
                             ("beam", "beam_search", "beam search")):
        rs = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["width"])
        if not rs:
            continue
        lo, hi = paper[key]
        widths = ", ".join(str(r["width"]) for r in rs)
        savings = ", ".join(common.pct(r["saving"]) for r in rs)
        gains = ", ".join(f"{r['throughput_gain']:.2f}x" for r in rs)
        head.append([label, widths, f"{common.pct(lo)}-{common.pct(hi)}", savings, gains])
    table = "## Against the paper (Fig. 15, Alpaca)\n\n" + common.markdown_table(
        ["sharing", "n / width", "paper: memory saving", "paxkv: memory saving", "paxkv: throughput gain"], head)
    lines = []
    for r in sorted(rows, key=lambda r: (r["kind"] != "parallel", r["width"])):
        sh, un = r["shared"], r["unshared"]
        lines.append([r["kind"], r["width"], common.pct(r["saving"]), common.pct(r["shared_metrics_sharing_saving"]),
                      common.pct(un["sharing_saving"]), f"{r['shared_requests_per_s']:.2f}",
                      f"{r['unshared_requests_per_s']:.2f}", f"{r['throughput_gain']:.2f}x",
                      f"{sh['mean_batch']:.1f} / {un['mean_batch']:.1f}",
                      f"{sh['preemptions']} / {un['preemptions']}"])
    table += "\n\n## Every run\n\n" + common.markdown_table(
        ["kind", "n / width", "saving (block tables)", "saving (engine metrics)", "saving, unshared run",
         "requests/s shared", "requests/s unshared", "gain", "mean batch shared / unshared",
         "preemptions shared / unshared"], lines)
    g = s.engine
    notes = (
        f"Requests: {s.num_requests} {s.trace}-like prompts (`paxkv/sim/workloads.py`, seed {s.seed}), clipped to "
        f"{s.max_prompt_len} / {s.max_output_len} tokens, random token ids, EOS ignored, all queued at once; every "
        f"sample and beam generates the trace's output length. Parallel samples use temperature {s.temperature:g} "
        f"with per-sample seeds. {serving.engine_note(g, f'in blocks of {g.block_size}')}, "
        "prefix caching off. \"saving (block tables)\" = 1 - (physical blocks held) / (blocks "
        "the running sequences' block tables point to), summed over steps; the unshared runs read 0% by "
        "construction, a check of the measure. \"saving (engine metrics)\" is `Metrics.summary()['sharing_saving']`, "
        "which counts a sequence's logical blocks from all its tokens, including the sampled token whose K/V is not "
        "written yet, so it reads a little higher. Requests/s count the trace's requests in both runs (an unshared "
        "run serves each as n or W separate requests); each figure is the second of two identical runs (the first "
        "compiles)."
        + serving.skipped_note(skipped))
    return table, notes


def write(s: configs.SharingSettings, rows: list[dict[str, Any]], skipped: list[str], final: bool = True) -> None:
    table, notes = _tables(rows, s, skipped)
    trace = serving.settings_trace(s, s.trace, s.num_requests)
    serving.write_serving_results(
        NAME, s,
        title="Sharing KV blocks: parallel sampling and beam search (paper Fig. 15)",
        results={"runs": rows, **serving.completion_fields(skipped, final), "trace": workloads.summarize(trace),
                 "paper": common.PAPER["sharing_savings"]},
        table=table, notes=notes, figure=_fig(rows), quiet=not final)


def main(argv: list[str]) -> None:
    del argv
    s = serving.settings_from_flags(NAME)
    serving.run_resumable(NAME, s, point_key, ("parallel_n", "beam_widths"), sweep, write)


if __name__ == "__main__":
    app.run(main)

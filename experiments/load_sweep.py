"""Harness for the latency-against-load figures (the paper's Figs. 12, 13, 14, 16 and 17).

Each of those figures is a family of curves: for every group of requests (a trace, a number
of parallel samples, a shared prefix...) and every engine policy (continuous batching with
paging, the static request-level baseline, prefix caching on or off), requests arrive as a
Poisson process at a range of rates and the engine serves them in real time
(`serving.run(realtime=True)`). The figure of merit is the paper's normalized latency: the
mean over requests of (finish - arrival) / output tokens, in seconds per token. A policy
sustains a rate while that stays under a multiple of the unloaded latency of the group's
first policy (its latency at the lowest rate).

`sweep` runs the (group, policy, rate) points not yet in a `serving.SweepLog`, so a sweep cut
short by its time budget resumes where it stopped; `analyse` finds sustained rates and
their ratios; `figure` and `rate_table` draw and tabulate the curves.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

from tqdm import tqdm

from configs import experiments as configs
from experiments import common, serving
from paxkv.sim.workloads import Request


def static_capacity(g: configs.EngineGeometry) -> int:
    """Requests the static policy runs at once: each reserves max_model_len slots."""
    return min(g.max_num_seqs, g.pool_tokens // g.max_model_len)


def warmup_requests(s: Any) -> Callable[[str], int]:
    """`Load.warmup` from the settings: `s.warmup_requests` for every policy but the static one,
    which warms up on two batches at most (a static batch lasts as long as its longest request)."""
    cap = static_capacity(s.engine)
    return lambda policy: s.warmup_requests if policy != "static" else min(s.warmup_requests, 2 * cap)


def num_requests(rate: float, window_s: float, min_requests: int) -> int:
    """Requests of a point: `window_s` seconds of arrivals, at least `min_requests`."""
    return max(min_requests, int(round(rate * window_s)))


def sustained_rate(rates: list[float], latency: list[float], threshold: float,
                   cut_off: list[bool] | None = None) -> tuple[float, str]:
    """The rate where latency first crosses `threshold` (linear between measured rates).

    Returns (rate, how): how is "crossing", ">=" (never crossed: at least the highest rate)
    or "<" (crossed already at the lowest rate: below it). With `cut_off`, a run that did not
    finish its requests before the cut-off fails at its rate whatever its latency (which is
    only a lower bound, so no crossing is interpolated to it): the sustained rate is then the
    measured rate below it, how "cut".
    """
    for i, (r, y) in enumerate(zip(rates, latency)):
        if cut_off is not None and cut_off[i]:
            return (r, "<") if i == 0 else (rates[i - 1], "cut")
        if y > threshold:
            if i == 0:
                return r, "<"
            r0, y0 = rates[i - 1], latency[i - 1]
            return r0 + (threshold - y0) * (r - r0) / (y - y0), "crossing"
    return (rates[-1] if rates else math.nan), ">="


# How sure a ratio of two sustained rates is, from how each was found ("cut" counts as a
# crossing: the rate is bracketed by two measured rates either way).
_RATIO_HOW = {("crossing", "crossing"): "=", (">=", "crossing"): ">=", ("crossing", "<"): ">", (">=", "<"): ">"}


def _ratio_how(a: str, b: str) -> str:
    return _RATIO_HOW.get((a.replace("cut", "crossing"), b.replace("cut", "crossing")), "~")
RATIO_WORDS = {"=": "", ">=": "at least ", ">": "more than ", "~": "about "}


def analyse(rows: Sequence[dict[str, Any]], policies: Sequence[str], factors: Sequence[float],
            base: str = "continuous", reference: str = "static", cut_off_fails: bool = True) -> dict[str, Any]:
    """Sustained rates of every policy at every threshold, peak throughput, and the ratios
    `base` / `reference` (e.g. continuous over static), for the rows of one group.

    `cut_off_fails`: a run cut off before it finished does not sustain its rate, whatever its
    (lower-bound) latency; without it only the latency threshold counts.
    """
    by = {p: sorted((r for r in rows if r["policy"] == p), key=lambda r: r["rate"]) for p in policies}
    first = by.get(base) or next((rs for rs in by.values() if rs), [])
    unloaded = first[0]["mean_normalized_latency_s"] if first else math.nan
    out: dict[str, Any] = {"unloaded_normalized_latency_s": unloaded, "thresholds": [], "policies": {}}
    for p, rs in by.items():
        if rs:
            out["policies"][p] = {"peak_requests_per_s": max(r["requests_per_s"] for r in rs)}
    for factor in factors:
        th: dict[str, Any] = {"factor": factor, "threshold_s": factor * unloaded, "policies": {}}
        for p, rs in by.items():
            if not rs:
                continue
            rate, how = sustained_rate([r["rate"] for r in rs], [r["mean_normalized_latency_s"] for r in rs],
                                       factor * unloaded, [r["cut_off"] for r in rs] if cut_off_fails else None)
            th["policies"][p] = {"sustained_rate": rate, "sustained_how": how}
        if {base, reference} <= th["policies"].keys():
            c, st = th["policies"][base], th["policies"][reference]
            th["ratio"] = c["sustained_rate"] / st["sustained_rate"] if st["sustained_rate"] else math.nan
            th["ratio_how"] = _ratio_how(c["sustained_how"], st["sustained_how"])
        out["thresholds"].append(th)
    if {base, reference} <= out["policies"].keys():
        c, st = out["policies"][base], out["policies"][reference]
        out["peak_throughput_ratio"] = (c["peak_requests_per_s"] / st["peak_requests_per_s"]
                                        if st["peak_requests_per_s"] else math.nan)
    return out


def ratio_text(th: dict[str, Any]) -> str:
    """A threshold's ratio as text: "2.1x", "at least 3.2x", "n/a"."""
    ratio = th.get("ratio", math.nan)
    if not math.isfinite(ratio):
        return "n/a"
    return f"{RATIO_WORDS[th.get('ratio_how', '~')]}{ratio:.1f}x"


def rate_text(x: float, how: str) -> str:
    """A sustained rate as text: "12.3/s", ">= 32/s (never crossed)", "< 1/s"."""
    if not math.isfinite(x):
        return "n/a"
    return {"crossing": f"{x:.1f}/s", ">=": f">= {x:g}/s (never crossed)", "<": f"< {x:g}/s",
            "cut": f"{x:g}/s (the next rate was cut off)"}[how]


def point_key(row: dict[str, Any]) -> tuple:
    return row.get("group", ""), row["policy"], row["rate"]


@dataclasses.dataclass
class Load:
    """What a group's points need: its rates, its trace at a rate, and its work from a trace."""

    rates: Sequence[float]
    trace: Callable[[float], list[Request]]                       # rate -> arrivals and lengths
    work: Callable[[list[Request], int, int], list[serving.Work]]  # (trace, vocab, seed) -> work
    # Requests of the busiest trace, queued at once, that warm a policy up (compile its shapes).
    warmup: Callable[[str], int] = lambda policy: 32


def sweep(*, name: str, loads: dict[str, Load], policies: Sequence[str],
          make_llm: Callable[[str], Any], drain_s: float, seed: int, budget: serving.Budget,
          log: serving.SweepLog, progress: bool = True) -> dict[str, Any]:
    """Run every (group, policy, rate) point not in `log`, groups in order, rates rising.

    An engine per policy is built on first use and kept (the policies share the weights).
    Before its first timed point of a group, a policy serves the first `warmup(policy)`
    requests of the group's busiest trace queued at once, which compiles the shapes the
    points will see (any shape first seen later is compiled with the clock paused). A point
    is cut off `drain_s` after its last arrival. Returns the warm-ups' compile counts.
    """
    llms: dict[str, Any] = {}
    warm: dict[str, Any] = {}
    todo = [(g, p, r) for g, load in loads.items() for r in sorted(load.rates) for p in policies
            if not log.done(g, p, r)]
    bar = tqdm(total=len(todo), desc=name, disable=not progress)
    last_cost = 0.0
    for group, policy, rate in todo:
        load = loads[group]
        trace = load.trace(rate)
        last_arrival = max(r.arrival_time for r in trace)
        cutoff = last_arrival + drain_s
        label = f"{group + ': ' if group else ''}{policy} @ {rate:g}/s"
        if not budget.allows(min(last_cost, cutoff), label):
            bar.update(1)
            continue
        t0 = budget.elapsed()
        if policy not in llms:
            llms[policy] = make_llm(policy)
        llm = llms[policy]
        vocab = llm.config.model.vocab_size
        wkey = f"{group}: {policy}" if group else policy
        if wkey not in warm:
            busiest = load.trace(max(load.rates))[:load.warmup(policy)]
            st = serving.run(llm, load.work(busiest, vocab, seed + 1))
            warm[wkey] = {"compile_s": st.compile_s, "compiles": st.num_compiles}
            t0 = budget.elapsed()        # the point's cost estimate leaves the warm-up out
        work = load.work(trace, vocab, seed + int(rate * 1000))
        st = serving.run(llm, work, realtime=True, cutoff_s=cutoff)
        last_cost = budget.elapsed() - t0
        row = {"group": group, "policy": policy, "rate": rate, "cutoff_s": cutoff,
               "cut_off": st.num_finished < st.num_requests, "offered_span_s": last_arrival,
               "point_s": last_cost, **st.summary()}
        log.add(row)
        bar.update(1)
    bar.close()
    return warm


def figure(rows: Sequence[dict[str, Any]], groups: Sequence[str], policies: Sequence[str],
           labels: dict[str, str], analyses: dict[str, dict[str, Any]], titles: dict[str, str] | None = None,
           suptitle: str = "", paper: dict[str, str] | None = None,
           extras: Sequence[Callable[[Any], None]] = ()):
    """One panel per group: normalized latency against rate, a line per policy (log scale),
    cut-off points marked (lower bounds), thresholds dashed; `paper` adds a caption per panel;
    each of `extras` draws one more panel (it is given the axes)."""
    import matplotlib.pyplot as plt
    panels = len(groups) + len(extras)
    cols = min(3, max(1, panels))
    nrows = math.ceil(panels / cols) if panels else 1
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 4.2 * nrows), squeeze=False)
    colors = {p: c for p, c in zip(policies, ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"))}
    for ax, group in zip(axes.flat, groups):
        rs_g = [r for r in rows if r.get("group", "") == group]
        for p in policies:
            rs = sorted((r for r in rs_g if r["policy"] == p), key=lambda r: r["rate"])
            if not rs:
                continue
            x = [r["rate"] for r in rs]
            ax.plot(x, [r["mean_normalized_latency_s"] for r in rs], "o-", color=colors[p], label=labels.get(p, p))
            cut = [r for r in rs if r["cut_off"]]
            if cut:
                ax.plot([r["rate"] for r in cut], [r["mean_normalized_latency_s"] for r in cut], "x",
                        color=colors[p], ms=10)
        an = analyses.get(group)
        if an:
            for th, ls in zip(an["thresholds"], ("--", "-.", ":")):
                ax.axhline(th["threshold_s"], color="grey", ls=ls, lw=1, label=f"{th['factor']:g}x unloaded")
        ax.set_yscale("log")
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.set_title((titles or {}).get(group, group), fontsize=10)
        if paper and group in paper:
            ax.text(0.02, 0.97, paper[group], transform=ax.transAxes, fontsize=7, va="top", wrap=True)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
    rest = list(axes.flat)[len(groups):]
    for ax, draw in zip(rest, extras):
        draw(ax)
    for ax in rest[len(extras):]:
        ax.set_visible(False)
    if suptitle:
        fig.suptitle(suptitle + " (x: cut off, a lower bound)", fontsize=11)
    fig.tight_layout()
    return fig


def rate_table(rows: Sequence[dict[str, Any]], groups: Sequence[str], policies: Sequence[str]) -> str:
    """Every point: per group and rate, each policy's latency, finished requests/s, mean batch."""
    lines = []
    for group in groups:
        by_rate: dict[float, dict[str, dict[str, Any]]] = {}
        for r in rows:
            if r.get("group", "") == group:
                by_rate.setdefault(r["rate"], {})[r["policy"]] = r
        for rate in sorted(by_rate):
            cells = ([group] if any(groups) else []) + [f"{rate:g}"]
            for p in policies:
                r = by_rate[rate].get(p)
                if r is None:
                    cells += ["not run", "", ""]
                    continue
                lat = serving.fmt_s(r["mean_normalized_latency_s"]) + (" (cut off)" if r["cut_off"] else "")
                cells += [lat, f"{r['requests_per_s']:.1f}", f"{r['mean_batch']:.1f}"]
            lines.append(cells)
    cols = (["group"] if any(groups) else []) + ["rate (req/s)"]
    for p in policies:
        cols += [f"{p}: normalized latency", f"{p}: finished/s", f"{p}: mean batch"]
    return common.markdown_table(cols, lines)


def sustained_table(analyses: dict[str, dict[str, Any]], policies: Sequence[str], factors: Sequence[float],
                    base: str, reference: str, paper: dict[str, str] | None = None) -> str:
    """Per group: each policy's sustained rate at each threshold, and base / reference."""
    cols = ["group"] + [f"{p}: sustained at {f:g}x unloaded" for f in factors for p in policies]
    cols += [f"{base} / {reference}, at {f:g}x" for f in factors] + [f"peak finished/s, {base} / {reference}"]
    if paper:
        cols.append("paper")
    lines = []
    for group, an in analyses.items():
        cells = [group]
        for th in an["thresholds"]:
            for p in policies:
                a = th["policies"].get(p)
                cells.append(rate_text(a["sustained_rate"], a["sustained_how"]) if a else "not run")
        cells += [ratio_text(th) for th in an["thresholds"]]
        peak = an.get("peak_throughput_ratio", math.nan)
        cells.append(f"{peak:.1f}x" if math.isfinite(peak) else "n/a")
        if paper:
            cells.append(paper.get(group, "-"))
        lines.append(cells)
    return common.markdown_table(cols, lines)


def run(name: str, s: Any, loads: dict[str, Load], policies: Sequence[str], make_llm: Callable[[str], Any],
        point_fields: Sequence[str], write: Callable[..., None],
        progress: bool = True) -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
    """An experiment's whole sweep under `--resume_from` and its time budget (`s.time_budget_s`),
    calling `write(rows, skipped, warm, final)` after every point (final=False) and at the end."""
    log = serving.sweep_log(name, s, point_key, point_fields,
                            write=lambda rows: write(rows, [], {}, final=False))
    budget = serving.Budget(s.time_budget_s)
    warm = sweep(name=name, loads=loads, policies=policies, make_llm=make_llm, drain_s=s.drain_s, seed=s.seed,
                 budget=budget, log=log, progress=progress)
    if log.rows:
        write(log.rows, budget.skipped, warm, final=True)
    else:
        print(f"{name}: no point ran within the time budget and none was resumed; nothing written")
    return log.rows, budget.skipped, warm


def warm_note(warm: dict[str, Any]) -> str:
    """The notes' sentence on what the warm-ups compiled."""
    if not warm:
        return "No warm-up ran in this call (every point was resumed)."
    parts = [f"{k} {w['compiles']} in {w['compile_s']:.1f} s" for k, w in warm.items()]
    return "Warm-up compiles: " + ", ".join(parts) + "."

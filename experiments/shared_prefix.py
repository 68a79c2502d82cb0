"""A shared-prefix workload: translation prompts that all start with the same few-shot
examples, with prefix caching on and off (the paper's Fig. 16: LLaMA-13B translating WMT16
English to German with a 1-shot prefix of 80 tokens or a 5-shot prefix of 341 tokens; vLLM
serves 1.67x and 3.58x the throughput of Orca (Oracle)).

Every prompt is the group's prefix (the same token ids for every request) followed by the
request's own sentence (`workloads.translation_like`); requests arrive as a Poisson process
and are served in real time by three engines with the same weights and KV pool: continuous
batching with prefix caching (the prefix's full blocks are computed once and then shared by
every request, copy-on-write), the same engine without it (every request computes and holds
its own copy of the prefix), and the static request-level policy.

    PYTHONPATH=. python3 experiments/shared_prefix.py                 # tiny model, CPU
    PYTHONPATH=. python3 experiments/shared_prefix.py --setting=gpu   # Llama-3-8B shapes
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

NAME = "shared_prefix"
LABELS = {"prefix caching": "continuous, prefix cached and shared (vLLM)",
          "no prefix caching": "continuous, prefix computed per request",
          "static": "static batching, reserve max_model_len"}
LLM_OVERRIDES: dict[str, dict[str, Any]] = {
    "prefix caching": {"enable_prefix_caching": True},
    "no prefix caching": {},
    "static": {"scheduler": "static"},
}


def group_name(shots: str, tokens: int) -> str:
    return f"{shots} prefix ({tokens} tokens)"


def trace_at(s: configs.SharedPrefixSettings, rate: float) -> list[workloads.Request]:
    n = load_sweep.num_requests(rate, s.window_s, s.min_requests)
    return serving.clip_trace(workloads.translation_like(n, s.seed, rate=rate), s.max_sentence_len, s.max_output_len)


def prefix_ids(tokens: int, vocab: int, seed: int) -> list[int]:
    """The group's shared prefix: the same ids at every rate, so a cached prefix stays valid."""
    return serving.random_prompts([tokens], vocab, seed * 7 + tokens)[0]


def work_for(tokens: int, s: configs.SharedPrefixSettings):
    """`(trace, vocab, seed) -> work`: prefix + the request's own sentence, greedy to its length."""

    def make(trace: list[workloads.Request], vocab: int, seed: int) -> list[serving.Work]:
        prefix = prefix_ids(tokens, vocab, s.seed)
        own = serving.random_prompts([r.prompt_len for r in trace], vocab, seed)
        return [serving.Work(prefix + p, serving.greedy_params(r.output_len), r.output_len, r.arrival_time)
                for p, r in zip(own, trace)]

    return make


def loads(s: configs.SharedPrefixSettings) -> dict[str, load_sweep.Load]:
    warm = load_sweep.warmup_requests(s)
    return {group_name(shots, tokens): load_sweep.Load(rates=s.rates, trace=lambda rate: trace_at(s, rate),
                                                       work=work_for(tokens, s), warmup=warm)
            for shots, tokens in s.prefixes}


def write(s: configs.SharedPrefixSettings, rows: list[dict[str, Any]], skipped: list[str], warm: dict,
          final: bool = True) -> None:
    names = [group_name(*p) for p in s.prefixes]
    present = [g for g in names if any(r["group"] == g for r in rows)]
    f = s.latency_threshold_factors
    vs_static = {g: load_sweep.analyse([r for r in rows if r["group"] == g], s.policies, f,
                                       base="prefix caching", reference="static") for g in present}
    vs_uncached = {g: load_sweep.analyse([r for r in rows if r["group"] == g], s.policies, f,
                                         base="prefix caching", reference="no prefix caching") for g in present}
    paper = common.PAPER["shared_prefix"]
    paper_cells = {group_name(shots, tokens): f"{paper['gain_vs_orca_oracle'][shots]:g}x Orca (Oracle)"
                   for shots, tokens in s.prefixes if shots in paper["gain_vs_orca_oracle"]}
    table = ("## Against the paper (Fig. 16): prefix caching against the static baseline\n\n"
             + load_sweep.sustained_table(vs_static, s.policies, f, "prefix caching", "static", paper=paper_cells))
    table += ("\n\n## Prefix caching on against off (same continuous engine)\n\n"
              + load_sweep.sustained_table(vs_uncached, ("prefix caching", "no prefix caching"), f,
                                           "prefix caching", "no prefix caching"))
    lines = []
    for g in names:
        for p in s.policies:
            rs = sorted((r for r in rows if r["group"] == g and r["policy"] == p and not r["cut_off"]),
                        key=lambda r: r["rate"])
            if rs:
                top = rs[-1]
                lines.append([g, p, f"{top['rate']:g}", f"{top['prefill_tokens'] / max(1, top['num_requests']):.0f}",
                              f"{top['mean_batch']:.1f}", top["max_blocks_used"], top["preemptions"]])
    table += "\n\n## Where the prefix goes, at each engine's busiest rate that was not cut off\n\n"
    table += common.markdown_table(
        ["group", "policy", "rate (req/s)", "prefill tokens computed per request", "mean batch", "most blocks used",
         "preemptions"], lines)
    table += "\n\n## Every rate\n\n" + load_sweep.rate_table(rows, names, s.policies)
    g = s.engine
    notes = (
        "Prompts: a shared prefix of " + " or ".join(f"{t} tokens ({shots})" for shots, t in s.prefixes)
        + f" (random token ids, the same for every request of a group) followed by the request's own sentence, "
        f"translation-like lengths (`paxkv/sim/workloads.py`: about 30 tokens in and 30 out, our assumption; the paper "
        f"gives only the prefixes' lengths), clipped to {s.max_sentence_len} / {s.max_output_len} tokens; greedy, "
        f"EOS ignored. Poisson arrivals over {s.window_s:g} s (at least {s.min_requests} requests) at "
        f"{', '.join(f'{r:g}' for r in s.rates)} requests/s. {serving.engine_note(g, f'in blocks of {g.block_size}')}; "
        "with prefix caching the prefix's full blocks are computed by the first request (or found cached from the "
        "warm-up: the prefix stays in use, as on a server serving it) and shared by every later one; a partial last "
        "block is computed per request. Normalized latency = mean over requests of (finish - arrival) / output "
        f"tokens; runs cut off {s.drain_s:g} s after the last arrival are lower bounds. Sustained rates are against "
        "the prefix-cached engine's latency at the lowest rate. " + load_sweep.warm_note(warm)
        + serving.skipped_note(skipped))
    fig = load_sweep.figure(rows, names, s.policies, LABELS, vs_static,
                            suptitle="Shared few-shot prefix: latency against load (paper Fig. 16)",
                            paper={group_name(shots, t): f"paper: {c}" for (shots, t), c in
                                   zip(s.prefixes, [paper_cells.get(group_name(*p), "") for p in s.prefixes])})
    serving.write_serving_results(
        NAME, s, title="Shared prefix: prefix caching on and off against request rate (paper Fig. 16)",
        results={"runs": rows, "analysis_vs_static": vs_static, "analysis_vs_no_caching": vs_uncached,
                 **serving.completion_fields(skipped, final), "warm_up": warm,
                 "paper": paper},
        table=table, notes=notes, figure=fig, quiet=not final)


def main(argv: list[str]) -> None:
    del argv
    s = serving.settings_from_flags(NAME)
    load_sweep.run(NAME, s, loads(s), s.policies, lambda p: serving.make_llm(s.engine, **LLM_OVERRIDES[p]),
                   point_fields=("prefixes", "rates"), write=lambda *a, **k: write(s, *a, **k))


if __name__ == "__main__":
    app.run(main)

"""Parallel sampling and beam search under load: normalized latency against request rate for
n = 2, 4, 6 samples and beam widths 2, 4, 6 (the paper's Fig. 14, Alpaca: vLLM's gain over
Orca (Oracle) grows with the number of sequences, from 1.3x in basic sampling to 2.3x in beam
search of width 6, because the sequences of one request share more of their blocks).

Alpaca-like requests arrive as a Poisson process; each asks for n samples
(`SamplingParams(n=...)`, forks sharing the prompt's blocks) or a beam search of width W
(beams sharing every block of their common prefix, copy-on-write), served in real time by
paged continuous batching and by the static policy (each sequence reserving
`max_model_len` slots). Latency is normalized by the output length of one sequence.

    PYTHONPATH=. python3 experiments/sampling_vs_rate.py                 # tiny model, CPU
    PYTHONPATH=. python3 experiments/sampling_vs_rate.py --setting=gpu   # Llama-3-8B shapes
"""
from __future__ import annotations

from typing import Any

from absl import app, flags

from configs import experiments as configs
from experiments import common, load_sweep, serving
from paxkv.sim import workloads
from paxkv.sampling_params import BeamSearchParams, SamplingParams

FLAGS = flags.FLAGS
common.define_serving_flags()
flags.adopt_module_key_flags(common)   # its flags in --help too

NAME = "sampling_vs_rate"
LABELS = {"continuous": "paged, continuous batching (vLLM)",
          "static": "static batching, reserve max_model_len per sequence"}


def group_name(kind: str, width: int) -> str:
    return f"parallel n={width}" if kind == "parallel" else f"beam width {width}"


def groups(s: configs.SamplingVsRateSettings) -> list[tuple[str, int]]:
    """(kind, width) in priority order: n=a, beam a, n=b, beam b, ... (a short budget covers both)."""
    widths = sorted(set(s.parallel_n) | set(s.beam_widths))
    return [(k, w) for w in widths for k, ws in (("parallel", s.parallel_n), ("beam", s.beam_widths)) if w in ws]


def trace_at(s: configs.SamplingVsRateSettings, rate: float) -> list[workloads.Request]:
    n = load_sweep.num_requests(rate, s.window_s, s.min_requests)
    return serving.settings_trace(s, s.trace, n, rate=rate)


def work_for(kind: str, width: int, s: configs.SamplingVsRateSettings):
    """`(trace, vocab, seed) -> work`: each request as `width` samples or beams."""

    def make(trace: list[workloads.Request], vocab: int, seed: int) -> list[serving.Work]:
        prompts = serving.random_prompts([r.prompt_len for r in trace], vocab, seed)
        out = []
        for i, (p, r) in enumerate(zip(prompts, trace)):
            if kind == "parallel":
                params: Any = SamplingParams(n=width, temperature=s.temperature, ignore_eos=True,
                                             max_tokens=r.output_len, seed=(seed * 1_000_003 + i * 7919) % (2**31 - 1))
            else:
                params = BeamSearchParams(beam_width=width, max_tokens=r.output_len, ignore_eos=True)
            out.append(serving.Work(p, params, r.output_len, r.arrival_time, num_seqs=width))
        return out

    return make


def loads(s: configs.SamplingVsRateSettings) -> dict[str, load_sweep.Load]:
    cap = load_sweep.static_capacity(s.engine)
    out = {}
    for kind, width in groups(s):
        # The static policy admits about cap // width requests per batch: warm it on two batches.
        def warm(p: str, w: int = width) -> int:
            return s.warmup_requests if p != "static" else max(1, min(s.warmup_requests, 2 * cap // w))
        out[group_name(kind, width)] = load_sweep.Load(rates=s.rates, trace=lambda rate: trace_at(s, rate),
                                                       work=work_for(kind, width, s), warmup=warm)
    return out


def write(s: configs.SamplingVsRateSettings, rows: list[dict[str, Any]], skipped: list[str], warm: dict,
          final: bool = True) -> None:
    names = [group_name(k, w) for k, w in groups(s)]
    an = {g: load_sweep.analyse([r for r in rows if r["group"] == g], s.policies, s.latency_threshold_factors)
          for g in names if any(r["group"] == g for r in rows)}
    paper = common.PAPER["sampling_gain_vs_orca_oracle"]
    paper_cells = {g: "" for g in names}
    if "beam width 6" in paper_cells:
        paper_cells["beam width 6"] = f"{paper['beam_6']:g}x Orca (Oracle)"
    table = (f"## Against the paper (Fig. 14): sustained rates (paper: vLLM over Orca (Oracle) grows from "
             f"{paper['basic']:g}x in basic sampling to {paper['beam_6']:g}x at beam width 6)\n\n"
             + load_sweep.sustained_table(an, s.policies, s.latency_threshold_factors, "continuous", "static",
                                          paper=paper_cells))
    table += "\n\n## Every rate\n\n" + load_sweep.rate_table(rows, names, s.policies)
    g = s.engine
    notes = (
        f"Requests: {s.trace}-like (`paxkv/sim/workloads.py`, seed {s.seed}), clipped to {s.max_prompt_len} / "
        f"{s.max_output_len} tokens, random token ids, EOS ignored so every sample and beam generates the trace's "
        f"length; parallel samples at temperature {s.temperature:g}. Poisson arrivals over {s.window_s:g} s (at least "
        f"{s.min_requests} requests) at {', '.join(f'{r:g}' for r in s.rates)} requests/s. "
        f"{serving.engine_note(g, f'in blocks of {g.block_size}')}; the static policy reserves max_model_len for every "
        f"sequence of a request, so it holds {load_sweep.static_capacity(g)} sequences at a time. Normalized latency = "
        "mean over requests of (finish - arrival) / one sequence's output tokens; a run is cut off "
        f"{s.drain_s:g} s after its last arrival (a lower bound). Sustained rate: where the curve crosses a multiple "
        "of the continuous engine's latency at the lowest rate. " + load_sweep.warm_note(warm)
        + serving.skipped_note(skipped))
    fig = load_sweep.figure(rows, names, s.policies, LABELS, an,
                            suptitle="Parallel sampling and beam search against request rate (paper Fig. 14)")
    serving.write_serving_results(
        NAME, s, title="Parallel sampling and beam search against request rate (paper Fig. 14)",
        results={"runs": rows, "analysis": an, **serving.completion_fields(skipped, final),
                 "warm_up": warm, "paper": paper},
        table=table, notes=notes, figure=fig, quiet=not final)


def main(argv: list[str]) -> None:
    del argv
    s = serving.settings_from_flags(NAME)
    load_sweep.run(NAME, s, loads(s), s.policies, lambda p: serving.make_llm(s.engine, scheduler=p),
                   point_fields=("parallel_n", "beam_widths", "rates"), write=lambda *a, **k: write(s, *a, **k))


if __name__ == "__main__":
    app.run(main)

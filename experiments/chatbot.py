"""A chatbot workload: the conversation so far is the prompt (the paper's Fig. 17: ShareGPT
conversations, history and question cut to their last 1,024 tokens for OPT-13B; vLLM
sustains 2x the request rate of the three Orca baselines).

Each request is a conversation of a random number of earlier ShareGPT-like turns plus a new
question, cut to its last `max_prompt_len` tokens, answered with a ShareGPT-like length
clipped to `max_output_len` (`workloads.chatbot_like`): long prompts, short answers beside
them. Requests arrive as a Poisson process and are served in real time by paged continuous
batching and by the static policy (each request reserving `max_model_len` slots). Prefix
caching is off: as in the paper, each turn is a separate request.

    PYTHONPATH=. python3 experiments/chatbot.py                 # tiny model, CPU
    PYTHONPATH=. python3 experiments/chatbot.py --setting=gpu   # Llama-3-8B shapes
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

NAME = "chatbot"
LABELS = {"continuous": "paged, continuous batching (vLLM)",
          "static": "static batching, reserve max_model_len"}


def trace_at(s: configs.ChatbotSettings, rate: float) -> list[workloads.Request]:
    n = load_sweep.num_requests(rate, s.window_s, s.min_requests)
    trace = workloads.chatbot_like(n, s.seed, rate=rate, max_prompt_len=s.max_prompt_len,
                                   mean_prior_turns=s.mean_prior_turns)
    return serving.clip_trace(trace, s.max_prompt_len, s.max_output_len)


def loads(s: configs.ChatbotSettings) -> dict[str, load_sweep.Load]:
    return {"": load_sweep.Load(rates=s.rates, trace=lambda rate: trace_at(s, rate), work=serving.trace_work,
                                warmup=load_sweep.warmup_requests(s))}


def write(s: configs.ChatbotSettings, rows: list[dict[str, Any]], skipped: list[str], warm: dict,
          final: bool = True) -> None:
    an = {"chatbot": load_sweep.analyse(rows, s.policies, s.latency_threshold_factors)} if rows else {}
    gain = common.PAPER["chatbot_gain_vs_orca"]
    table = ("## Against the paper (Fig. 17): sustained rates\n\n"
             + load_sweep.sustained_table(an, s.policies, s.latency_threshold_factors, "continuous", "static",
                                          paper={"chatbot": f"{gain:g}x the three Orca baselines"}))
    table += "\n\n## Every rate\n\n" + load_sweep.rate_table(rows, [""], s.policies)
    summary = workloads.summarize(trace_at(s, max(s.rates)))
    g = s.engine
    notes = (
        f"Requests (`paxkv/sim/workloads.py` chatbot_like, seed {s.seed}): a geometric number of earlier ShareGPT-like "
        f"turns (mean {s.mean_prior_turns:g}) and a new ShareGPT-like question, kept to the last {s.max_prompt_len} "
        f"tokens; answers ShareGPT-like, clipped to {s.max_output_len}. The busiest rate's trace: prompts mean "
        f"{summary['prompt_mean']:.0f} (median {summary['prompt_p50']:.0f}), answers mean {summary['output_mean']:.0f} "
        f"tokens. Random token ids, greedy with EOS ignored. Poisson arrivals over {s.window_s:g} s (at least "
        f"{s.min_requests} requests) at {', '.join(f'{r:g}' for r in s.rates)} requests/s. "
        f"{serving.engine_note(g, f'in blocks of {g.block_size}')}, prefix caching off, so the static policy runs at "
        f"most {load_sweep.static_capacity(g)} requests at a time. Normalized latency = mean over requests of "
        f"(finish - arrival) / output tokens; runs cut off {s.drain_s:g} s after the last arrival are lower bounds. "
        + load_sweep.warm_note(warm) + serving.skipped_note(skipped))
    fig = load_sweep.figure([dict(r, group="chatbot") for r in rows], ["chatbot"], s.policies, LABELS, an,
                            titles={"chatbot": "chatbot: history as the prompt"},
                            suptitle="Chatbot workload: latency against load (paper Fig. 17)",
                            paper={"chatbot": f"paper: {gain:g}x the Orca baselines' sustained rate"})
    serving.write_serving_results(
        NAME, s, title="Chatbot: conversation history as the prompt, latency against rate (paper Fig. 17)",
        results={"runs": rows, "analysis": an, "trace_at_highest_rate": summary,
                 **serving.completion_fields(skipped, final), "warm_up": warm,
                 "paper": {"chatbot_gain_vs_orca": gain}},
        table=table, notes=notes, figure=fig, quiet=not final)


def main(argv: list[str]) -> None:
    del argv
    s = serving.settings_from_flags(NAME)
    load_sweep.run(NAME, s, loads(s), s.policies, lambda p: serving.make_llm(s.engine, scheduler=p),
                   point_fields=("rates",), write=lambda *a, **k: write(s, *a, **k))


if __name__ == "__main__":
    app.run(main)

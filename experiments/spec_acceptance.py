"""How many tokens n-gram (prompt lookup) speculation would emit per verify step, on a real
model's own greedy outputs.

Under greedy decoding a verify step keeps a draft token exactly when it equals the target's
argmax, which is the token the target emits anyway (`paxkv/spec_decode/rejection.py`). So
the n-gram proposer's acceptance is known exactly from the target's greedy output alone:
walk the output, propose from the context so far (`spec_decode.ngram.propose_ngram`), keep
the prefix of the draft that the output continues with, emit that plus one token, go on.
No speculative engine is needed to measure it, and the figure is the one such an engine
would see (with `batch_invariant=True` the verify step's argmax is the decode step's
bitwise; by default the two can differ in the last bits).

The prompts are chat requests to SmolLM2-135M-Instruct in four kinds: editing code,
correcting a paragraph, extracting from a passage (the output repeats the prompt), and open
questions (it does not).

    PYTHONPATH=. python3 experiments/spec_acceptance.py                     # CPU: ~2 minutes
    PYTHONPATH=. python3 experiments/spec_acceptance.py --out_dir=results   # update the results

Writes spec_acceptance.{json,md,png}.
"""
from __future__ import annotations

import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common  # noqa: E402
from experiments.spec_prompts import PROMPTS  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "preset, checkpoint dir or GGUF file "
                    "(needs a chat template)")
flags.DEFINE_integer("max_tokens", 160, "output tokens per request at most")
flags.DEFINE_list("k", ["1", "2", "3", "4", "6", "8"], "num_speculative_tokens to evaluate")
flags.DEFINE_integer("prompt_lookup_min", 1, "shortest suffix looked up")
flags.DEFINE_integer("prompt_lookup_max", 4, "longest suffix looked up")
flags.DEFINE_list("engine_k", ["2", "4"], "also run the engine with speculation at these k "
                  "and compare its drafts and kept tokens with the replay")
flags.DEFINE_string("out_dir", "scratch/results", "where spec_acceptance.json/.md/.png go "
                    "(--out_dir=results updates the committed results)")

def simulate(prompt: list[int], output: list[int], k: int, n_min: int, n_max: int,
             max_tokens: int) -> dict:
    """Greedy n-gram speculation along `output`, as the engine runs it: the first token comes
    from the prefill step, and a draft never runs past `max_tokens`. -> verify steps, drafts
    proposed and kept."""
    from paxkv.spec_decode.ngram import propose_ngram
    steps, proposed, kept = 1, 0, 0
    t = 1
    while t < len(output):
        room = min(k, max_tokens - t - 1)
        draft = propose_ngram(prompt + output[:t], room, n_min, n_max) if room > 0 else []
        match = 0
        while match < len(draft) and t + match < len(output) and draft[match] == output[t + match]:
            match += 1
        steps += 1
        proposed += len(draft)
        kept += match
        t += match + 1
    return {"steps": steps, "tokens": len(output), "proposed": proposed, "kept": kept}


def main(argv: list[str]) -> None:
    del argv
    from paxkv import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(FLAGS.model, max_model_len=1024)
    sp = SamplingParams(temperature=0.0, max_tokens=FLAGS.max_tokens)
    kinds = list(PROMPTS)
    conversations = [[{"role": "user", "content": p}] for kind in kinds for p in PROMPTS[kind]]
    outs = llm.chat(conversations, sp, use_tqdm=True)
    gen_s = time.perf_counter() - t0
    ks = [int(k) for k in FLAGS.k]
    per_kind: dict[str, dict[int, dict]] = {kind: {} for kind in kinds}
    samples = []
    i = 0
    for kind in kinds:
        for _ in PROMPTS[kind]:
            o = outs[i]
            i += 1
            prompt, output = list(o.prompt_token_ids), list(o.outputs[0].token_ids)
            samples.append({"kind": kind, "output_tokens": len(output),
                            "text": o.outputs[0].text[:300]})
            for k in ks:
                r = simulate(prompt, output, k, FLAGS.prompt_lookup_min, FLAGS.prompt_lookup_max,
                             FLAGS.max_tokens)
                acc = per_kind[kind].setdefault(k, {"steps": 0, "tokens": 0, "proposed": 0, "kept": 0})
                for key in acc:
                    acc[key] += r[key]
    engine = {}
    for k in [int(k) for k in FLAGS.engine_k]:
        spec = LLM(FLAGS.model, max_model_len=1024, speculative_config={
            "method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_min": FLAGS.prompt_lookup_min, "prompt_lookup_max": FLAGS.prompt_lookup_max})
        t0 = time.perf_counter()
        spec_outs = spec.chat(conversations, sp, use_tqdm=False)
        m = spec.llm_engine.metrics
        same = [list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
                for a, b in zip(outs, spec_outs)]
        replay = {key: sum(per_kind[kind][k][key] for kind in kinds) for key in ("proposed", "kept")}
        engine[k] = {"outputs_equal": sum(same), "requests": len(same),
                     "drafts": m.spec_decode_num_draft_tokens, "kept": m.spec_decode_num_accepted_tokens,
                     "replay_drafts": replay["proposed"], "replay_kept": replay["kept"],
                     "seconds": time.perf_counter() - t0}
        del spec
    rows, summary = [], {}
    for kind in kinds:
        for k in ks:
            a = per_kind[kind][k]
            tps = a["tokens"] / a["steps"]
            rate = a["kept"] / a["proposed"] if a["proposed"] else 0.0
            summary[f"{kind}|{k}"] = {**a, "tokens_per_step": tps, "acceptance": rate}
            rows.append([kind, k, a["tokens"], f"{tps:.2f}", common.pct(rate),
                         f"{a['proposed'] / a['steps']:.2f}"])
    table = common.markdown_table(
        ["prompts", "k", "output tokens", "tokens per verify step", "drafts kept",
         "drafts proposed per step"], rows)
    if engine:
        table += "\n\nThe engine itself, `speculative_config={'method': 'ngram', ...}`, same requests:\n\n"
        table += common.markdown_table(
            ["k", "outputs equal to the engine without speculation", "drafts (engine / replay)",
             "kept (engine / replay)"],
            [[k, f"{e['outputs_equal']} of {e['requests']}", f"{e['drafts']} / {e['replay_drafts']}",
              f"{e['kept']} / {e['replay_kept']}"] for k, e in engine.items()])
    notes = (f"Greedy outputs of {FLAGS.model} (up to {FLAGS.max_tokens} tokens, 4 chat prompts "
             f"per kind), then n-gram speculation replayed along them: suffixes of "
             f"{FLAGS.prompt_lookup_min}-{FLAGS.prompt_lookup_max} tokens looked up, longest "
             "first, most recent occurrence. 'tokens per verify step' is the output length over "
             "the verify steps needed (1.00 without speculation): the speed-up when a verify step "
             "of k + 1 tokens costs what a decode step costs, as it nearly does while decoding "
             "is bound by reading the weights. Exact for greedy decoding (see the module "
             "docstring). A 135M model falls into repetition loops (one 'extract' answer repeats "
             "a name, the poem a line), which lookup predicts well: part of its acceptance is "
             f"that. Generation took {gen_s:.0f} s.")
    paths = common.write_results(
        "spec_acceptance", FLAGS.out_dir,
        title="N-gram speculation on a real model: tokens per verify step",
        command=common.command_line(), hardware=common.host_hardware("JAX on the default device"),
        settings={"model": FLAGS.model, "max_tokens": FLAGS.max_tokens, "k": ks,
                  "prompt_lookup_min": FLAGS.prompt_lookup_min,
                  "prompt_lookup_max": FLAGS.prompt_lookup_max},
        results={"summary": summary, "engine": engine, "samples": samples}, table=table, notes=notes,
        figure=_figure(per_kind, ks))
    print(table)
    print("wrote", ", ".join(paths.values()))


def _figure(per_kind: dict, ks: list[int]):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for kind, by_k in per_kind.items():
        ax.plot(ks, [by_k[k]["tokens"] / by_k[k]["steps"] for k in ks], "o-", label=kind)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("num_speculative_tokens (k)")
    ax.set_ylabel("tokens per verify step")
    ax.set_title("n-gram speculation, SmolLM2-135M-Instruct, greedy")
    ax.legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    app.run(main)

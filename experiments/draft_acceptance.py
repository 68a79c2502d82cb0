"""Early-exit drafts on a real model: SmolLM2-135M-Instruct's first N layers (with its final
norm and tied LM head) drafting for the whole model through `speculative_config={"method":
"draft_model", ...}`, the engine's own draft-model path end to end.

A draft model needs the target's tokenizer, and no smaller model of SmolLM2's vocabulary can
be had here; a truncated copy of the target is the cheapest draft that shares it (the idea
of LayerSkip and other self-speculative methods, here without the training that makes early
layers predict well). For each N and each kind of prompt of `spec_acceptance.py`: tokens
per verify step and drafts kept (the engine's counters), and whether the greedy outputs
equal the engine's without speculation.

    PYTHONPATH=. python3 experiments/draft_acceptance.py                      # CPU: ~10 minutes
    PYTHONPATH=. python3 experiments/draft_acceptance.py --out_dir=results    # update the results

Writes draft_acceptance.{json,md,png}.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common  # noqa: E402
from experiments.spec_prompts import PROMPTS  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "preset, checkpoint dir or GGUF file "
                    "(needs a chat template)")
flags.DEFINE_list("draft_layers", ["8", "15", "22"], "layers kept in each draft (from the first)")
flags.DEFINE_integer("k", 4, "num_speculative_tokens")
flags.DEFINE_integer("max_tokens", 160, "output tokens per request at most")
flags.DEFINE_string("out_dir", "scratch/results", "where draft_acceptance.json/.md/.png go "
                    "(--out_dir=results updates the committed results)")


def write_truncated(model: str, num_layers: int, path: str) -> str:
    """The model's first `num_layers` layers, its final norm and LM head, saved as an HF
    checkpoint directory (float32) that `LLM` and transformers load."""
    from paxkv.builder import resolve_model
    from paxkv.model.weights import load_checkpoint, save_checkpoint
    source, _ = resolve_model(model)
    params, cfg = load_checkpoint(source, dtype="float32")
    kept = {name: value for name, value in params.items()
            if not name.startswith("layers_") or int(name.split("_")[1]) < num_layers}
    save_checkpoint(kept, dataclasses.replace(cfg, num_layers=num_layers,
                                              name=f"{cfg.name}-first{num_layers}"), path)
    return path


def main(argv: list[str]) -> None:
    del argv
    from tqdm import tqdm

    from paxkv import LLM, SamplingParams

    t_start = time.perf_counter()
    sp = SamplingParams(temperature=0.0, max_tokens=FLAGS.max_tokens)
    kinds = list(PROMPTS)
    chats = {kind: [[{"role": "user", "content": p}] for p in PROMPTS[kind]] for kind in kinds}
    plain = LLM(FLAGS.model, max_model_len=1024)
    want = {kind: [list(o.outputs[0].token_ids) for o in plain.chat(chats[kind], sp, use_tqdm=False)]
            for kind in kinds}
    total_layers = plain.llm_engine.model_config.num_layers
    del plain
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in tqdm([int(x) for x in FLAGS.draft_layers], desc="drafts"):
            draft = write_truncated(FLAGS.model, n, os.path.join(tmp, f"first{n}"))
            llm = LLM(FLAGS.model, max_model_len=1024, speculative_config={
                "method": "draft_model", "model": draft, "num_speculative_tokens": FLAGS.k})
            for kind in kinds:
                llm.metrics.reset()
                t0 = time.perf_counter()
                outs = llm.chat(chats[kind], sp, use_tqdm=False)
                m = llm.metrics
                got = [list(o.outputs[0].token_ids) for o in outs]
                tokens = sum(len(g) for g in got)
                steps = m.spec_decode_num_drafts   # verify steps that had drafts
                results.append({
                    "draft_layers": n, "kind": kind, "output_tokens": tokens,
                    "verify_steps": steps, "drafts": m.spec_decode_num_draft_tokens,
                    "kept": m.spec_decode_num_accepted_tokens,
                    "tokens_per_verify_step": 1 + m.spec_decode_num_accepted_tokens / max(steps, 1),
                    "acceptance": m.spec_decode_num_accepted_tokens / max(m.spec_decode_num_draft_tokens, 1),
                    "outputs_equal": sum(a == b for a, b in zip(got, want[kind])),
                    "requests": len(got), "seconds": time.perf_counter() - t0})
                print(results[-1], flush=True)
            del llm
    rows = [[r["draft_layers"], f"{r['draft_layers'] / total_layers:.0%}", r["kind"],
             f"{r['tokens_per_verify_step']:.2f}", common.pct(r["acceptance"]),
             f"{r['outputs_equal']} of {r['requests']}"] for r in results]
    table = common.markdown_table(
        ["draft layers", "of the target's", "prompts", "tokens per verify step", "drafts kept",
         "outputs equal to no speculation"], rows)
    notes = (f"Target {FLAGS.model} ({total_layers} layers), greedy, up to {FLAGS.max_tokens} "
             f"tokens, k = {FLAGS.k}, 4 chat prompts per kind (`spec_acceptance.py`'s). Each "
             "draft is the target's first N layers with its final norm and LM head, untrained "
             "as a draft. 'tokens per verify step' is 1 + kept drafts per verify step. A draft "
             "step of N layers costs about N / {} of a target step plus the LM head, so a draft "
             "pays when tokens per verify step exceed 1 + k x that share. Took {:.0f} s.".format(
                 total_layers, time.perf_counter() - t_start))
    paths = common.write_results(
        "draft_acceptance", FLAGS.out_dir,
        title="Early-exit drafts of a real model: tokens per verify step",
        command=common.command_line(), hardware=common.host_hardware("JAX on the default device"),
        settings={"model": FLAGS.model, "draft_layers": [int(x) for x in FLAGS.draft_layers],
                  "k": FLAGS.k, "max_tokens": FLAGS.max_tokens},
        results={"runs": results}, table=table, notes=notes, figure=_figure(results, kinds))
    print(table)
    print("wrote", ", ".join(paths.values()))


def _figure(results: list[dict], kinds: list[str]):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for kind in kinds:
        rs = [r for r in results if r["kind"] == kind]
        ax.plot([r["draft_layers"] for r in rs], [r["tokens_per_verify_step"] for r in rs], "o-",
                label=kind)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("draft layers (the target's first N)")
    ax.set_ylabel("tokens per verify step")
    ax.set_title(f"early-exit drafts, k = {FLAGS.k}, greedy")
    ax.legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    app.run(main)

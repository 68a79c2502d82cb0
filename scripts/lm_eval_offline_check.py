"""Check lm-evaluation-harness's loglikelihoods, served by `paxkv serve`, against the offline
engine: every (context, continuation) pair in lm-eval's logged samples is tokenized as lm-eval
tokenizes it, scored with `LLM.generate(..., prompt_logprobs=0)`, and compared.

    python3 -m paxkv.serve tiny &                         # then lm-eval against it, with
    lm_eval --model local-completions --model_args model=tiny,base_url=http://127.0.0.1:8000/v1/completions,tokenizer_backend=huggingface,tokenizer=paxkv/assets/tiny \
        --include_path examples/lm_eval --tasks austen_cloze,austen_continue \
        --output_path DIR --log_samples
    PYTHONPATH=. python3 scripts/lm_eval_offline_check.py --samples_dir DIR --out_dir OUT

Writes `lm_eval_offline_check_<model>.{json,md}` to --out_dir: per pair, lm-eval's loglikelihood,
the offline one and their difference; the largest difference heads the table.
"""
from __future__ import annotations

import glob
import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_string("samples_dir", None, "lm-eval's --output_path (searched for samples_*.jsonl)")
flags.DEFINE_string("model", "tiny", "what the server served: preset, checkpoint dir or GGUF")
flags.DEFINE_string("out_dir", "scratch/lm_eval", "where the json and markdown go")
flags.mark_flag_as_required("samples_dir")


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split for causal models: trailing spaces of the context move to the
    continuation, the whole is encoded (no special tokens), the context's ids are its prefix."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return whole[:len(ctx)], whole[len(ctx):]


def loglikelihood_pairs(samples_dir: str) -> list[dict]:
    """(task, doc, context, continuation, lm-eval's loglikelihood) of every logged pair."""
    pairs = []
    for path in sorted(glob.glob(os.path.join(samples_dir, "**", "samples_*.jsonl"), recursive=True)):
        task = os.path.basename(path)[len("samples_"):].rsplit("_", 1)[0]
        with open(path) as f:
            for line in f:
                s = json.loads(line)
                for args, resp in zip(s["arguments"].values(), s["resps"]):
                    if len(args) != 2 or not isinstance(resp[0], list):
                        break   # a generate_until task: nothing to score
                    pairs.append({"task": task, "doc": s["doc_id"], "context": args["arg_0"],
                                  "continuation": args["arg_1"], "served": float(resp[0][0])})
    return pairs


def _slug(model: str) -> str:
    name = os.path.basename(os.path.normpath(model))
    return "".join(c if c.isalnum() else "_" for c in os.path.splitext(name)[0]).lower()


def main(argv: list[str]) -> None:
    from paxkv import LLM, SamplingParams
    pairs = loglikelihood_pairs(FLAGS.samples_dir)
    if not pairs:
        raise SystemExit(f"no loglikelihood samples under {FLAGS.samples_dir}")
    llm = LLM(FLAGS.model)
    tok = llm.get_tokenizer()
    prompts, spans = [], []
    for p in pairs:
        ctx, cont = encode_pair(tok, p["context"], p["continuation"])
        prompts.append(ctx + cont)
        spans.append((len(ctx), cont))
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    for p, out, (ctxlen, cont) in zip(pairs, outs, spans):
        p["offline"] = sum(out.prompt_logprobs[ctxlen + i][t] for i, t in enumerate(cont))
        p["diff"] = abs(p["offline"] - p["served"])
    worst = max(p["diff"] for p in pairs)
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    stem = os.path.join(FLAGS.out_dir, "lm_eval_offline_check_" + _slug(FLAGS.model))
    with open(stem + ".json", "w") as f:
        json.dump({"model": FLAGS.model, "max_abs_diff": worst, "pairs": pairs}, f, indent=1)
    lines = [f"# lm-eval loglikelihoods, served vs offline ({FLAGS.model})", "",
             f"{len(pairs)} pairs; largest |served - offline|: **{worst:.2e} nats**", "",
             "| task | doc | continuation | served | offline | abs diff |", "| --- | ---: | --- | ---: | ---: | ---: |"]
    for p in sorted(pairs, key=lambda p: -p["diff"]):
        lines.append(f"| {p['task']} | {p['doc']} | `{p['continuation']!r}` | {p['served']:.6f} | "
                     f"{p['offline']:.6f} | {p['diff']:.1e} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:3]))


if __name__ == "__main__":
    app.run(main)

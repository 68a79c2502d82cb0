"""The real model, SmolLM2-135M-Instruct from its GGUF file: one stream and many concurrent
chats through the engine, against the weights-read roofline at the copy bandwidth measured in
the same run.

- One stream: the ChatML prompt of one question, 512 greedy tokens (EOS ignored).
- Concurrent chats: `--num_chats` conversations (32 questions x 8 system prompts), sampled
  (temperature 0.7, top-p 0.95, one seed each), up to 256 tokens, ending at the model's EOS.
  Run three times, other seeds each time: the first compiles the step shapes of every batch
  size on the way (its wall time is reported as cold), the second those of prefix-cache
  hits (the same conversations again), the third is the figure.
- Speculation on a copy-with-edits prompt: n-gram lookup, and with `--draft_model` a draft
  model, each against the same prompt without speculation.

    PYTHONPATH=. python3 scripts/bench_real_model.py --out_dir DIR             # GPU
    PYTHONPATH=. python3 scripts/bench_real_model.py --num_chats 8 --stream_tokens 32 \
        --chat_tokens 16 --out_dir DIR                                         # CPU check
"""
from __future__ import annotations

import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct", "preset, GGUF file or checkpoint dir")
flags.DEFINE_integer("stream_tokens", 512, "tokens of the one-stream run")
flags.DEFINE_integer("num_chats", 256, "concurrent conversations")
flags.DEFINE_integer("chat_tokens", 256, "most tokens per chat answer")
flags.DEFINE_integer("ngram_k", 4, "draft tokens of the n-gram speculation row (0: skip it)")
flags.DEFINE_string("draft_model", "", "also speculate on the copy-with-edits prompt with this "
                    "draft model ('self': the model drafting for itself, the acceptance upper "
                    "bound at full draft cost); '' skips the row")
flags.DEFINE_string("out_dir", "scratch/real_model", "where the json, markdown and png go")

# A prompt whose answer repeats it: n-gram speculation's case (editing, rewriting).
EDIT = ("Copy this text exactly, replacing every 'cat' with 'dog':\n"
        "The cat sat by the window every morning. When the sun rose, the cat stretched, "
        "yawned and walked to the kitchen, where the cat waited for breakfast. After eating, "
        "the cat returned to the window and watched the birds until noon.")

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.",
    "Write a haiku about autumn.", "How do I boil an egg?", "What is a prime number?",
    "Give three tips for learning a language.", "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.", "What does a CPU do?",
    "Translate 'good morning' into Spanish.", "What is the difference between weather and climate?",
    "Name three planets and one fact about each.", "How does a bicycle stay upright?",
    "Write a short thank-you note to a teacher.", "What is the Pythagorean theorem?",
    "Suggest a name for a bakery.", "What causes tides?", "How many legs does a spider have?",
    "Describe a cat to someone who has never seen one.", "What is inflation?",
    "Write a limerick about a programmer.", "Why do leaves change colour in autumn?",
    "What is the boiling point of water at sea level?", "Give me a recipe for pancakes.",
    "What is machine learning?", "How do vaccines work?", "Recommend a book for a long trip.",
    "What is the largest ocean?", "How can I sleep better?", "What is gravity?",
    "Explain what an API is.", "Write two sentences about the sea.",
]
SYSTEMS = [None, "You are a concise assistant.", "Answer like a pirate.",
           "You are a patient teacher.", "Answer in one sentence.", "You are a poet.",
           "Answer in French.", "You are a helpful assistant who loves lists."]


def conversations(n: int) -> list[list[dict[str, str]]]:
    out = []
    for i in range(n):
        system = SYSTEMS[(i // len(QUESTIONS)) % len(SYSTEMS)]
        messages = [] if system is None else [{"role": "system", "content": system}]
        out.append(messages + [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
    return out


def one_stream(llm, question: str, sp) -> dict:
    """One greedy chat, run twice (the first compiles its table widths): the second's tokens,
    time to first token and decode tok/s."""
    for _ in range(2):
        out = llm.chat([{"role": "user", "content": question}], sp, use_tqdm=False)[0]
    m, ids = out.metrics, list(out.outputs[0].token_ids)
    return {"tokens": len(ids), "token_ids": ids, "ttft_s": m.first_token_time - m.arrival_time,
            "decode_tok_s": (len(ids) - 1) / (m.finished_time - m.first_token_time)}


def main(argv):
    del argv
    import numpy as np

    from experiments.common import command_line, device_hardware, markdown_table, write_results
    from paxkv import LLM, SamplingParams
    from scripts.bench_common import copy_bandwidth
    import jax
    bw = copy_bandwidth(smoke=jax.default_backend() != "gpu")
    ceiling = max(v for k, v in bw.items() if k.endswith("tbps"))
    llm = LLM(FLAGS.model, max_num_seqs=max(FLAGS.num_chats, 8))
    cfg = llm.llm_engine.model_config
    weight_bytes = (cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size
                                        * cfg.hidden_size)) * 2   # bf16, embedding gather excluded
    roofline = ceiling * 1e12 / weight_bytes
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=8), use_tqdm=False)

    # One stream (run twice: the first compiles the longer table widths).
    sp = SamplingParams(temperature=0.0, max_tokens=FLAGS.stream_tokens, ignore_eos=True)
    stream = one_stream(llm, QUESTIONS[0], sp)
    stream["roofline_share"] = stream["decode_tok_s"] / roofline
    stream.pop("token_ids")
    greedy = llm.chat([{"role": "user", "content": QUESTIONS[0]}],
                      SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0]
    stream["greedy_answer"] = greedy.outputs[0].text
    if FLAGS.ngram_k or FLAGS.draft_model:      # the speculation rows' baseline, on this engine
        edit_sp = SamplingParams(temperature=0.0, max_tokens=160)
        edit_plain = one_stream(llm, EDIT, edit_sp)

    # Concurrent chats.
    convs = conversations(FLAGS.num_chats)
    cold_wall = 0.0
    for round_ in range(3):     # 1: compiles; 2: compiles the prefix hits' shapes; 3: timed
        params = [SamplingParams(temperature=0.7, top_p=0.95, seed=i + round_ * len(convs),
                                 max_tokens=FLAGS.chat_tokens) for i in range(len(convs))]
        t0 = time.perf_counter()
        outs = llm.chat(convs, params, use_tqdm=True)
        wall = time.perf_counter() - t0
        cold_wall = cold_wall or wall
    lens = [len(o.outputs[0].token_ids) for o in outs]
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    chats = {"num_chats": len(outs), "wall_s": wall, "cold_wall_s": cold_wall,
             "output_tokens": int(sum(lens)),
             "output_tok_s": sum(lens) / wall, "requests_s": len(outs) / wall,
             "mean_output_len": float(np.mean(lens)),
             "stopped_at_eos": sum(o.outputs[0].finish_reason == "stop" for o in outs),
             "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p90_s": float(np.percentile(ttft, 90)),
             "sample": {"question": QUESTIONS[0], "answer": outs[0].outputs[0].text}}
    rows_spec = []
    spec = {}
    methods = []
    if FLAGS.ngram_k:
        methods.append(("n-gram", {"method": "ngram", "num_speculative_tokens": FLAGS.ngram_k,
                                   "prompt_lookup_min": 2, "prompt_lookup_max": 4}))
    if FLAGS.draft_model:
        draft = FLAGS.model if FLAGS.draft_model == "self" else FLAGS.draft_model
        methods.append((f"draft model ({FLAGS.draft_model})",
                        {"method": "draft_model", "model": draft,
                         "num_speculative_tokens": FLAGS.ngram_k or 4}))
    if methods:
        plain_ids = edit_plain.pop("token_ids")
        rows_spec = [[f"one stream, copy-with-edits prompt, greedy, {edit_plain['tokens']} tokens",
                      f"{edit_plain['decode_tok_s']:.0f}", "-", "no speculation"]]
    for label, config in methods:
        llm.shutdown()
        del llm
        llm = LLM(FLAGS.model, max_num_seqs=8, speculative_config=config)
        llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=8), use_tqdm=False)
        llm.metrics.reset()
        edit_spec = one_stream(llm, EDIT, edit_sp)
        summary = llm.metrics.summary()
        same = edit_spec.pop("token_ids") == plain_ids
        spec[label] = {"config": config, "plain": edit_plain, "speculative": edit_spec,
                       "same_tokens": same,
                       "mean_acceptance_length": summary.get("spec_decode_mean_acceptance_length"),
                       "acceptance_rate": summary.get("spec_decode_acceptance_rate"),
                       "speedup": edit_spec["decode_tok_s"] / edit_plain["decode_tok_s"]}
        r = spec[label]
        rows_spec.append([f"the same, {label} k = {config['num_speculative_tokens']}",
                          f"{edit_spec['decode_tok_s']:.0f}", "-",
                          f"{r['speedup']:.2f}x; {r['mean_acceptance_length'] or 0:.2f} tokens "
                          f"per verify step; outputs {'equal' if same else 'DIFFER'}"])
    table = markdown_table(
        ["run", "tok/s", "vs roofline", "other"],
        [["one stream, greedy, {} tokens".format(stream["tokens"]), f"{stream['decode_tok_s']:.0f}",
          f"{100 * stream['roofline_share']:.1f}% of {roofline:.0f}",
          f"TTFT {1e3 * stream['ttft_s']:.1f} ms"],
         [f"{chats['num_chats']} concurrent chats, sampled", f"{chats['output_tok_s']:.0f}", "-",
          f"{chats['requests_s']:.1f} req/s, mean {chats['mean_output_len']:.0f} tokens, "
          f"TTFT p50 {chats['ttft_p50_s']:.2f} s (cold round {chats['cold_wall_s']:.1f} s, "
          f"this one {chats['wall_s']:.1f} s)"]] + rows_spec)
    notes = (f"Weights read per token: {weight_bytes / 1e6:.0f} MB (bf16, {cfg.num_params() / 1e6:.0f}M "
             f"parameters, the tied embedding read once by the LM head); copy bandwidth "
             f"{ceiling:.2f} TB/s, same run. '{QUESTIONS[0]}', greedy: "
             f"{stream['greedy_answer']!r}; one sampled chat answer: "
             f"{chats['sample']['answer']!r}")
    print(table)
    print(notes)

    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.hist(lens, bins=32)
    ax.set_xlabel("output tokens per chat")
    ax.set_ylabel("chats")
    ax.set_title(f"{chats['num_chats']} concurrent chats, {cfg.name}")
    paths = write_results("real_model", FLAGS.out_dir, title=f"The real model: {cfg.name}",
                          command=command_line(), hardware=device_hardware(),
                          settings={k: getattr(FLAGS, k) for k in ("model", "stream_tokens",
                                                                   "num_chats", "chat_tokens",
                                                                   "ngram_k", "draft_model")},
                          results={"bandwidth": bw, "weight_bytes": weight_bytes,
                                   "roofline_tok_s": roofline, "stream": stream, "chats": chats,
                                   "ngram_speculation": spec},
                          table=table, notes=notes, figure=fig)
    print("wrote", ", ".join(paths.values()))


if __name__ == "__main__":
    app.run(main)

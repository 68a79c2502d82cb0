"""`python3 -m paxkv`: generate completions for several prompts on the embedded model.

Runs the whole engine (paged KV pool, block manager, continuous batching) on whatever device
JAX finds, and prints each completion with throughput and KV-cache usage.
"""
from __future__ import annotations

import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "tiny", "preset name or Hugging Face checkpoint directory")
flags.DEFINE_integer("max_tokens", 48, "tokens to generate per prompt")
flags.DEFINE_float("temperature", 0.7, "0 = greedy")
flags.DEFINE_float("top_p", 0.9, "nucleus sampling mass")
flags.DEFINE_integer("num_prompts", 8, "how many of the built-in prompts to run")
flags.DEFINE_integer("block_size", 16, "tokens per KV block")
flags.DEFINE_string("attention_backend", "auto", "reference | pallas | auto")

PROMPTS = [
    "Once upon a time",
    "The king said to his people",
    "In the morning the old man",
    "She opened the door and",
    "The little bird",
    "It was a dark and stormy night",
    "The city was quiet when",
    "He looked at the sea and",
    "There was once a girl who",
    "The road to the village",
]


def main(argv: list[str]) -> None:
    del argv
    from paxkv import LLM, SamplingParams
    llm = LLM(model=FLAGS.model, block_size=FLAGS.block_size,
              attention_backend=FLAGS.attention_backend)
    prompts = (PROMPTS * (1 + FLAGS.num_prompts // len(PROMPTS)))[:FLAGS.num_prompts]
    if llm.get_tokenizer() is None:  # a random-weight preset: token-id prompts
        prompts = [[1 + (7 * i + j) % 97 for j in range(5 + i)] for i in range(len(prompts))]
    params = [SamplingParams(temperature=FLAGS.temperature, top_p=FLAGS.top_p,
                             max_tokens=FLAGS.max_tokens, seed=i) for i in range(len(prompts))]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # compile outside timing
    llm.metrics.reset()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    compile_s = llm.metrics.summary()["compile_s"]
    for o in outs:
        shown = o.prompt if o.prompt is not None else str(o.prompt_token_ids)
        text = o.outputs[0].text or str(o.outputs[0].token_ids)
        print(f"\n>>> {shown}\n{text}")
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    run_s = max(elapsed - compile_s, 1e-9)
    print(f"\n{len(outs)} prompts, {n_out} output tokens in {elapsed:.2f}s ({compile_s:.2f}s of it "
          f"one-time compilation): {n_out / run_s:.1f} output tokens/s after compilation")
    print(llm.metrics.format_summary())


if __name__ == "__main__":
    app.run(main)

"""A sliding window at long context: a Mistral-7B-shaped model (random bf16 weights, window
4,096) against the same model with full attention, at 32k tokens of context.

For each variant, on the same weights: the KV pool's size, the blocks one 32k-token sequence
holds while it decodes, how many such sequences the pool holds at once, the time to the first
token of a 32k prompt (chunked prefill), and the decode step time at 32k context for one
sequence and for a batch. The sliding variant's decode reads only the window's pages and
its sequences give back every block the window has passed.

    PYTHONPATH=. python3 scripts/bench_sliding_window.py --out_dir DIR          # GPU
    PYTHONPATH=. python3 scripts/bench_sliding_window.py --smoke --out_dir DIR  # CPU, tiny
"""
from __future__ import annotations

import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_integer("context", 32768, "prompt tokens (the decode context)")
flags.DEFINE_integer("window", 4096, "the sliding variant's window")
flags.DEFINE_integer("decode_tokens", 128, "tokens decoded after each prompt")
flags.DEFINE_integer("batch", 8, "sequences of the batched run")
flags.DEFINE_float("gpu_memory_utilization", 0.9, "share of JAX's device memory for the engine")
flags.DEFINE_bool("smoke", False, "a tiny model at a short context, for the CPU")
flags.DEFINE_string("out_dir", "scratch/sliding_window", "where the json, markdown and png go")


def mistral_config(window: int | None, context: int, smoke: bool):
    from paxkv.config import ModelConfig
    shape = (dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16) if smoke else
             dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
                  num_heads=32, num_kv_heads=8, head_dim=128))
    layers = shape["num_layers"]
    return ModelConfig(**shape, rope_theta=10000.0, max_position_embeddings=2 * context,
                       architecture="MistralForCausalLM", sliding_window=window,
                       layer_types=("sliding_attention",) * layers if window else (),
                       name="mistral-7b-shape" + ("-sliding" if window else "-full"))


def run_variant(cfg, batch: int) -> dict:
    import numpy as np

    from paxkv import LLM, SamplingParams
    ctx, out_len = FLAGS.context, FLAGS.decode_tokens
    llm = LLM(cfg, dtype="bfloat16" if not FLAGS.smoke else "float32",
              max_model_len=ctx + out_len + 16, max_num_seqs=max(batch, 1),
              gpu_memory_utilization=FLAGS.gpu_memory_utilization,
              **({"num_gpu_blocks_override": 4096, "max_num_batched_tokens": 256}
                 if FLAGS.smoke else {}))
    engine = llm.llm_engine
    bm = engine.block_manager
    bs = bm.block_size
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate([rng.integers(3, cfg.vocab_size, 64).tolist()], sp, use_tqdm=False)   # warm up

    def timed(num: int, tag: str = "timed") -> dict:
        prompts = [rng.integers(3, cfg.vocab_size, ctx).tolist() for _ in range(num)]
        for i, p in enumerate(prompts):
            engine.add_request(f"{tag}{num}-{i}", p, sp)
        held, done = 0, []
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done.append(o)
            running = engine.scheduler.running_seqs
            if running and all(s.num_computed_tokens >= ctx for s in running):   # decoding
                held = max(held, bm.num_used_blocks)
        wall = time.perf_counter() - t0
        ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in done]
        decode = [(o.metrics.finished_time - o.metrics.first_token_time) / (out_len - 1)
                  for o in done]
        return {"sequences": num, "wall_s": wall, "ttft_s": float(np.median(ttft)),
                "decode_ms_per_step": 1e3 * float(np.median(decode)),
                "decode_tok_s": num / float(np.median(decode)),
                "blocks_held_while_decoding": held,
                "blocks_held_per_sequence": held / num}

    # Each shape runs once untimed first: the long context's table widths and the batch's row
    # counts compile then, not inside the timed prefill and decode.
    timed(1, "warm")
    one = timed(1)
    if batch > 1:
        timed(batch, "warm")
    many = timed(batch) if batch > 1 else None
    per_seq = one["blocks_held_per_sequence"]
    out = {"variant": "sliding" if cfg.sliding_window else "full",
           "window": cfg.sliding_window, "num_blocks": bm.num_blocks, "block_size": bs,
           "tokens_in_pool": (bm.num_blocks - 1) * bs,
           "context_sequences_in_pool": int((bm.num_blocks - 1) // max(per_seq, 1)),
           "one": one, "batch": many}
    llm.shutdown()
    return out


def render(rows: list[dict]) -> str:
    from experiments.common import markdown_table
    head = ["variant", "pool blocks (tokens)", "blocks one 32k sequence holds",
            "32k sequences the pool holds", "TTFT, 1 x 32k (s)", "decode ms/step, 1 seq",
            f"decode ms/step, {FLAGS.batch} seqs", f"decode tok/s, {FLAGS.batch} seqs"]
    body = []
    for r in rows:
        b = r["batch"] or {}
        body.append([f"{r['variant']}" + (f" (window {r['window']})" if r["window"] else ""),
                     f"{r['num_blocks']:,} ({r['tokens_in_pool']:,})",
                     int(r["one"]["blocks_held_per_sequence"]), f"{r['context_sequences_in_pool']:,}",
                     f"{r['one']['ttft_s']:.2f}", f"{r['one']['decode_ms_per_step']:.2f}",
                     f"{b.get('decode_ms_per_step', float('nan')):.2f}",
                     f"{b.get('decode_tok_s', float('nan')):.0f}"])
    return markdown_table(head, body)


def plot(rows: list[dict]):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    names = [r["variant"] for r in rows]
    axes[0].bar(names, [r["one"]["blocks_held_per_sequence"] * r["block_size"] for r in rows])
    axes[0].set_ylabel("KV tokens one sequence holds")
    axes[0].set_yscale("log")
    axes[1].bar([f"{n}, 1" for n in names], [r["one"]["decode_ms_per_step"] for r in rows])
    if all(r["batch"] for r in rows):
        axes[1].bar([f"{n}, {FLAGS.batch}" for n in names],
                    [r["batch"]["decode_ms_per_step"] for r in rows])
    axes[1].set_ylabel(f"decode ms/step at {FLAGS.context:,} context")
    fig.suptitle("Mistral-7B shape, sliding window vs full attention")
    fig.tight_layout()
    return fig


def main(argv):
    del argv
    from tqdm import tqdm

    from experiments.common import command_line, device_hardware, write_results
    if FLAGS.smoke:
        FLAGS.context, FLAGS.window, FLAGS.decode_tokens = 1024, 128, 16
    rows = []
    for window in tqdm((FLAGS.window, None), desc="variants"):
        rows.append(run_variant(mistral_config(window, FLAGS.context, FLAGS.smoke), FLAGS.batch))
    table = render(rows)
    print(table)
    paths = write_results(
        "sliding_window", FLAGS.out_dir,
        title=f"Sliding window at {FLAGS.context:,} tokens: Mistral-7B shape",
        command=command_line(), hardware=device_hardware(),
        settings={k: getattr(FLAGS, k) for k in ("context", "window", "decode_tokens", "batch",
                                                  "gpu_memory_utilization", "smoke")},
        results={"variants": rows}, table=table, figure=plot(rows))
    print("wrote", ", ".join(paths.values()))


if __name__ == "__main__":
    app.run(main)

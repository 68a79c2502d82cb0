"""Long-context decode on one GPU: the fused RoPE + decode kernel's split count at long
contexts, and one stream of the `llama3.1-8b` preset (random bf16 weights) at long prompts,
in bf16 and FP8 pages, against its floor.

- Kernel: one layer's decode attention (32 query / 8 KV heads, head_dim 128, 16-token
  blocks) at each context and batch: the fused kernel with the old 4-split cap, with its
  default (the cap follows the table's width), and the unfused `paged_attention` with its
  default split count, over bf16 and FP8 pages. KV bytes read per call over time is the
  read rate, beside the copy bandwidth measured in the same run.
- Engine: per KV dtype, one `LLM`; per context, a random prompt of that length run once
  untimed (compiles its shapes) and a fresh one timed: time to first token (chunked
  prefill) and decode tok/s over `--decode_tokens`. The floor is the weights (embedding
  excluded) plus the KV bytes one token reads, at the copy bandwidth.

    PYTHONPATH=. python3 scripts/bench_long_context.py --out_dir DIR            # GPU
    PYTHONPATH=. python3 scripts/bench_long_context.py --smoke --out_dir DIR    # CPU, tiny
"""
from __future__ import annotations

import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_list("contexts", ["32768", "100000"], "context lengths in tokens")
flags.DEFINE_list("kernel_batches", ["1", "16"], "batches of the kernel section")
flags.DEFINE_list("kv_dtypes", ["auto", "fp8"], "KV cache dtypes of the engine section")
flags.DEFINE_string("model", "llama3.1-8b", "preset of the engine section")
flags.DEFINE_integer("decode_tokens", 128, "tokens decoded after each prompt")
flags.DEFINE_bool("kernel", True, "run the kernel section")
flags.DEFINE_bool("engine", True, "run the engine section")
flags.DEFINE_bool("smoke", False, "tiny shapes and model, for the CPU")
flags.DEFINE_string("out_dir", "scratch/long_context", "where the json, markdown and png go")


def _kernel_case(batch: int, ctx: int, fp8: bool):
    import jax
    import jax.numpy as jnp

    from scripts.bench_common import BLOCK, HEAD_DIM, KV_HEADS, Q_HEADS, make_pool, permuted_tables
    pages = -(-ctx // BLOCK)
    num_blocks = batch * pages + 1
    key = jax.random.key(ctx + batch)
    k, v = make_pool(key, num_blocks)
    if fp8:
        k, v = k.astype(jnp.float8_e4m3fn), v.astype(jnp.float8_e4m3fn)
    qkv = jax.random.normal(jax.random.fold_in(key, 1), (batch, Q_HEADS + 2 * KV_HEADS, HEAD_DIM),
                            jnp.bfloat16)
    angles = jax.random.uniform(jax.random.fold_in(key, 2), (batch, HEAD_DIM // 2)) * 100
    tables = permuted_tables(ctx, batch, pages, num_blocks)
    lens = jnp.full((batch,), ctx, jnp.int32)
    slots = tables[:, (ctx - 1) // BLOCK] * BLOCK + (ctx - 1) % BLOCK
    return qkv, jnp.cos(angles), jnp.sin(angles), slots, k, v, tables, lens


def kernel_rows(contexts: list[int], batches: list[int]) -> list[dict]:
    """Seconds per call of each decode variant at each (context, batch)."""

    import jax
    from tqdm import tqdm

    from pallas_kernels.paged_attention import paged_attention
    from pallas_kernels.paged_attention.paged_attention import (
        ROPE_DECODE_MAX_SPLITS, choose_num_splits, default_pages_per_compute_block,
        rope_decode_max_splits, rope_paged_attention)
    from scripts.bench_common import BLOCK, KV_HEADS, Q_HEADS, rel_err
    interpret = jax.default_backend() != "gpu"
    ppcb = default_pages_per_compute_block(BLOCK)

    def fused(splits):
        def f(qkv, cos, sin, slots, tables, lens, k, v):
            return rope_paged_attention(qkv, cos, sin, slots, k, v, tables, lens,
                                        num_splits=splits, interpret=interpret)
        return jax.jit(f, donate_argnums=(6, 7))

    def unfused(qkv, cos, sin, slots, tables, lens, k, v):
        # The pages go back out donated, as the fused kernel's do: an undonated input
        # returned from a jit is a copy of the whole pool inside the timed call.
        q = qkv[:, :Q_HEADS]
        return paged_attention(q, k, v, tables, lens, interpret=interpret), k, v

    rows = []
    for ctx in tqdm(contexts, desc="kernel contexts"):
        for batch in batches:
            pages = -(-ctx // BLOCK)
            old = choose_num_splits(batch, KV_HEADS, pages, ppcb, max_splits=ROPE_DECODE_MAX_SPLITS)
            new = choose_num_splits(batch, KV_HEADS, pages, ppcb,
                                    max_splits=rope_decode_max_splits(pages, ppcb))
            row = {"context": ctx, "batch": batch, "splits_old_cap": old, "splits_now": new,
                   "splits_unfused": choose_num_splits(batch, KV_HEADS, pages, ppcb)}
            for fp8 in (False, True):
                qkv, cos, sin, slots, k, v, tables, lens = _kernel_case(batch, ctx, fp8)
                kv_bytes = 2 * batch * ctx * KV_HEADS * k.shape[-1] * k.dtype.itemsize
                name = "fp8" if fp8 else "bf16"
                variants = {"unfused": jax.jit(unfused, donate_argnums=(6, 7))}
                if not fp8:       # the fused kernel takes unquantized pages only
                    variants = {"fused_old_cap": fused(old), "fused_now": fused(None), **variants}
                outs = {}
                for label, fn in variants.items():
                    out, k, v = fn(qkv, cos, sin, slots, tables, lens, k, v)
                    outs[label] = out
                    samples = []
                    for _ in range(1 if interpret else 7):    # the pages thread through
                        jax.block_until_ready((k, v))
                        t0 = time.perf_counter()
                        for _ in range(1 if interpret else 20):
                            out, k, v = fn(qkv, cos, sin, slots, tables, lens, k, v)
                        jax.block_until_ready(out)
                        samples.append((time.perf_counter() - t0) / (1 if interpret else 20))
                    t = statistics.median(samples)
                    row[f"{name}_{label}_us"] = 1e6 * t
                    row[f"{name}_{label}_tbps"] = kv_bytes / t / 1e12
                if "fused_now" in outs:
                    row["bf16_fused_old_vs_now_rel_err"] = rel_err(outs["fused_now"],
                                                                   outs["fused_old_cap"])
                del qkv, k, v
            rows.append(row)
            print(row, flush=True)
    return rows


def engine_rows(contexts: list[int], kv_dtypes: list[str], decode_tokens: int,
                ceiling_tbps: float) -> list[dict]:
    """TTFT and decode tok/s of one stream at each context, per KV dtype."""
    import jax
    import numpy as np
    from tqdm import tqdm

    from paxkv import LLM, SamplingParams
    rows = []
    for kv_dtype in kv_dtypes:
        llm = LLM("tiny" if FLAGS.smoke else FLAGS.model, tokenizer=None, kv_cache_dtype=kv_dtype,
                  max_model_len=max(contexts) + decode_tokens + 16, enable_prefix_caching=False,
                  **({"num_gpu_blocks_override": 64, "max_num_batched_tokens": 64}
                     if FLAGS.smoke else {}))
        engine = llm.llm_engine
        cfg = engine.model_config
        params = engine.runner.params
        weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
        weight_bytes -= cfg.vocab_size * cfg.hidden_size * 2   # the embedding is gathered
        bm = engine.block_manager
        kv_itemsize = 1 if kv_dtype != "auto" else 2
        sp = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True,
                            detokenize=False)
        rng = np.random.default_rng(0)
        for ctx in tqdm(contexts, desc=f"engine {kv_dtype}"):
            runs = []
            for _ in range(2):       # the first compiles this context's shapes
                prompt = rng.integers(3, cfg.vocab_size, ctx).tolist()
                out = llm.generate([prompt], sp, use_tqdm=False)[0]
                m = out.metrics
                runs.append({"ttft_s": m.first_token_time - m.arrival_time,
                             "decode_tok_s": (len(out.outputs[0].token_ids) - 1)
                             / (m.finished_time - m.first_token_time)})
            kv_bytes = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_itemsize
                        * (ctx + decode_tokens // 2))
            floor = ceiling_tbps * 1e12 / (weight_bytes + kv_bytes)
            row = {"kv_cache_dtype": kv_dtype, "context": ctx,
                   "pool_tokens": (bm.num_blocks - 1) * bm.block_size,
                   "ttft_s": runs[1]["ttft_s"], "ttft_cold_s": runs[0]["ttft_s"],
                   "decode_tok_s": runs[1]["decode_tok_s"], "floor_tok_s": floor,
                   "share_of_floor": runs[1]["decode_tok_s"] / floor,
                   "weights_GB": weight_bytes / 1e9, "kv_read_GB": kv_bytes / 1e9}
            rows.append(row)
            print(row, flush=True)
        llm.shutdown()
        del llm
    return rows


def main(argv):
    del argv
    import jax

    from experiments.common import command_line, device_hardware, markdown_table, write_results
    from scripts.bench_common import copy_bandwidth
    contexts = [int(c) for c in FLAGS.contexts]
    if FLAGS.smoke:
        contexts = sorted({min(c, 200) for c in contexts})
    bw = copy_bandwidth(smoke=FLAGS.smoke or jax.default_backend() != "gpu")
    ceiling = max(v for k, v in bw.items() if k.endswith("tbps"))
    results: dict = {"copy_bandwidth": bw, "ceiling_tbps": ceiling}
    tables = []
    if FLAGS.kernel:
        krows = kernel_rows(contexts, [int(b) for b in FLAGS.kernel_batches])
        results["kernel"] = krows
        tables.append("Decode attention, one layer (us per call; KV read rate in TB/s):\n\n"
                      + markdown_table(
            ["context", "batch", "splits old cap / now / unfused", "fused, old cap",
             "fused, now", "unfused bf16", "unfused FP8", "FP8 / bf16 (unfused)"],
            [[r["context"], r["batch"],
              f"{r['splits_old_cap']} / {r['splits_now']} / {r['splits_unfused']}",
              f"{r['bf16_fused_old_cap_us']:.0f} ({r['bf16_fused_old_cap_tbps']:.2f})",
              f"{r['bf16_fused_now_us']:.0f} ({r['bf16_fused_now_tbps']:.2f})",
              f"{r['bf16_unfused_us']:.0f} ({r['bf16_unfused_tbps']:.2f})",
              f"{r['fp8_unfused_us']:.0f} ({r['fp8_unfused_tbps']:.2f})",
              f"{r['fp8_unfused_us'] / r['bf16_unfused_us']:.2f}"] for r in krows]))
    if FLAGS.engine:
        erows = engine_rows(contexts, FLAGS.kv_dtypes, FLAGS.decode_tokens, ceiling)
        results["engine"] = erows
        tables.append(f"One stream of `{'tiny' if FLAGS.smoke else FLAGS.model}` (decode floor at {ceiling:.2f} TB/s):\n\n"
                      + markdown_table(
            ["KV dtype", "context", "pool tokens", "TTFT s (cold)", "decode tok/s", "floor tok/s",
             "share of floor"],
            [[r["kv_cache_dtype"], r["context"], f"{r['pool_tokens']:,}",
              f"{r['ttft_s']:.2f} ({r['ttft_cold_s']:.2f})", f"{r['decode_tok_s']:.1f}",
              f"{r['floor_tok_s']:.1f}", f"{r['share_of_floor']:.2f}"] for r in erows]))
    write_results("long_context", FLAGS.out_dir, title="Long-context decode",
                  command=command_line(), hardware=device_hardware(),
                  settings={k: getattr(FLAGS, k) for k in
                            ["contexts", "kernel_batches", "kv_dtypes", "model", "decode_tokens",
                             "smoke"]},
                  results=results, table="\n\n".join(tables))


if __name__ == "__main__":
    app.run(main)

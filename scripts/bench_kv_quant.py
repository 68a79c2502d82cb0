"""8-bit KV pages on one GPU: kernel time against bf16 pages, and what they do to 8B logits.

Three sections, one run (write to `--out`, default `$OUT`):

1. Decode kernel: the five decode shapes of the reference figures (32 query / 8 KV heads,
   head_dim 128, block 16, pages randomly permuted, every sequence at the full context).
   bf16 pages at paxkv's best bf16 tuning (results/kernels.md), then fp8 (e4m3), fp8_e5m2
   and int8 pages with per-(token, head) bf16 scales (`paxkv.cache.quant.quantize`, as the
   pool stores them): fp8 and int8 at that tuning and up to five neighbours with more pages
   per step, deeper pipelines and 8 warps (`quant_tunings`), fp8_e5m2 at fp8's best
   (`--quick`: the bf16 tuning only). Each variant is checked against the jnp reference
   on the same (dequantized) pages before it is timed. The floor is bytes read (codes +
   scales) / the copy bandwidth measured in the same run.
2. Prefill kernel: 8 x 2048-token prompts and 8 x 512-token chunks over 4096 cached tokens,
   bf16 against 8-bit pages (the ragged kernel reads the same scales).
3. Llama-3-8B-shaped model, random bf16 weights: 8 sequences of 1024 random tokens by
   chunked prefill (256-token chunks) and then 32 decode steps (teacher-forced with the
   bf16-page model's greedy tokens, so every pool sees the same inputs), through the paged
   forward with the Pallas backend and a pool of each kv_cache_dtype. Logits are compared
   with the bf16-page run: relative L2 error, max |error|, mean KL, top-1 agreement.

Timing: median over repeats of N back-to-back calls chained in one executable (each
call's output is the next call's query), after compile and warm-up (scripts/bench_common.py).

    PYTHONPATH=. python3 scripts/bench_kv_quant.py --out results/bench_kv_quant
    PYTHONPATH=. python3 scripts/bench_kv_quant.py --smoke      # tiny shapes, CPU interpret

`--backend triton|mosaic` picks the decode kernel (default "auto": Triton for 8-bit pages).
"""
from __future__ import annotations

import functools
import math
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels.paged_attention import (  # noqa: E402
    choose_num_splits,
    paged_attention,
    paged_attention_reference,
)
from pallas_kernels.ragged_paged_attention import (  # noqa: E402
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from pallas_kernels.paged_attention import paging  # noqa: E402
from paxkv.cache import quant  # noqa: E402
from scripts.bench_common import (  # noqa: E402
    BLOCK,
    decode_backend,
    check_and_time,
    HEAD_DIM,
    KV_HEADS,
    Q_HEADS,
    decode_inputs,
    decode_shapes,
    fmt,
    log,
    parse_args,
    prefill_inputs,
    prefill_work,
    rel_err,
    run_sections,
    save_report,
)

# paxkv's best bf16 tuning per shape (results/kernels.md): ppcb, splits, warps, stages
BF16_BEST = {(32, 1024): (8, 4, 4, 2), (64, 2048): (8, 2, 4, 2), (128, 2048): (4, 1, 4, 3),
             (256, 1024): (4, 1, 4, 3), (16, 8192): (8, 8, 4, 2)}
FORMATS = ("fp8", "fp8_e5m2", "int8")
# 8-bit sweep limits: tokens gathered per loop step, and K+V tile bytes the pipeline stages
# keep in shared memory (8-bit tiles; an H200 SM has 227 KiB)
MAX_STEP_TOKENS = 256


@functools.partial(jax.jit, static_argnames=("name",))
def quantize_pages(pages: jax.Array, name: str):
    codes, scales = quant.quantize(pages, quant.storage_dtype(name))
    return codes, scales


def page_bytes(batch: int, ctx: int, name: str) -> int:
    """K+V bytes one decode call reads: codes (+ scales)."""
    codes, scales = quant.bytes_per_token(1, KV_HEADS, HEAD_DIM, quant.storage_dtype(name))
    return batch * ctx * (codes + scales)


# ---- 1. decode kernel ---------------------------------------------------------------------------
def quant_tunings(base: dict, pages: int) -> list[dict]:
    """Tunings tried for 8-bit pages, most promising first. A page carries half the bytes of
    a bf16 page, so each loop step moves half as much: after the bf16 tuning come 2x and 4x
    the pages per step and one more pipeline stage, then 8 warps on the largest step.

    A step stays within MAX_STEP_TOKENS and within a split's pages (so the split count is
    unchanged); stages are capped at the loop's steps + 1 (deeper prefetches nothing more)
    and at what shared memory holds (`paging.fit_num_stages`, as the kernels' defaults are).
    Duplicates after the caps are dropped.
    """
    p, st = base["pages_per_compute_block"], base["num_stages"]
    per_split = -(-pages // base["num_splits"])

    def variant(ppcb: int, stages: int) -> dict | None:
        if ppcb * BLOCK > MAX_STEP_TOKENS or ppcb > per_split:
            return None
        stages = paging.fit_num_stages(None, min(stages, -(-per_split // ppcb) + 1),
                                       block_k=ppcb * BLOCK, head_dim=HEAD_DIM, kv_itemsize=1,
                                       rows=paging.tile_rows(Q_HEADS // KV_HEADS), q_itemsize=2)
        return {**base, "pages_per_compute_block": ppcb, "num_stages": stages}

    tunings = [base]
    for cand in (variant(2 * p, st), variant(p, st + 1), variant(2 * p, st + 1),
                 variant(4 * p, st)):
        if cand is not None and cand not in tunings:
            tunings.append(cand)
    largest = max(tunings, key=lambda t: (t["pages_per_compute_block"], t["num_stages"]))
    wide = {**largest, "num_warps": 8}
    if wide not in tunings:
        tunings.append(wide)
    return tunings


def decode_section(args, clock, results):
    all_shapes = decode_shapes(args.smoke)
    for batch, ctx in decode_shapes(args.smoke, args.shapes):
        shape_i = all_shapes.index((batch, ctx))        # the input seed: same data per shape
        if clock.left() < 60:
            log("(time budget: skipping remaining decode shapes)")
            break
        q, k, v, tables, lens = decode_inputs(shape_i, batch, ctx)
        pages = ctx // BLOCK
        ref_bf16 = paged_attention_reference(q, k, v, tables, lens)
        if (batch, ctx) in BF16_BEST:
            p, s, w, st = BF16_BEST[(batch, ctx)]
        else:
            p, s, w, st = 2, choose_num_splits(batch, KV_HEADS, pages, 2), 4, 2
        base = dict(pages_per_compute_block=p, num_splits=s, num_warps=w, num_stages=st)
        row = {"batch": batch, "context": ctx, "bf16_tuning": base, "formats": {}}
        log(f"\n== decode B={batch} ctx={ctx}")
        # fp8 before fp8_e5m2: e5m2 (same bytes, same kernel) is timed at fp8's best tuning
        for name in ("bfloat16", "fp8", "int8", "fp8_e5m2"):
            if clock.left() < 45:
                break
            if name == "bfloat16":
                kk, vv, ks, vs = k, v, None, None
                tunings = [base]
                ref = ref_bf16
            else:
                kk, ks = quantize_pages(k, name)
                vv, vs = quantize_pages(v, name)
                ref = paged_attention_reference(q, kk, vv, tables, lens, ks, vs)
                if args.quick:
                    tunings = [base]
                elif name == "fp8_e5m2":
                    fp8_best = row["formats"].get("fp8", {}).get("best")
                    tunings = [{key: fp8_best[key] for key in base} if fp8_best else base]
                else:
                    # smoke (CPU interpret) runs only the first two, to exercise the path
                    tunings = quant_tunings(base, pages)[:2 if args.smoke else None]
            nbytes = page_bytes(batch, ctx, name)
            fr = {"bytes": nbytes, "runs": []}
            for tuning in tunings:
                if clock.left() < 30:
                    break
                try:
                    fn = jax.jit(functools.partial(paged_attention, backend=decode_backend(args),
                                                   interpret=args.smoke, **tuning))
                    t, err, out = check_and_time(fn, (q, kk, vv, tables, lens, ks, vs), ref, args.smoke)
                    qerr = rel_err(out, ref_bf16)
                except Exception as e:
                    log(f"  {name} {tuning} FAILED: {repr(e)[:300]}")
                    fr["runs"].append({**tuning, "error": repr(e)[:300]})
                    continue
                ok = err < 2e-2
                log(f"  {name:9s} {tuning}: {t * 1e6:8.1f} us  {nbytes / t / 1e12:5.2f} TB/s  "
                    f"kernel err {err:.1e}  vs bf16 pages {qerr:.1e}{'' if ok else '  WRONG'}")
                fr["runs"].append({**tuning, "us": t * 1e6, "err": err, "err_vs_bf16_pages": qerr})
                if ok and ("best" not in fr or t * 1e6 < fr["best"]["us"]):
                    fr["best"] = {**tuning, "us": t * 1e6, "err_vs_bf16_pages": qerr}
            row["formats"][name] = fr
            del kk, vv, ks, vs
        row["formats"] = {n: row["formats"][n] for n in ("bfloat16",) + FORMATS
                          if n in row["formats"]}
        results["decode"].append(row)
        write_report(args, results)


# ---- 2. prefill kernel -----------------------------------------------------------------------
def prefill_section(args, clock, results):
    tuning = dict(block_q=32, pages_per_compute_block=4, num_warps=4, num_stages=3)
    for wi, (label, seqs, q_len, ctx) in enumerate(prefill_work(args.smoke)):
        if clock.left() < 40:
            log("(time budget: skipping prefill)")
            break
        q, k, v, tables, lens, cu = prefill_inputs(wi, seqs, q_len, ctx)
        row = {"name": label, "seqs": seqs, "q_len": q_len, "context": ctx, "tuning": tuning,
               "formats": {}}
        log(f"\n== prefill {label}")
        for name in ("bfloat16",) + FORMATS:
            if clock.left() < 25:
                break
            if name == "bfloat16":
                kk, vv, ks, vs = k, v, None, None
            else:
                kk, ks = quantize_pages(k, name)
                vv, vs = quantize_pages(v, name)
            try:
                fn = jax.jit(functools.partial(ragged_paged_attention, interpret=args.smoke, **tuning))
                t, err, _ = check_and_time(
                    fn, (q, kk, vv, tables, lens, cu, ks, vs),
                    ragged_paged_attention_reference(q, kk, vv, tables, lens, cu, ks, vs), args.smoke)
            except Exception as e:
                log(f"  {name} FAILED: {repr(e)[:300]}")
                row["formats"][name] = {"error": repr(e)[:300]}
                continue
            log(f"  {name:9s}: {t * 1e6:8.1f} us  kernel err {err:.1e}")
            row["formats"][name] = {"us": t * 1e6, "err": err}
        results["prefill"].append(row)
        write_report(args, results)


# ---- 3. the 8B model's logits ---------------------------------------------------------------------
def model_section(args, clock, results):
    from paxkv.cache import kv_pool as kvp
    from paxkv.config import PRESETS, ModelConfig
    from paxkv.model.batch import StepBatch
    from paxkv.model.forward import forward_jit
    from paxkv.model.weights import random_params
    if args.smoke:
        cfg = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=32, name="smoke")
        seqs, prompt, chunk, steps, wdtype = 2, 64, 32, 4, jnp.float32
    else:
        cfg = PRESETS["llama3-8b"]
        seqs, prompt, chunk, steps, wdtype = 8, 1024, 256, 32, jnp.bfloat16
    backend = "reference" if args.smoke else "pallas"
    t0 = time.perf_counter()
    params = random_params(cfg, jax.random.key(0), wdtype)
    jax.block_until_ready(params)
    log(f"\n== model {cfg.name}: random {jnp.dtype(wdtype).name} weights in "
        f"{time.perf_counter() - t0:.0f} s")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (seqs, prompt)).astype(np.int32)
    per_seq = math.ceil((prompt + steps) / BLOCK)
    num_blocks = 1 + seqs * per_seq
    tables = rng.permutation(np.arange(1, num_blocks)).reshape(seqs, per_seq).astype(np.int32)
    names = ("bfloat16",) + FORMATS
    model_dtype = jnp.bfloat16 if not args.smoke else jnp.float32
    pools = {n: kvp.init_pool(cfg, num_blocks, BLOCK, model_dtype, kv_cache_dtype=n) for n in names}

    def batch_for(ids: np.ndarray, start: int, decode: bool) -> StepBatch:
        n = ids.shape[1]
        pos = np.tile(np.arange(start, start + n, dtype=np.int32), seqs)
        seq = np.repeat(np.arange(seqs), n)
        return StepBatch(
            token_ids=jnp.asarray(ids.reshape(-1)), positions=jnp.asarray(pos),
            slot_mapping=jnp.asarray(tables[seq, pos // BLOCK] * BLOCK + pos % BLOCK),
            block_tables=jnp.asarray(tables),
            context_lens=jnp.full((seqs,), start + n, jnp.int32),
            cu_q_lens=jnp.arange(seqs + 1, dtype=jnp.int32) * n,
            logits_indices=jnp.arange(1, seqs + 1, dtype=jnp.int32) * n - 1)

    @jax.jit
    def compare(logits, ref):
        lp, rp = jax.nn.log_softmax(logits), jax.nn.log_softmax(ref)
        return jnp.stack([
            jnp.sum(jnp.linalg.norm(logits - ref, axis=-1) / jnp.linalg.norm(ref, axis=-1)),
            jnp.max(jnp.abs(logits - ref)),
            jnp.sum(jnp.exp(rp) * (rp - lp)),
            jnp.sum((jnp.argmax(logits, -1) == jnp.argmax(ref, -1)).astype(jnp.float32)),
            jnp.asarray(logits.shape[0], jnp.float32)])

    sums = {phase: {n: np.zeros(5) for n in names} for phase in ("prefill", "decode")}

    def step(ids, start, phase):
        decode = phase == "decode"
        batch = batch_for(ids, start, decode)
        logits = {}
        for n in names:
            logits[n], pools[n] = forward_jit(params, batch, pools[n], cfg, backend=backend,
                                              decode_only=decode, all_logits=not decode)
        for n in names:
            s = np.asarray(compare(logits[n], logits["bfloat16"]), np.float64)
            acc = sums[phase][n]
            acc[[0, 2, 3, 4]] += s[[0, 2, 3, 4]]
            acc[1] = max(acc[1], s[1])
        return logits["bfloat16"]

    for c0 in range(0, prompt, chunk):
        ref = step(tokens[:, c0:c0 + chunk], c0, "prefill")
    nxt = np.asarray(jnp.argmax(ref.reshape(seqs, chunk, -1)[:, -1], -1), np.int32)[:, None]
    for i in range(steps):
        if clock.left() < 20:
            log("(time budget: stopping decode early)")
            break
        ref = step(nxt, prompt + i, "decode")
        nxt = np.asarray(jnp.argmax(ref, -1), np.int32)[:, None]
    out = {"model": cfg.name, "weights": f"random {jnp.dtype(wdtype).name}", "seqs": seqs,
           "prompt": prompt, "chunk": chunk, "decode_steps": steps, "reference": "bfloat16 pages",
           "backend": backend}
    for phase in ("prefill", "decode"):
        out[phase] = {}
        for n in names:
            rel, mx, kl, top1, count = sums[phase][n]
            if count:
                out[phase][n] = {"rel_l2": rel / count, "max_abs": mx, "kl": kl / count,
                                 "top1_agreement": top1 / count, "tokens": int(count)}
                log(f"  {phase:7s} {n:9s} logits vs bf16 pages: rel L2 {rel / count:.2e}  "
                    f"max |err| {mx:.3f}  KL {kl / count:.2e}  top-1 {top1 / count:.4f}")
    results["model"] = out
    write_report(args, results)


# ---- report ----------------------------------------------------------------------------------
def write_report(args, results) -> str:
    bw = results.get("bandwidth", {})
    copy = bw.get("torch_copy_tbps") or bw.get("xla_elementwise_tbps")
    lines = [f"JAX {jax.__version__}, {results.get('device', '?')}", "",
             f"Copy bandwidth (bytes read + written): memcpy {fmt(bw.get('torch_copy_tbps'), '{:.2f}')}"
             f" TB/s, XLA elementwise {fmt(bw.get('xla_elementwise_tbps'), '{:.2f}')} TB/s", "",
             "Decode (32 q / 8 kv heads, d=128, block 16, permuted pages); 8-bit pages carry one bf16 "
             "scale per (token, head); time at the best tuning tried; floor = bytes / copy bw:", "",
             "| batch | context | KV pages | bytes read (MB) | us | tuning (ppcb, splits, warps, stages) "
             "| achieved | floor (us) | vs bf16 | rel. err vs bf16 pages |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results["decode"]:
        bf = r["formats"].get("bfloat16", {}).get("best")
        for name, fr in r["formats"].items():
            best = fr.get("best")
            t = best["us"] if best else None
            tun = (f"{best['pages_per_compute_block']}, {best['num_splits']}, {best['num_warps']}, "
                   f"{best['num_stages']}") if best else "-"
            floor = fr["bytes"] / (copy * 1e12) * 1e6 if copy else None
            lines.append(
                f"| {r['batch']} | {r['context']} | {name} | {fr['bytes'] / 1e6:.0f} | {fmt(t)} | {tun} | "
                f"{fmt(fr['bytes'] / (t * 1e-6) / 1e12 if t else None, '{:.2f}')} TB/s | {fmt(floor)} | "
                f"{fmt(t / bf['us'] if t and bf else None, '{:.2f}')}x | "
                f"{fmt(best.get('err_vs_bf16_pages') if best else None, '{:.1e}')} |")
    lines += ["", "Prefill (ragged kernel, block_q 32, ppcb 4, 4 warps, 3 stages):", "",
              "| workload | KV pages | us | vs bf16 | kernel err |", "| --- | --- | --- | --- | --- |"]
    for r in results["prefill"]:
        bf = r["formats"].get("bfloat16", {}).get("us")
        for name, fr in r["formats"].items():
            t = fr.get("us")
            lines.append(f"| {r['name']} | {name} | {fmt(t)} | "
                         f"{fmt(t / bf if t and bf else None, '{:.2f}')}x | {fmt(fr.get('err'), '{:.1e}')} |")
    m = results.get("model")
    if m:
        lines += ["", f"{m['model']} ({m['weights']} weights), {m['seqs']} x {m['prompt']} random "
                      f"tokens in chunks of {m['chunk']}, then {m['decode_steps']} decode steps; "
                      f"logits against bf16 pages ({m['backend']} backend):", "",
                  "| phase | KV pages | rel. L2 error | max abs error | mean KL | top-1 agreement |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for phase in ("prefill", "decode"):
            for name, s in m.get(phase, {}).items():
                if name == "bfloat16":
                    continue
                lines.append(f"| {phase} | {name} | {s['rel_l2']:.2e} | {s['max_abs']:.3f} | "
                             f"{s['kl']:.2e} | {100 * s['top1_agreement']:.2f}% |")
    text = "\n".join(lines) + "\n"
    save_report(args.out, "kv_quant", text, results)
    return text


def main() -> None:
    args = parse_args(__doc__, budget_s=540.0, quick_help="8-bit pages at the bf16 tuning only",
                      sections="decode,prefill,model")
    run_sections(args, [("model", model_section), ("decode", decode_section),
                        ("prefill", prefill_section)], write_report)


if __name__ == "__main__":
    main()

"""8-bit KV pages on one GPU: kernel time against bf16 pages, and what they do to 8B logits.

Three sections, one run (write to `--out`, default `$OUT`):

1. Decode kernel: the five decode shapes of the reference figures (32 query / 8 KV heads,
   head_dim 128, block 16, pages randomly permuted, every sequence at the full context).
   bf16 pages at paxkv's best bf16 tuning (results/kernels.md), then fp8 (e4m3), fp8_e5m2
   and int8 pages with per-(token, head) bf16 scales (`paxkv.cache.quant.quantize`, as the
   pool stores them) at that tuning and a few neighbours. Each variant is checked against
   the jnp reference on the same (dequantized) pages before it is timed. The floor is
   bytes read (codes + scales) / the copy bandwidth measured in the same run.
2. Prefill kernel: 8 x 2048-token prompts and 8 x 512-token chunks over 4096 cached tokens,
   bf16 against 8-bit pages (the ragged kernel reads the same scales).
3. Llama-3-8B-shaped model, random bf16 weights: 8 sequences of 1024 random tokens by
   chunked prefill (256-token chunks) and then 32 decode steps (teacher-forced with the
   bf16-page model's greedy tokens, so every pool sees the same inputs), through the paged
   forward with the Pallas backend and a pool of each kv_cache_dtype. Logits are compared
   with the bf16-page run: relative L2 error, max |error|, mean KL, top-1 agreement.

Timing: median over repeats of N back-to-back calls chained in one executable (each
call's output is the next call's query), after compile and warm-up; as scripts/bench_kernels.py.

    PYTHONPATH=. python3 scripts/bench_kv_quant.py --out results/bench_kv_quant
    PYTHONPATH=. python3 scripts/bench_kv_quant.py --smoke      # tiny shapes, CPU interpret
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback

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
from paxkv.cache import quant  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DECODE_SHAPES = [(32, 1024), (64, 2048), (128, 2048), (256, 1024), (16, 8192)]
# paxkv's best bf16 tuning per shape (results/kernels.md): ppcb, splits, warps, stages
BF16_BEST = {(32, 1024): (8, 4, 4, 2), (64, 2048): (8, 2, 4, 2), (128, 2048): (4, 1, 4, 3),
             (256, 1024): (4, 1, 4, 3), (16, 8192): (8, 8, 4, 2)}
FORMATS = ("fp8", "fp8_e5m2", "int8")
CHAIN = 8


def log(msg: str) -> None:
    print(msg, flush=True)


class Clock:
    def __init__(self, budget_s: float):
        self.start = time.perf_counter()
        self.budget = budget_s

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)


def time_call(fn, args, reps: int = 7, target_s: float = 0.03, chain: bool = True) -> float:
    """Median seconds per call of `fn(*args)` (`fn` maps q -> an output shaped like q)."""
    n = CHAIN if chain else 1

    def run(q, *rest):
        for _ in range(n):
            q = fn(q, *rest)
        return q
    f = jax.jit(run) if chain else fn
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    one = time.perf_counter() - t0
    iters = int(max(2, min(100, target_s / max(one, 1e-6))))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / iters / n)
    return statistics.median(samples)


def rel_err(out, ref) -> float:
    out, ref = jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def copy_bandwidth(smoke: bool) -> dict:
    """Device-to-device copy rate (bytes read + written): PyTorch memcpy and XLA x + 1."""
    res = {}
    n_bytes = (1 << 20) if smoke else (2 << 30)
    if not smoke:
        try:
            import torch
            a = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
            b = torch.empty_like(a)
            for _ in range(3):
                b.copy_(a)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            samples = []
            for _ in range(10):
                start.record()
                for _ in range(5):
                    b.copy_(a)
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3 / 5)
            res["torch_copy_tbps"] = 2 * n_bytes / statistics.median(samples) / 1e12
            del a, b
            torch.cuda.empty_cache()
        except Exception as e:  # no torch / no GPU: XLA's figure only
            res["torch_copy_error"] = repr(e)[:200]
    x = jax.random.normal(jax.random.key(0), (n_bytes // 2,), jnp.bfloat16)
    res["xla_elementwise_tbps"] = 2 * n_bytes / time_call(jax.jit(lambda x: x + jnp.bfloat16(1)),
                                                          (x,), chain=False) / 1e12
    return res


def permuted_tables(seed: int, batch: int, pages: int, num_blocks: int) -> jax.Array:
    rng = np.random.default_rng(seed)
    perm = rng.permutation(np.arange(1, num_blocks))[: batch * pages]
    return jnp.asarray(perm.reshape(batch, pages).astype(np.int32))


@functools.partial(jax.jit, static_argnames=("name",))
def quantize_pages(pages: jax.Array, name: str):
    codes, scales = quant.quantize(pages, quant.storage_dtype(name))
    return codes, scales


def page_bytes(batch: int, ctx: int, name: str) -> int:
    """K+V bytes one decode call reads: codes (+ scales)."""
    codes, scales = quant.bytes_per_token(1, KV_HEADS, HEAD_DIM, quant.storage_dtype(name))
    return batch * ctx * (codes + scales)


# ---- 1. decode kernel ---------------------------------------------------------------------------
def decode_section(args, clock, results):
    shapes = [(4, 64), (2, 256)] if args.smoke else DECODE_SHAPES
    for shape_i, (batch, ctx) in enumerate(shapes):
        if clock.left() < 60:
            log("(time budget: skipping remaining decode shapes)")
            break
        pages = ctx // BLOCK
        num_blocks = batch * pages + 1
        key = jax.random.key(100 + shape_i)
        shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        k = jax.random.normal(key, shape, jnp.bfloat16)
        v = jax.random.normal(jax.random.fold_in(key, 1), shape, jnp.bfloat16)
        q = jax.random.normal(jax.random.fold_in(key, 7), (batch, Q_HEADS, HEAD_DIM), jnp.bfloat16)
        tables = permuted_tables(shape_i, batch, pages, num_blocks)
        lens = jnp.full((batch,), ctx, jnp.int32)
        ref_bf16 = paged_attention_reference(q, k, v, tables, lens)
        if (batch, ctx) in BF16_BEST:
            p, s, w, st = BF16_BEST[(batch, ctx)]
        else:
            p, s, w, st = 2, choose_num_splits(batch, KV_HEADS, pages, 2), 4, 2
        base = dict(pages_per_compute_block=p, num_splits=s, num_warps=w, num_stages=st)
        row = {"batch": batch, "context": ctx, "bf16_tuning": base, "formats": {}}
        log(f"\n== decode B={batch} ctx={ctx}")
        for name in ("bfloat16",) + FORMATS:
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
                tunings = [base] if args.quick else [
                    base, {**base, "pages_per_compute_block": 2 * p},
                    {**base, "num_warps": 8}, {**base, "num_stages": 3 if st == 2 else 2}]
            nbytes = page_bytes(batch, ctx, name)
            fr = {"bytes": nbytes, "runs": []}
            for tuning in tunings:
                if clock.left() < 30:
                    break
                try:
                    fn = jax.jit(functools.partial(paged_attention, interpret=args.smoke, **tuning))
                    out = fn(q, kk, vv, tables, lens, ks, vs)
                    err = rel_err(out, ref)
                    qerr = rel_err(out, ref_bf16)
                    t = time_call(fn, (q, kk, vv, tables, lens, ks, vs), reps=3 if args.smoke else 7)
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
        results["decode"].append(row)
        write_report(args, results)


# ---- 2. prefill kernel -----------------------------------------------------------------------
def prefill_section(args, clock, results):
    work = ([("prompts", 2, 64, 64), ("chunks", 2, 32, 96)] if args.smoke else
            [("prompts 8 x 2048", 8, 2048, 2048), ("chunks 8 x 512 over 4096", 8, 512, 4608)])
    tuning = dict(block_q=32, pages_per_compute_block=4, num_warps=4, num_stages=3)
    for wi, (label, seqs, q_len, ctx) in enumerate(work):
        if clock.left() < 40:
            log("(time budget: skipping prefill)")
            break
        pages = ctx // BLOCK
        num_blocks = seqs * pages + 1
        key = jax.random.key(300 + wi)
        shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        k = jax.random.normal(key, shape, jnp.bfloat16)
        v = jax.random.normal(jax.random.fold_in(key, 1), shape, jnp.bfloat16)
        tables = permuted_tables(50 + wi, seqs, pages, num_blocks)
        q = jax.random.normal(jax.random.fold_in(key, 3), (seqs * q_len, Q_HEADS, HEAD_DIM),
                              jnp.bfloat16)
        lens = jnp.full((seqs,), ctx, jnp.int32)
        cu = jnp.arange(seqs + 1, dtype=jnp.int32) * q_len
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
                out = fn(q, kk, vv, tables, lens, cu, ks, vs)
                err = rel_err(out, ragged_paged_attention_reference(q, kk, vv, tables, lens, cu, ks, vs))
                t = time_call(fn, (q, kk, vv, tables, lens, cu, ks, vs), reps=3 if args.smoke else 7)
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
    from paxkv.model.llama import forward_jit
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
def fmt(x, spec="{:.1f}"):
    return "-" if x is None else spec.format(x)


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
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kv_quant_table.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "kv_quant.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory for the table/json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run")
    parser.add_argument("--quick", action="store_true", help="8-bit pages at the bf16 tuning only")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: "
                        "decode,prefill,model")
    args = parser.parse_args()
    clock = Clock(args.budget)
    dev = jax.devices()[0]
    results = {"jax": jax.__version__, "device": getattr(dev, "device_kind", str(dev)),
               "decode": [], "prefill": []}
    log(f"JAX {jax.__version__} on {results['device']}")
    results["bandwidth"] = copy_bandwidth(args.smoke)
    log(f"copy bandwidth: {results['bandwidth']}")
    sections = (("model", model_section), ("decode", decode_section), ("prefill", prefill_section))
    for name, section in sections:
        if name in args.skip.split(","):
            continue
        try:
            section(args, clock, results)
        except Exception:
            log(f"section {name} FAILED:\n{traceback.format_exc()[-2000:]}")
    text = write_report(args, results)
    log("\n" + text)
    log(f"total {time.perf_counter() - clock.start:.0f} s")


if __name__ == "__main__":
    main()

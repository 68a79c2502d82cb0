"""Check and time paxkv's Pallas paged-attention kernels on one GPU, in one run.

Decode: the five shapes of the reference figures (32 query / 8 KV heads, head_dim 128,
block 16, bf16, randomly permuted pages): paxkv's kernel over a few tunings (best reported),
JAX's bundled Pallas paged attention (`jax.experimental.pallas.ops.gpu.paged_attention`,
layout [kv_heads, pages, page_size, d]) over a few tunings, paxkv's kernel on a contiguous
cache (identity block table: the cost of paging), and its "heads_first" pool layout. The
copy bandwidth is measured in the same run (device-to-device copy, bytes read + written).
Prefill: 8 x 2048-token prompts and 8 x 512-token chunks over 4096 cached tokens, against
cuDNN attention (jax.nn.dot_product_attention(implementation="cudnn")) on the same tokens.

Every variant is checked against a jnp reference on the GPU before it is timed. Timing:
median over repeats of N back-to-back calls (async dispatch), after compile and warm-up.

    PYTHONPATH=. python3 scripts/bench_kernels.py --out results/bench
    PYTHONPATH=. python3 scripts/bench_kernels.py --smoke      # tiny shapes, CPU interpret

`--backend triton|mosaic` times that decode kernel (default "auto", the engine's choice);
scripts/bench_decode_backends.py puts the backends side by side.
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Callable

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
from pallas_kernels.ragged_paged_attention import ragged_paged_attention  # noqa: E402
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
    make_pool,
    parse_args,
    permuted_tables,
    prefill_inputs,
    prefill_work,
    rel_err,
    run_sections,
    save_report,
    time_call,
)

BUNDLED_BEST = {(32, 1024): 155, (64, 2048): 371, (128, 2048): 619, (256, 1024): 654,
                (16, 8192): 355}                 # reference figures, us (best of 24 tunings)
BUNDLED_TUNINGS = {(32, 1024): (4, 16, 4), (64, 2048): (8, 8, 4), (128, 2048): (4, 16, 4),
                   (256, 1024): (8, 4, 8), (16, 8192): (4, 8, 4)}


@jax.jit
def dense_reference(qd, kc, vc):
    """Exact fp32 attention of q `[S, Lq, Hq, d]` (the last Lq of Lk positions) over K/V."""
    seqs, lq, hq, d = qd.shape
    lk = kc.shape[1]
    qg = qd.astype(jnp.float32).reshape(seqs, lq, KV_HEADS, hq // KV_HEADS, d)
    s = jnp.einsum("sqhgd,skhd->shgqk", qg, kc.astype(jnp.float32), precision="highest")
    s = s * d ** -0.5
    visible = jnp.arange(lk)[None, :] <= (lk - lq + jnp.arange(lq))[:, None]
    s = jnp.where(visible, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("shgqk,skhd->sqhgd", p, vc.astype(jnp.float32), precision="highest")
    return o.reshape(seqs, lq, hq, d)


def measure_tuning(entries: list[dict], tuning: dict, run: Callable[[], tuple[float, float]],
                   rate: Callable[[float], str]) -> float | None:
    """Time one paxkv tuning (`run` returns seconds and relative error), log it with its `rate`
    and append its entry to `entries` (the error message when it failed). Returns its seconds
    when its output is right (relative error below 2e-2), else None."""
    try:
        t, err = run()
    except Exception as e:
        log(f"  paxkv {tuning} FAILED: {repr(e)[:300]}")
        entries.append({**tuning, "error": repr(e)[:300]})
        return None
    ok = err < 2e-2
    log(f"  paxkv {tuning}: {t * 1e6:8.1f} us  {rate(t)}  err {err:.1e}{'' if ok else '  WRONG'}")
    entries.append({**tuning, "us": t * 1e6, "err": err})
    return t if ok else None


def decode_section(args, clock, results):
    shapes = decode_shapes(args.smoke)
    interpret = args.smoke
    from jax.experimental.pallas.ops.gpu import paged_attention as bundled_mod
    for shape_i, (batch, ctx) in enumerate(shapes):
        q, k, v, tables, lens = decode_inputs(shape_i, batch, ctx)
        pages = ctx // BLOCK
        contig = jnp.asarray(1 + np.arange(batch * pages, dtype=np.int32).reshape(batch, pages))
        kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2
        ref = paged_attention_reference(q, k, v, tables, lens)
        row = {"batch": batch, "context": ctx, "kv_bytes": kv_bytes, "paxkv": [], "bundled": []}
        log(f"\n== decode B={batch} ctx={ctx}  KV {kv_bytes / 1e6:.0f} MB")

        auto = choose_num_splits(batch, KV_HEADS, pages, 8)
        tunings = [dict(pages_per_compute_block=p, num_splits=s, num_warps=w, num_stages=st)
                   for p, s, w, st in ((8, auto, 4, 2), (8, max(1, auto // 2), 4, 2),
                                       (8, auto * 2, 4, 2), (8, auto, 8, 3), (4, auto, 4, 3),
                                       (16, auto, 4, 2))
                   if s * p <= pages or s == 1]

        def run_paxkv(tab, tuning, layout="blocks_first", kk=k, vv=v):
            fn = jax.jit(functools.partial(paged_attention, pages_layout=layout,
                                           backend=decode_backend(args), interpret=interpret,
                                           **tuning))
            t, err, _ = check_and_time(fn, (q, kk, vv, tab, lens), ref, args.smoke)
            return t, err

        best = None
        for tuning in tunings:
            if clock.left() < 60:
                log("  (time budget: skipping remaining paxkv tunings)")
                break
            t = measure_tuning(row["paxkv"], tuning, lambda: run_paxkv(tables, tuning),
                               lambda t: f"{kv_bytes / t / 1e12:5.2f} TB/s")
            if t is not None and (best is None or t < best[0]):
                best = (t, tuning)
        if best is not None:                     # refine launch parameters on the best
            for w, st in (() if args.quick else ((8, 2), (4, 3), (8, 3))):
                if clock.left() < 60:
                    break
                tuning = {**best[1], "num_warps": w, "num_stages": st}
                try:
                    t, err = run_paxkv(tables, tuning)
                except Exception as e:
                    log(f"  paxkv {tuning} FAILED: {repr(e)[:300]}")
                    continue
                log(f"  paxkv {tuning}: {t * 1e6:8.1f} us  {kv_bytes / t / 1e12:5.2f} TB/s  "
                    f"err {err:.1e}")
                row["paxkv"].append({**tuning, "us": t * 1e6, "err": err})
                if err < 2e-2 and t < best[0]:
                    best = (t, tuning)
            row["best"] = {**best[1], "us": best[0] * 1e6}
            try:                                 # contiguous cache: the cost of paging
                t, err = run_paxkv(contig, best[1])
                ref_c = paged_attention_reference(q, k, v, contig, lens)
                fn = jax.jit(functools.partial(paged_attention, backend=decode_backend(args),
                                               interpret=interpret, **best[1]))
                err = rel_err(fn(q, k, v, contig, lens), ref_c)
                row["contiguous_us"] = t * 1e6
                row["contiguous_err"] = err
                log(f"  paxkv contiguous (identity table): {t * 1e6:8.1f} us  err {err:.1e}")
            except Exception as e:
                log(f"  contiguous FAILED: {repr(e)[:300]}")
        # heads-first pool layout (the bundled kernel's), also fed to the bundled kernel
        k_hf, v_hf = jnp.moveaxis(k, 2, 0), jnp.moveaxis(v, 2, 0)
        if best is not None and clock.left() > 45:
            try:
                t, err = run_paxkv(tables, best[1], "heads_first", k_hf, v_hf)
                row["heads_first_us"] = t * 1e6
                log(f"  paxkv heads_first layout: {t * 1e6:8.1f} us  err {err:.1e}")
            except Exception as e:
                log(f"  heads_first FAILED: {repr(e)[:300]}")
        b_tunings = [(8, 16, 8)]                 # the bundled kernel's defaults
        if (batch, ctx) in BUNDLED_TUNINGS:
            b_tunings.append(BUNDLED_TUNINGS[(batch, ctx)])
        b_tunings += [(8, 8, 4), (4, 8, 4)] if args.quick else [(8, 8, 4), (4, 16, 4), (8, 4, 8)]
        seen = set()
        q_scaled = (q.astype(jnp.float32) * HEAD_DIM ** -0.5).astype(q.dtype)  # it has no scale
        for ppcb, ks, nw in b_tunings:
            if (ppcb, ks, nw) in seen or clock.left() < 45:
                continue
            seen.add((ppcb, ks, nw))
            if pages % ks or (pages // ks) % min(ppcb, pages // ks):
                continue
            try:
                fn = jax.jit(functools.partial(
                    bundled_mod.paged_attention, pages_per_compute_block=ppcb, k_splits=ks,
                    num_warps=nw, interpret=interpret))
                t, err, _ = check_and_time(fn, (q_scaled, k_hf, v_hf, tables, lens), ref, args.smoke)
            except Exception as e:
                log(f"  bundled ({ppcb},{ks},{nw}) FAILED: {repr(e)[:300]}")
                continue
            log(f"  bundled ppcb={ppcb} k_splits={ks} warps={nw}: {t * 1e6:8.1f} us  "
                f"{kv_bytes / t / 1e12:5.2f} TB/s  err {err:.1e}")
            row["bundled"].append({"ppcb": ppcb, "k_splits": ks, "num_warps": nw,
                                   "us": t * 1e6, "err": err})
        if row["bundled"]:
            row["bundled_best_us"] = min(b["us"] for b in row["bundled"])
        results["decode"].append(row)
        del k, v, k_hf, v_hf
        if (len(shapes) > 3 and shape_i == 2) or args.smoke:
            write_report(args, results)          # partial results survive a timeout


def prefill_section(args, clock, results):
    interpret = args.smoke
    for wi, (name, seqs, q_len, ctx) in enumerate(prefill_work(args.smoke)):
        if clock.left() < 40:
            log("(time budget: skipping prefill)")
            break
        q, k, v, tables, lens, cu = prefill_inputs(wi, seqs, q_len, ctx)
        tokens = seqs * q_len
        pairs = q_len * (ctx - q_len) + q_len * (q_len + 1) // 2     # visible (q, k) pairs
        flops = 4 * seqs * Q_HEADS * HEAD_DIM * pairs
        row = {"name": name, "seqs": seqs, "q_len": q_len, "context": ctx, "flops": flops,
               "paxkv": []}
        log(f"\n== prefill {name}: {tokens} tokens, {flops / 1e9:.0f} GFLOP")
        # dense contiguous K/V for cuDNN and for an exact fp32 reference
        kc = k[tables].reshape(seqs, ctx, KV_HEADS, HEAD_DIM)
        vc = v[tables].reshape(seqs, ctx, KV_HEADS, HEAD_DIM)
        qd = q.reshape(seqs, q_len, Q_HEADS, HEAD_DIM)
        ref = dense_reference(qd, kc, vc).reshape(tokens, Q_HEADS, HEAD_DIM)
        impl = None if args.smoke else "cudnn"
        causal = q_len == ctx
        dense = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                          implementation=impl))
        try:
            t_d = time_call(dense, (qd, kc, vc), reps=3 if args.smoke else 7)
            row["cudnn_us"] = t_d * 1e6
            row["cudnn_causal"] = causal
            msg = ""
            if causal:
                row["cudnn_err"] = rel_err(dense(qd, kc, vc).reshape(ref.shape), ref)
                msg = f"  err {row['cudnn_err']:.1e}"
            log(f"  cuDNN dense {'causal' if causal else 'non-causal (upper bound)'}: "
                f"{t_d * 1e6:8.1f} us  {flops / t_d / 1e12:6.1f} TFLOP/s{msg}")
        except Exception as e:
            log(f"  cuDNN FAILED: {repr(e)[:300]}")
        tunings = [dict(block_q=bq, pages_per_compute_block=p, num_warps=w, num_stages=s)
                   for (bq, p, w, s) in (
                       ((32, 4, 4, 2), (32, 4, 4, 3), (32, 2, 4, 2), (64, 4, 8, 2),
                        (32, 8, 4, 2), (64, 2, 8, 2)) if args.quick else
                       ((32, 4, 4, 2), (32, 4, 8, 2), (16, 4, 4, 2), (32, 8, 8, 2),
                        (32, 4, 8, 3), (16, 8, 4, 2), (64, 4, 8, 2), (32, 8, 4, 3),
                        (16, 4, 4, 3), (32, 4, 4, 3), (32, 2, 4, 2), (64, 2, 8, 2)))]

        def run_ragged(tuning):
            fn = jax.jit(functools.partial(ragged_paged_attention, interpret=interpret, **tuning))
            t, err, _ = check_and_time(fn, (q, k, v, tables, lens, cu), ref, args.smoke)
            return t, err

        best = None
        for tuning in tunings:
            if clock.left() < 25:
                log("  (time budget: skipping remaining prefill tunings)")
                break
            t = measure_tuning(row["paxkv"], tuning, lambda: run_ragged(tuning),
                               lambda t: f"{flops / t / 1e12:6.1f} TFLOP/s")
            if t is not None and (best is None or t < best[0]):
                best = (t, tuning)
        if best is not None:
            row["best"] = {**best[1], "us": best[0] * 1e6}
        results["prefill"].append(row)
        del k, v, kc, vc
        write_report(args, results)


def mixed_check(args, results):
    """A small mixed batch (decode + chunk + prompt + padding) through the model backend."""
    from paxkv.cache.kv_pool import KVPool
    from paxkv.config import AttentionPlan, ModelConfig
    from paxkv.model.attention import PagedAttention, reference_attention
    from paxkv.model.batch import StepBatch
    rng = np.random.default_rng(9)
    q_lens, ctxs = [1, 37, 100, 0], [300, 77, 100, 0]
    seqs, tokens = len(q_lens), sum(q_lens) + 5
    mb = 24
    num_blocks = seqs * mb + 1
    k, v = make_pool(jax.random.key(5), num_blocks)
    tables = permuted_tables(3, seqs, mb, num_blocks)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pos = np.zeros(tokens, np.int32)
    for s in range(seqs):
        pos[cu[s]:cu[s + 1]] = ctxs[s] - q_lens[s] + np.arange(q_lens[s])
    batch = StepBatch(jnp.zeros(tokens, jnp.int32), jnp.asarray(pos),
                      jnp.zeros(tokens, jnp.int32), tables, jnp.asarray(ctxs, jnp.int32),
                      jnp.asarray(cu), jnp.asarray(cu[1:] - 1))
    q = jnp.asarray(rng.standard_normal((tokens, Q_HEADS, HEAD_DIM)), jnp.bfloat16)
    cfg = ModelConfig(vocab_size=16, hidden_size=Q_HEADS * HEAD_DIM, intermediate_size=16,
                      num_layers=1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    attention = PagedAttention(cfg, batch, AttentionPlan("pallas"))
    attention.interpret = args.smoke
    out = attention.attend(q, KVPool((k,), (v,)), batch)
    ref = reference_attention(q, k, v, batch, HEAD_DIM ** -0.5)
    n = int(cu[-1])
    err = rel_err(out[:n], ref[:n])
    results["mixed_backend_err"] = err
    results["mixed_backend_finite"] = bool(jnp.isfinite(out).all())
    log(f"\nmixed batch through PagedAttention (pallas) vs reference_attention: err {err:.1e}, "
        f"finite {results['mixed_backend_finite']}")


def write_report(args, results) -> str:
    bw = results.get("bandwidth", {})
    copy = bw.get("torch_copy_tbps") or bw.get("xla_elementwise_tbps")
    lines = [f"JAX {jax.__version__}, {results.get('device', '?')}", ""]
    lines.append(f"Copy bandwidth (bytes read + written): device-to-device memcpy "
                 f"{fmt(bw.get('torch_copy_tbps'), '{:.2f}')} TB/s, XLA elementwise "
                 f"{fmt(bw.get('xla_elementwise_tbps'), '{:.2f}')} TB/s")
    lines += ["", "Decode (32 q / 8 kv heads, d=128, block 16, bf16, permuted pages):", "",
              "| batch | context | paxkv best (us) | tuning (ppcb, splits, warps, stages) | "
              "achieved | of copy bw | bundled best here (us) | bundled ref. figure (us) | "
              "speedup vs bundled here | contiguous (us) | paging overhead | heads_first (us) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results["decode"]:
        best = r.get("best")
        t = best["us"] if best else None
        tb = r["kv_bytes"] / (t * 1e-6) / 1e12 if t else None
        bb = r.get("bundled_best_us")
        tun = (f"{best['pages_per_compute_block']}, {best['num_splits']}, {best['num_warps']}, "
               f"{best['num_stages']}") if best else "-"
        lines.append(
            f"| {r['batch']} | {r['context']} | {fmt(t, '{:.1f}')} | {tun} | "
            f"{fmt(tb, '{:.2f}')} TB/s | {fmt(tb / copy * 100 if tb and copy else None, '{:.0f}')}% | "
            f"{fmt(bb, '{:.1f}')} | {BUNDLED_BEST.get((r['batch'], r['context']), '-')} | "
            f"{fmt(bb / t if bb and t else None, '{:.2f}')}x | "
            f"{fmt(r.get('contiguous_us'), '{:.1f}')} | "
            f"{fmt((t / r['contiguous_us'] - 1) * 100 if t and r.get('contiguous_us') else None, '{:+.1f}')}% | "
            f"{fmt(r.get('heads_first_us'), '{:.1f}')} |")
    lines += ["", "Prefill (bf16, permuted pages) vs cuDNN dense attention on the same tokens:", "",
              "| workload | tokens | paxkv best (us) | tuning (block_q, ppcb, warps, stages) | "
              "TFLOP/s | cuDNN (us) | paxkv / cuDNN |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results["prefill"]:
        best = r.get("best")
        t = best["us"] if best else None
        tun = (f"{best['block_q']}, {best['pages_per_compute_block']}, {best['num_warps']}, "
               f"{best['num_stages']}") if best else "-"
        c = r.get("cudnn_us")
        note = "" if r.get("cudnn_causal", True) else " (cuDNN non-causal)"
        lines.append(f"| {r['name']}{note} | {r['seqs'] * r['q_len']} | {fmt(t, '{:.1f}')} | "
                     f"{tun} | {fmt(r['flops'] / (t * 1e-6) / 1e12 if t else None, '{:.0f}')} | "
                     f"{fmt(c, '{:.1f}')} | {fmt(t / c if t and c else None, '{:.2f}')}x |")
    if "mixed_backend_err" in results:
        lines += ["", f"Mixed batch through the pallas backend vs reference_attention: rel. err "
                      f"{results['mixed_backend_err']:.1e}, all outputs finite: "
                      f"{results['mixed_backend_finite']}"]
    text = "\n".join(lines) + "\n"
    save_report(args.out, "kernels", text, results)
    return text


def main() -> None:
    args = parse_args(__doc__, budget_s=420.0, quick_help="fewer tunings (near-best ones)",
                      sections="decode,prefill")
    run_sections(args, [("mixed", lambda a, _clock, r: mixed_check(a, r)),
                        ("decode", decode_section), ("prefill", prefill_section)], write_report)


if __name__ == "__main__":
    main()

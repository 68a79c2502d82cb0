"""Decode and prefill kernels side by side on one GPU, in one run: paxkv's Triton and Mosaic
GPU kernels, JAX's bundled Pallas paged attention and cuDNN.

Decode: the five shapes of the reference figures (32 query / 8 KV heads, head_dim 128,
block 16, randomly permuted pages, every sequence at the full context), each at the
kernels' default tuning (what the engine runs):
- bf16 pages: paxkv `backend="triton"`, `backend="mosaic"` (and a few Mosaic tunings), and
  JAX's bundled kernel (`jax.experimental.pallas.ops.gpu.paged_attention`) at its best tuning
  from the reference figures;
- fp8 e4m3 and int8 pages with per-(token, head) bf16 scales: paxkv's Triton kernel with
  bf16 dot operands and with float16 ones (`dot_dtype`; the default is
  `tuning.default_dot_dtype`), against bf16 pages.
Prefill: 8 x 2048 causal prompts, paxkv's ragged Triton kernel and its Mosaic GPU kernel
(`backend="mosaic"`, default tuning and a few others) against cuDNN dense attention
(`jax.nn.dot_product_attention(implementation="cudnn")`) on the same tokens.

Every variant is checked against the fp32 jnp reference on the GPU before it is timed; a
variant off by more than its tolerance is reported WRONG and the run exits non-zero.
Timing: median over repeats of 8 chained calls in one executable (scripts/bench_common.py),
after compile and warm-up; the copy bandwidth is measured in the same run.

    PYTHONPATH=. python3 scripts/bench_decode_backends.py --out results/decode_backends
    PYTHONPATH=. python3 scripts/bench_decode_backends.py --smoke     # CPU, interpret mode
"""
from __future__ import annotations

import functools
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels.paged_attention import (  # noqa: E402
    mosaic_decode,
    paged_attention,
    paged_attention_reference,
    tuning,
)
from pallas_kernels.ragged_paged_attention import ragged_paged_attention  # noqa: E402
from scripts.bench_common import (  # noqa: E402
    HEAD_DIM,
    KV_HEADS,
    Q_HEADS,
    check_and_time,
    decode_inputs,
    decode_shapes,
    fmt,
    log,
    parse_args,
    prefill_inputs,
    prefill_work,
    run_sections,
    save_report,
)
from scripts.bench_kernels import BUNDLED_TUNINGS, dense_reference  # noqa: E402
from scripts.bench_kv_quant import page_bytes, quantize_pages  # noqa: E402

TOL = 2e-2                      # bf16 outputs (and bf16 / fp16 probabilities) vs fp32
# Mosaic GPU tunings beside its default (8 pages = 128 tokens a step, 2 stages, one
# warpgroup): 64-token steps fit two blocks per SM; "ws" adds a producer warpgroup.
MOSAIC_TUNINGS = ({}, {"warp_specialized": True},
                  {"pages_per_compute_block": 4, "num_stages": 2, "warp_specialized": True})
# Mosaic GPU prefill tunings beside its default (64-row query tiles, 128-token key steps,
# 2 stages, a producer warpgroup): one warpgroup, and 64-token steps with 3 stages.
MOSAIC_PREFILL_TUNINGS = ({}, {"warp_specialized": False},
                          {"pages_per_compute_block": 4, "num_stages": 3})
FORMATS_8BIT = ("fp8", "int8")


def tuning_label(variant: dict) -> str:
    """" p4 n2 ws" for {"pages_per_compute_block": 4, "num_stages": 2, ...}."""
    parts = []
    if "pages_per_compute_block" in variant:
        parts.append(f"p{variant['pages_per_compute_block']}")
    if "num_stages" in variant:
        parts.append(f"n{variant['num_stages']}")
    if variant.get("warp_specialized"):
        parts.append("ws")
    elif variant.get("warp_specialized") is False:
        parts.append("1wg")
    return "".join(" " + p for p in parts)


def record(row, label, fn, args, ref, smoke, work, failures, unit="TB/s"):
    """Check `fn(*args)` against `ref`, time it, log and store it under `label`; `work` is
    the bytes (or FLOPs, `unit="TFLOP/s"`) one call moves."""
    try:
        t, err, _ = check_and_time(fn, args, ref, smoke)
    except Exception as e:  # a variant that does not compile is reported, not fatal
        msg = repr(e)
        log(f"  {label:28s} FAILED: {msg[:1500]}")
        row[label] = {"error": msg[:3000]}
        return None
    ok = err < TOL
    if not ok:
        failures.append(f"{label} B={row['batch']} ctx={row['context']}: err {err:.1e}")
    log(f"  {label:28s} {t * 1e6:8.1f} us  {work / t / 1e12:6.2f} {unit}  err {err:.1e}"
        f"{'' if ok else '  WRONG'}")
    row[label] = {"us": t * 1e6, "err": err, "ok": ok,
                  ("tbps" if unit == "TB/s" else "tflops"): work / t / 1e12}
    return t


def decode_section(args, clock, results):
    failures = results.setdefault("failures", [])
    for shape_i, (batch, ctx) in enumerate(decode_shapes(args.smoke, args.shapes)):
        if clock.left() < 30:
            log("(time budget: skipping remaining decode shapes)")
            break
        q, k, v, tables, lens = decode_inputs(shape_i, batch, ctx)
        row = {"batch": batch, "context": ctx}
        log(f"\n== decode B={batch} ctx={ctx}")
        nbytes = page_bytes(batch, ctx, "bfloat16")
        ref = paged_attention_reference(q, k, v, tables, lens)
        backends = {"triton": ["triton"], "mosaic": ["mosaic"]}.get(args.backend,
                                                                    ["triton", "mosaic"])
        for backend in backends:
            variants = MOSAIC_TUNINGS if backend == "mosaic" else ({},)
            for variant in variants:
                label = f"bf16 {backend}" + tuning_label(variant)
                if backend == "mosaic" and args.smoke and mosaic_decode.interpret_params() is None:
                    continue                     # no Mosaic GPU interpret mode before JAX 0.12
                fn = jax.jit(functools.partial(paged_attention, backend=backend,
                                               interpret=args.smoke, **variant))
                record(row, label, fn, (q, k, v, tables, lens), ref, args.smoke, nbytes, failures)
        if not args.smoke and (batch, ctx) in BUNDLED_TUNINGS and clock.left() > 40:
            from jax.experimental.pallas.ops.gpu import paged_attention as bundled
            ppcb, ks, nw = BUNDLED_TUNINGS[(batch, ctx)]
            fn = jax.jit(functools.partial(bundled.paged_attention, pages_per_compute_block=ppcb,
                                           k_splits=ks, num_warps=nw))
            q_scaled = (q.astype(jnp.float32) * HEAD_DIM ** -0.5).astype(q.dtype)
            k_hf, v_hf = jnp.moveaxis(k, 2, 0), jnp.moveaxis(v, 2, 0)
            record(row, "bf16 bundled (best tuning)", fn, (q_scaled, k_hf, v_hf, tables, lens),
                   ref, args.smoke, nbytes, failures)
            del k_hf, v_hf
        for name in FORMATS_8BIT:
            if clock.left() < 25:
                break
            kk, ks = quantize_pages(k, name)
            vv, vs = quantize_pages(v, name)
            ref8 = paged_attention_reference(q, kk, vv, tables, lens, ks, vs)
            default = tuning.default_dot_dtype(kk.dtype, q.dtype) or "bfloat16"
            for dot in ((default,) if args.quick else ("bfloat16", "float16")):
                label = f"{name} triton dot {dot}" + (" (default)" if dot == default else "")
                fn = jax.jit(functools.partial(paged_attention, backend="triton", dot_dtype=dot,
                                               interpret=args.smoke))
                record(row, label, fn, (q, kk, vv, tables, lens, ks, vs), ref8, args.smoke,
                       page_bytes(batch, ctx, name), failures)
            del kk, vv, ks, vs
        results["decode"].append(row)
        write_report(args, results)


def prefill_section(args, clock, results):
    failures = results.setdefault("failures", [])
    name, seqs, q_len, ctx = prefill_work(args.smoke)[0]
    if clock.left() < 25:
        return
    q, k, v, tables, lens, cu = prefill_inputs(0, seqs, q_len, ctx)
    tokens = seqs * q_len
    flops = 4 * seqs * Q_HEADS * HEAD_DIM * (q_len * (q_len + 1) // 2)
    row = {"name": name, "flops": flops, "batch": seqs, "context": ctx}
    log(f"\n== prefill {name}")
    kc = k[tables].reshape(seqs, ctx, KV_HEADS, HEAD_DIM)
    vc = v[tables].reshape(seqs, ctx, KV_HEADS, HEAD_DIM)
    qd = q.reshape(seqs, q_len, Q_HEADS, HEAD_DIM)
    ref = dense_reference(qd, kc, vc).reshape(tokens, Q_HEADS, HEAD_DIM)
    impl = None if args.smoke else "cudnn"
    dense = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                      implementation=impl))
    record(row, "cudnn dense", dense, (qd, kc, vc), ref.reshape(qd.shape), args.smoke, flops, failures, "TFLOP/s")
    fn = jax.jit(functools.partial(ragged_paged_attention, interpret=args.smoke))
    record(row, "ragged triton", fn, (q, k, v, tables, lens, cu), ref, args.smoke, flops,
           failures, "TFLOP/s")
    if args.backend != "triton" and not (args.smoke and mosaic_decode.interpret_params() is None):
        for variant in MOSAIC_PREFILL_TUNINGS:       # no Mosaic GPU interpret mode before 0.12
            if clock.left() < 20:
                break
            fn = jax.jit(functools.partial(ragged_paged_attention, backend="mosaic",
                                           interpret=args.smoke, **variant))
            record(row, "ragged mosaic" + tuning_label(variant), fn,
                   (q, k, v, tables, lens, cu), ref, args.smoke, flops, failures, "TFLOP/s")
    results["prefill"].append(row)


def write_report(args, results) -> str:
    bw = results.get("bandwidth", {})
    copy = bw.get("torch_copy_tbps") or bw.get("xla_elementwise_tbps")
    lines = [f"JAX {jax.__version__}, {results.get('device', '?')}", "",
             f"Copy bandwidth (read + write): memcpy {fmt(bw.get('torch_copy_tbps'), '{:.2f}')} "
             f"TB/s, XLA elementwise {fmt(bw.get('xla_elementwise_tbps'), '{:.2f}')} TB/s", "",
             "Decode, default tuning (us; % = of copy bandwidth; 8-bit: x = vs bf16 triton):", "",
             "| batch | context | variant | us | TB/s | of copy bw | vs bf16 triton | err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results["decode"]:
        base = r.get("bf16 triton", {}).get("us")
        for label, cell in r.items():
            if not isinstance(cell, dict):
                continue
            t = cell.get("us")
            tb = cell.get("tbps")
            lines.append(
                f"| {r['batch']} | {r['context']} | {label} | {fmt(t)} | {fmt(tb, '{:.2f}')} | "
                f"{fmt(tb / copy * 100 if tb and copy else None, '{:.0f}')}% | "
                f"{fmt(t / base if t and base else None, '{:.2f}')}x | "
                f"{fmt(cell.get('err'), '{:.1e}') if 'err' in cell else 'FAILED'} |")
    for r in results["prefill"]:
        c = r.get("cudnn dense", {}).get("us")
        lines += ["", f"Prefill {r['name']} (causal):", "",
                  "| variant | us | TFLOP/s | vs cuDNN | err |", "| --- | --- | --- | --- | --- |"]
        for label, cell in r.items():
            if not isinstance(cell, dict):
                continue
            t = cell.get("us")
            lines.append(f"| {label} | {fmt(t)} | "
                         f"{fmt(r['flops'] / (t * 1e-6) / 1e12 if t else None, '{:.0f}')} | "
                         f"{fmt(t / c if t and c else None, '{:.2f}')}x | "
                         f"{fmt(cell.get('err'), '{:.1e}') if 'err' in cell else 'FAILED'} |")
    if results.get("failures"):
        lines += ["", "WRONG (over tolerance): " + "; ".join(results["failures"])]
    text = "\n".join(lines) + "\n"
    save_report(args.out, "decode_backends", text, results)
    return text


def main() -> None:
    parser_doc = __doc__
    args = parse_args(parser_doc, budget_s=200.0,
                      quick_help="default tunings only (8-bit: the default dot dtype)",
                      sections="decode,prefill")
    results = run_sections(args, [("decode", decode_section), ("prefill", prefill_section)],
                           write_report)
    if results.get("failures"):
        raise SystemExit("variants over tolerance: " + "; ".join(results["failures"]))


if __name__ == "__main__":
    main()

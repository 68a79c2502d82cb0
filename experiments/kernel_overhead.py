"""What reading the KV cache through block tables costs the attention kernel (the paper's
Fig. 18a: its PagedAttention kernel is 20-26% slower than FasterTransformer's kernel on a
contiguous cache).

Two sources, kept apart in the tables:

1. The kernel benchmark (`scripts/bench_kernels.py`, run on an NVIDIA H200; its
   `results/kernels.json` is read when present): paxkv's Pallas decode kernel on randomly
   permuted pages against the same kernel on an identity block table (a contiguous cache).
2. This run: decode attention at Llama-3-8B's head shapes (32 query / 8 KV heads, d=128) over
   random pages, timed here. Backends: "pallas" (the GPU kernel, on permuted pages, on an
   identity table, and XLA's plain attention over a contiguous `[batch, len, heads, d]`
   cache as the contiguous baseline) and "reference" (the jnp reference that gathers every
   page through the block table, against the same jnp attention on a contiguous cache). On a
   CPU only the reference runs, at small shapes: a smoke-level stand-in for the kernel
   figure, which measures what a gather costs XLA on a CPU, not what paging costs a kernel.

    PYTHONPATH=. python3 experiments/kernel_overhead.py                 # CPU: reference only
    PYTHONPATH=. python3 experiments/kernel_overhead.py --setting=gpu   # the Pallas kernel too
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import time
from typing import Any, Callable

import numpy as np
from absl import app, flags

from configs import experiments as configs
from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_enum("setting", "cpu", ["cpu", "gpu", "tiny"], "Which settings of configs/experiments.py to use.")
flags.DEFINE_string("out_dir", "scratch/results", "Where to write NAME.json/.png/.md (gpu setting: NAME_gpu.*) (--out_dir=results updates the committed results)")
flags.DEFINE_string("kernels_json", None, "Override the kernel benchmark's json to read.")

NAME = "kernel_overhead"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_kernel_benchmark(path: str) -> dict[str, Any] | None:
    """Decode rows of the kernel benchmark: paged (best tuning) against the identity table."""
    full = path if os.path.isabs(path) else os.path.join(ROOT, path)
    if not os.path.exists(full):
        return None
    with open(full) as f:
        data = json.load(f)
    rows = []
    for r in data.get("decode", []):
        paged = (r.get("best") or {}).get("us")
        contig = r.get("contiguous_us")
        if paged is None or contig is None:
            continue
        rows.append({"batch": r["batch"], "context": r["context"], "paged_us": paged, "contiguous_us": contig,
                     "overhead": paged / contig - 1.0, "bundled_best_us": r.get("bundled_best_us"),
                     "kv_bytes": r.get("kv_bytes")})
    return {"path": path, "device": data.get("device"), "jax": data.get("jax"), "decode": rows}


def contiguous_attention(q, k, v, lens, scale: float):
    """Decode attention over a contiguous cache `[batch, len, kv_heads, d]` (fp32 softmax)."""
    import jax.numpy as jnp
    b, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d)
    s = jnp.einsum("bhgd,blhd->bhgl", qg, k.astype(jnp.float32)) * scale
    valid = jnp.arange(k.shape[1])[None, :] < lens[:, None]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    o = jnp.einsum("bhgl,blhd->bhgd", p, v.astype(jnp.float32)) / jnp.sum(p, axis=-1, keepdims=True)
    return o.reshape(b, hq, d).astype(q.dtype)


def time_fns(fns: dict[str, tuple[Callable, tuple]], reps: int) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved (A, B, A, B, ...) so
    that drift in a shared machine's load hits every variant alike; compiled and warmed first."""
    import jax
    for fn, args in fns.values():
        jax.block_until_ready(fn(*args))
        jax.block_until_ready(fn(*args))
    ts: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, (fn, args) in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in ts.items()}


def measure(s: configs.KernelOverheadSettings) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.paged_attention import paged_attention_reference

    dtype = jnp.bfloat16 if s.dtype == "bfloat16" else jnp.float32
    scale = s.head_dim ** -0.5
    rows = []
    for i, (batch, ctx) in enumerate(s.shapes):
        pages = -(-ctx // s.block_size)
        num_blocks = batch * pages + 1
        key = jax.random.key(s.seed + i)
        kk, kv, kq = jax.random.split(key, 3)
        shape = (num_blocks, s.block_size, s.kv_heads, s.head_dim)
        k_pages = jax.random.normal(kk, shape, dtype)
        v_pages = jax.random.normal(kv, shape, dtype)
        q = jax.random.normal(kq, (batch, s.q_heads, s.head_dim), dtype)
        rng = np.random.default_rng(s.seed + i)
        perm = jnp.asarray(rng.permutation(np.arange(1, num_blocks)).reshape(batch, pages).astype(np.int32))
        ident = jnp.asarray((1 + np.arange(batch * pages)).reshape(batch, pages).astype(np.int32))
        lens = jnp.full((batch,), ctx, jnp.int32)
        # The same keys and values laid out contiguously per sequence (materialized once).
        k_con = k_pages[perm].reshape(batch, pages * s.block_size, s.kv_heads, s.head_dim)
        v_con = v_pages[perm].reshape(batch, pages * s.block_size, s.kv_heads, s.head_dim)
        kv_bytes = 2 * batch * ctx * s.kv_heads * s.head_dim * jnp.dtype(dtype).itemsize
        contig = jax.jit(functools.partial(contiguous_attention, scale=scale))
        want = np.asarray(contig(q, k_con, v_con, lens), np.float32)
        fns: dict[str, tuple[Callable, tuple]] = {"contiguous_xla": (contig, (q, k_con, v_con, lens))}
        row: dict[str, Any] = {"batch": batch, "context": ctx, "kv_bytes": kv_bytes}
        tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4

        def check(out: Any, what: str) -> float:
            err = float(np.max(np.abs(np.asarray(out, np.float32) - want)) / (np.max(np.abs(want)) + 1e-9))
            if not err < tol:
                raise AssertionError(f"{what} at batch {batch}, context {ctx} differs from contiguous attention: "
                                     f"relative error {err:.2e} > {tol:g}")
            return err

        for backend in s.backends:
            if backend == "reference":
                fn = jax.jit(functools.partial(paged_attention_reference, scale=scale))
                row["reference_err"] = check(fn(q, k_pages, v_pages, perm, lens), "reference paged attention")
                fns["reference_paged"] = (fn, (q, k_pages, v_pages, perm, lens))
            elif backend == "pallas":
                from pallas_kernels.paged_attention import paged_attention
                # Off a GPU the kernel runs in Pallas interpret mode: a check of this path, not a timing.
                fn = jax.jit(functools.partial(paged_attention, scale=scale,
                                               interpret=jax.default_backend() != "gpu"))
                row["pallas_err"] = check(fn(q, k_pages, v_pages, perm, lens), "Pallas paged attention")
                fns["pallas_paged"] = (fn, (q, k_pages, v_pages, perm, lens))
                # Identity table: the same kernel reading each sequence's pages in order.
                k_id = jnp.concatenate([k_pages[:1], k_con.reshape(-1, s.block_size, s.kv_heads, s.head_dim)])
                v_id = jnp.concatenate([v_pages[:1], v_con.reshape(-1, s.block_size, s.kv_heads, s.head_dim)])
                check(fn(q, k_id, v_id, ident, lens), "Pallas attention on an identity table")
                fns["pallas_identity"] = (fn, (q, k_id, v_id, ident, lens))
            else:
                raise ValueError(f"backends: unknown backend {backend!r} (reference, pallas)")
        for name, t in time_fns(fns, s.reps).items():
            row[f"{name}_us"] = t * 1e6
        if "reference_paged_us" in row:
            row["reference_overhead"] = row["reference_paged_us"] / row["contiguous_xla_us"] - 1.0
        if "pallas_paged_us" in row:
            row["pallas_overhead_vs_identity"] = row["pallas_paged_us"] / row["pallas_identity_us"] - 1.0
            row["pallas_vs_contiguous_xla"] = row["pallas_paged_us"] / row["contiguous_xla_us"] - 1.0
        rows.append(row)
        del fns, k_pages, v_pages, k_con, v_con
    return rows


def _fig(bench: dict[str, Any] | None, rows: list[dict[str, Any]], s: configs.KernelOverheadSettings):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.3))
    lo, hi = common.PAPER["kernel_slowdown_vs_contiguous"]
    ax.axhspan(100 * lo, 100 * hi, color="grey", alpha=0.2, label="paper: PagedAttention vs FasterTransformer")
    labels, series = [], {}
    if bench:
        for r in bench["decode"]:
            labels.append(f"B{r['batch']}\nL{r['context']}\n(bench)")
            series.setdefault("bench: Pallas, permuted vs identity table", []).append((len(labels) - 1, r["overhead"]))
    for r in rows:
        labels.append(f"B{r['batch']}\nL{r['context']}")
        x = len(labels) - 1
        if "pallas_overhead_vs_identity" in r:
            series.setdefault("this run: Pallas, permuted vs identity table", []).append(
                (x, r["pallas_overhead_vs_identity"]))
            series.setdefault("this run: Pallas paged vs XLA contiguous", []).append((x, r["pallas_vs_contiguous_xla"]))
        if "reference_overhead" in r:
            series.setdefault("this run: jnp reference paged vs jnp contiguous", []).append(
                (x, r["reference_overhead"]))
    # Bars of one x side by side, centred on it, whatever series have a value there.
    at: dict[int, list[str]] = {}
    for name, pts in series.items():
        for x, _ in pts:
            at.setdefault(x, []).append(name)
    width = 0.8 / max((len(v) for v in at.values()), default=1)
    for name, pts in series.items():
        xs = [x + (at[x].index(name) - (len(at[x]) - 1) / 2) * width for x, _ in pts]
        ax.bar(xs, [100 * y for _, y in pts], width=width, label=name)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("extra latency of paged attention (%)")
    ax.set_title("Cost of reading the KV cache through block tables (decode)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _tables(bench: dict[str, Any] | None, rows: list[dict[str, Any]], s: configs.KernelOverheadSettings,
            hardware: str) -> tuple[str, str]:
    lo, hi = common.PAPER["kernel_slowdown_vs_contiguous"]
    paper = f"+{100 * lo:.0f}% to +{100 * hi:.0f}% (vs FasterTransformer)"
    parts = []
    head = [["paper: PagedAttention kernel over a contiguous kernel", paper]]
    if bench and bench["decode"]:
        ov = [r["overhead"] for r in bench["decode"]]
        head.append([f"paxkv Pallas kernel, permuted pages over an identity table ({bench['device']}, "
                     "kernel benchmark)", f"{100 * min(ov):+.1f}% to {100 * max(ov):+.1f}%"])
    pal = [r for r in rows if "pallas_overhead_vs_identity" in r]
    if pal:
        head.append(["same, this run", f"{100 * min(r['pallas_overhead_vs_identity'] for r in pal):+.1f}% to "
                                       f"{100 * max(r['pallas_overhead_vs_identity'] for r in pal):+.1f}%"])
        head.append(["paxkv Pallas kernel (paged) over XLA attention on a contiguous cache, this run",
                     f"{100 * min(r['pallas_vs_contiguous_xla'] for r in pal):+.1f}% to "
                     f"{100 * max(r['pallas_vs_contiguous_xla'] for r in pal):+.1f}%"])
    ref = [r for r in rows if "reference_overhead" in r]
    if ref:
        head.append(["jnp reference (gather through the block table) over jnp on a contiguous cache, this run"
                     + (" (CPU stand-in, small shapes)" if "CPU" in hardware else ""),
                     f"{100 * min(r['reference_overhead'] for r in ref):+.1f}% to "
                     f"{100 * max(r['reference_overhead'] for r in ref):+.1f}%"])
    parts.append("## Against the paper (Fig. 18a)\n\n"
                 + common.markdown_table(["what", "extra latency of paging"], head))
    if bench and bench["decode"]:
        parts.append(
            f"## Kernel benchmark ({bench['device']}, JAX {bench['jax']}; `{bench['path']}`)\n\n"
            + common.markdown_table(
                ["batch", "context", "paged, permuted (us)", "identity table (us)", "overhead",
                 "JAX's bundled kernel, best (us)"],
                [[r["batch"], r["context"], f"{r['paged_us']:.1f}", f"{r['contiguous_us']:.1f}",
                  f"{100 * r['overhead']:+.1f}%",
                  f"{r['bundled_best_us']:.1f}" if r.get("bundled_best_us") else "-"] for r in bench["decode"]]))
    cols = ["batch", "context", "XLA contiguous (us)"]
    if ref:
        cols += ["jnp paged reference (us)", "reference overhead"]
    if pal:
        cols += ["Pallas paged (us)", "Pallas identity table (us)", "vs identity", "vs XLA contiguous"]
    lines = []
    for r in rows:
        cells = [r["batch"], r["context"], f"{r['contiguous_xla_us']:.1f}"]
        if ref:
            cells += [f"{r['reference_paged_us']:.1f}", f"{100 * r['reference_overhead']:+.1f}%"]
        if pal:
            cells += [f"{r['pallas_paged_us']:.1f}", f"{r['pallas_identity_us']:.1f}",
                      f"{100 * r['pallas_overhead_vs_identity']:+.1f}%", f"{100 * r['pallas_vs_contiguous_xla']:+.1f}%"]
        lines.append(cells)
    parts.append(f"## This run ({hardware})\n\n" + common.markdown_table(cols, lines))
    if pal and "CPU" in hardware:
        parts.append("The Pallas figures of this run come from interpret mode on a CPU: a check that the "
                     "kernel agrees with the contiguous attention, not a timing.")
    notes = (
        f"This run: decode attention, {s.q_heads} query / {s.kv_heads} KV heads, head_dim {s.head_dim}, block size "
        f"{s.block_size}, {s.dtype}, every sequence at the full context, pages randomly permuted in the pool; median "
        f"of {s.reps} calls after compilation, each output checked against the contiguous attention. \"XLA "
        "contiguous\" is plain jnp attention (fp32 softmax) over each sequence's keys and values stored "
        "contiguously, `[batch, len, kv_heads, d]`; \"identity table\" is the paged kernel reading a pool whose "
        "pages are in sequence order. The paper's baseline is FasterTransformer's hand-written contiguous kernel; "
        "ours are the same Pallas kernel on an in-order table (the cost of the indirection alone) and XLA's "
        "attention on a contiguous cache. On a CPU only the jnp reference runs: its overhead is the cost of "
        "materializing the gathered pages, a smoke-level stand-in, not a kernel figure.")
    return "\n\n".join(parts), notes


def main(argv: list[str]) -> None:
    del argv
    s = configs.get(NAME, FLAGS.setting)
    if FLAGS.kernels_json:
        s = dataclasses.replace(s, kernels_json=FLAGS.kernels_json)
    import jax
    bench = read_kernel_benchmark(s.kernels_json)
    rows = measure(s)
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        import platform
        hardware = f"CPU only ({platform.machine()}, {os.cpu_count()} cores), JAX {jax.__version__}"
    else:
        hardware = f"{dev.device_kind}, JAX {jax.__version__}"
    table, notes = _tables(bench, rows, s, hardware)
    # The GPU setting gets its own files, so that CPU and GPU results live side by side.
    paths = common.write_results(
        NAME + ("_gpu" if FLAGS.setting == "gpu" else ""), FLAGS.out_dir,
        title="Paged against contiguous attention: the kernel's cost of paging (paper Fig. 18a)",
        command=common.command_line(), hardware=hardware, settings=dataclasses.asdict(s),
        results={"this_run": rows, "kernel_benchmark": bench,
                 "paper": {"kernel_slowdown_vs_contiguous": common.PAPER["kernel_slowdown_vs_contiguous"]}},
        table=table, notes=notes, figure=_fig(bench, rows, s))
    print(table)
    print("wrote", ", ".join(paths.values()))


if __name__ == "__main__":
    app.run(main)

"""The mixture-of-experts block alone, against the weights-read floor of the experts it touches,
and the grouped matmul under it, against the same floor and the GEMM rate measured in the
same run.

- MoE layer (`paxkv/model/moe.py`: router, sort by expert, three grouped matmuls, unsort) of
  each model shape at batch 1, 8, 64 and 256 (one token per sequence, as in decode): median
  device time against (router + the distinct experts the batch's routing chose) bytes over
  the copy bandwidth measured in the run.
- The up-projection alone (`jax.lax.ragged_dot`, Mixtral's 8 experts, 4096 -> 14336, top-2,
  rows sorted by expert) at 1-1024 tokens: against the floor of the experts touched, and
  at large counts against the bf16 rate of a dense GEMM of the same width measured here.

    PYTHONPATH=. python3 scripts/bench_moe.py --out_dir DIR           # GPU
    PYTHONPATH=. python3 scripts/bench_moe.py --smoke --out_dir DIR   # CPU: tiny shapes

Writes bench_moe.{json,md,png} to --out_dir.
"""
from __future__ import annotations

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mixtral-8x7b", "qwen3-30b-a3b"], "presets whose MoE layer is timed")
flags.DEFINE_list("batches", ["1", "8", "64", "256"], "tokens per MoE-layer call")
flags.DEFINE_list("up_tokens", ["1", "8", "64", "256", "1024"], "tokens of the up-projection runs")
flags.DEFINE_bool("smoke", False, "tiny shapes on the CPU: checks the script, times nothing real")
flags.DEFINE_string("out_dir", "scratch/bench_moe", "where the json, markdown and png go")


def _moe_layer(cfg, key):
    """(params, apply) of one MoE layer of `cfg` in bf16, random weights."""
    import jax
    import jax.numpy as jnp

    from paxkv.model.moe import SparseMoE
    module = SparseMoE(cfg, jnp.bfloat16)
    x = jnp.zeros((1, cfg.hidden_size), jnp.bfloat16)
    params = jax.jit(module.init)(key, x)
    return params, jax.jit(module.apply)


def _touched(params, cfg, x) -> int:
    """Distinct experts the routing of `x` chooses."""
    import jax.numpy as jnp
    import numpy as np

    from paxkv.model.moe import route
    router = params["params"]["router"]["kernel"]
    _, experts = route(jnp.asarray(x) @ router, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    return len(np.unique(np.asarray(experts)))


def moe_rows(bw_tbps: float, winners: tuple = ()) -> list[dict]:
    """The MoE layer at each batch, with XLA's grouped matmul and, where `winners` (a tuning
    table measured in this run) is not empty, with the Pallas kernel where it wins."""
    import jax
    import jax.numpy as jnp

    from bench_common import time_call
    from pallas_kernels.grouped_matmul import tuning
    from paxkv.config import get_preset
    rows = []
    for name in FLAGS.models:
        cfg = get_preset(name)
        if FLAGS.smoke:
            import dataclasses
            cfg = dataclasses.replace(cfg, hidden_size=64, moe_intermediate_size=32,
                                      num_heads=4, num_kv_heads=2, head_dim=16)
        expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
        router_bytes = cfg.hidden_size * cfg.num_experts * 2
        for table, label in (((), "xla"), (winners, "pallas where it wins")):
            if label != "xla" and not winners:
                continue
            saved, tuning.WINNERS = tuning.WINNERS, table   # read when the layer is traced
            try:
                params, apply = _moe_layer(cfg, jax.random.key(0))
                for t in (int(b) for b in FLAGS.batches):
                    x = jax.random.normal(jax.random.key(t), (t, cfg.hidden_size), jnp.bfloat16)
                    touched = _touched(params, cfg, x)
                    seconds = time_call(lambda x: apply(params, x), (x,), reps=3 if FLAGS.smoke else 9)
                    floor = (router_bytes + touched * expert_bytes + 2 * t * cfg.hidden_size * 2) / (bw_tbps * 1e12)
                    rows.append({"model": name, "grouped_matmul": label, "tokens": t,
                                 "experts_touched": touched, "us": seconds * 1e6,
                                 "floor_us": floor * 1e6, "fraction_of_floor": floor / seconds})
                    print(rows[-1], flush=True)
            finally:
                tuning.WINNERS = saved
    return rows


def up_projection_rows(bw_tbps: float) -> tuple[list[dict], dict]:
    """Mixtral's up-projection over sorted rows: one ragged_dot, and the Pallas kernel at each
    candidate tile shape (checked against ragged_dot's output); the dense GEMM rate."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tqdm import tqdm

    from bench_common import rel_err, time_call
    from pallas_kernels.grouped_matmul import grouped_matmul as pallas_gmm
    from pallas_kernels.grouped_matmul.tuning import CANDIDATES
    from paxkv.model.moe import expert_order, grouped_matmul
    e, k, h, i = (8, 2, 4096, 14336) if not FLAGS.smoke else (8, 2, 64, 96)
    w = jax.random.normal(jax.random.key(1), (e, h, i), jnp.bfloat16) * 0.02
    dense_m = 1024 if not FLAGS.smoke else 16
    a = jax.random.normal(jax.random.key(2), (dense_m, h), jnp.bfloat16)
    gemm = jax.jit(lambda a: jnp.dot(a, w[0]))
    gemm_s = time_call(gemm, (a,), chain=False, reps=3 if FLAGS.smoke else 9)
    gemm_tflops = 2 * dense_m * h * i / gemm_s / 1e12
    interpret = jax.default_backend() != "gpu"
    candidates = CANDIDATES[:2] if FLAGS.smoke else CANDIDATES
    rows = []
    for t in (int(x) for x in FLAGS.up_tokens):
        rng = np.random.default_rng(t)
        experts = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
        order, counts = expert_order(experts, e)
        x = jax.random.normal(jax.random.key(3), (t, h), jnp.bfloat16)[order // k]
        fn = jax.jit(lambda x, counts: grouped_matmul(x, w, counts, backend="xla"))
        want = fn(x, counts)
        seconds = time_call(fn, (x, counts), chain=False, reps=3 if FLAGS.smoke else 9)
        touched = int(np.count_nonzero(np.asarray(counts)))
        floor = touched * h * i * 2 / (bw_tbps * 1e12)
        flops = 2 * t * k * h * i
        row = {"tokens": t, "rows": t * k, "experts_touched": touched, "us": seconds * 1e6,
               "floor_us": floor * 1e6, "fraction_of_floor": floor / seconds,
               "tflops": flops / seconds / 1e12, "fraction_of_gemm_rate": flops / seconds / 1e12 / gemm_tflops,
               "pallas": []}
        for tiles in tqdm(candidates, desc=f"Pallas tiles at {t} tokens", leave=False):
            pfn = jax.jit(lambda x, counts, tiles=tiles: pallas_gmm(
                x, w, counts, interpret=interpret, **tiles.kwargs()))
            try:
                err = rel_err(pfn(x, counts), want)
                ps = time_call(pfn, (x, counts), chain=False, reps=3 if FLAGS.smoke else 9)
            except Exception as exc:   # a tile shape Triton cannot compile: recorded, skipped
                row["pallas"].append({**tiles.kwargs(), "error": str(exc).splitlines()[0][:200]})
                continue
            row["pallas"].append({**tiles.kwargs(), "us": ps * 1e6, "rel_err": err,
                                  "fraction_of_floor": floor / ps,
                                  "fraction_of_gemm_rate": flops / ps / 1e12 / gemm_tflops})
            print({"tokens": t, **row["pallas"][-1]}, flush=True)
        timed = [p for p in row["pallas"] if "us" in p]
        if timed:
            best = min(timed, key=lambda p: p["us"])
            row["pallas_best"] = best
        rows.append(row)
        print({k_: v for k_, v in row.items() if k_ != "pallas"}, flush=True)
    return rows, {"dense_gemm_m": dense_m, "dense_gemm_tflops": gemm_tflops}


def winners_from(up_rows: list[dict]) -> tuple:
    """A tuning table from the up-projection sweep: each measured row count where the best
    Pallas tiles beat ragged_dot covers the row counts down to the previous one measured."""
    from pallas_kernels.grouped_matmul.tuning import Tiles, Winner
    out, low = [], 1
    for r in sorted(up_rows, key=lambda r: r["rows"]):
        best = r.get("pallas_best")
        if best is not None and best["us"] < r["us"]:
            keys = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
            out.append(Winner(Tiles(*(best[k] for k in keys)), low, r["rows"]))
        low = r["rows"] + 1
    return tuple(out)


def main(argv: list[str]) -> None:
    del argv
    import jax

    from bench_common import copy_bandwidth
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    bw = copy_bandwidth(FLAGS.smoke or jax.default_backend() != "gpu")
    ceiling = max(v for k, v in bw.items() if k.endswith("_tbps"))
    result = {"command": " ".join(sys.argv), "jax": jax.__version__,
              "device": jax.devices()[0].device_kind, "bandwidth": bw, "ceiling_tbps": ceiling}
    result["up_projection"], result["gemm"] = up_projection_rows(ceiling)
    winners = winners_from(result["up_projection"])
    result["winners"] = [{**w.tiles.kwargs(), "min_rows": w.min_rows, "max_rows": w.max_rows}
                         for w in winners]
    result["moe_layer"] = moe_rows(ceiling, winners)
    with open(os.path.join(FLAGS.out_dir, "bench_moe.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# MoE layer and grouped matmul ({result['device']}, JAX {result['jax']})", "",
             f"Copy bandwidth (ceiling): {ceiling:.2f} TB/s; dense bf16 GEMM "
             f"[{result['gemm']['dense_gemm_m']}, K] x [K, N]: {result['gemm']['dense_gemm_tflops']:.0f} TFLOP/s.", "",
             "## MoE layer (decode: one token per sequence)", "",
             "| model | grouped matmul | tokens | experts touched | us | floor us | of floor |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['model']} | {r['grouped_matmul']} | {r['tokens']} | {r['experts_touched']} | "
              f"{r['us']:.1f} | {r['floor_us']:.1f} | {r['fraction_of_floor']:.0%} |"
              for r in result["moe_layer"]]
    lines += ["", "## Up-projection (8 experts, top-2, rows sorted by expert): ragged_dot and the "
              "Pallas kernel's best tiles", "",
              "| tokens | experts touched | floor us | ragged_dot us | of floor | of GEMM rate | "
              "Pallas us | of floor | of GEMM rate | tiles (m, n, k, warps, stages) | rel err |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in result["up_projection"]:
        b = r.get("pallas_best")
        pallas = (f"{b['us']:.1f} | {b['fraction_of_floor']:.0%} | {b['fraction_of_gemm_rate']:.0%} | "
                  f"{b['block_m']}, {b['block_n']}, {b['block_k']}, {b['num_warps']}, {b['num_stages']} | "
                  f"{b['rel_err']:.1e}") if b else "- | - | - | - | -"
        lines.append(f"| {r['tokens']} | {r['experts_touched']} | {r['floor_us']:.1f} | {r['us']:.1f} | "
                     f"{r['fraction_of_floor']:.0%} | {r['fraction_of_gemm_rate']:.0%} | {pallas} |")
    lines += ["", "Tuning table measured here (rows -> tiles): " + (", ".join(
        f"{w['min_rows']}-{w['max_rows']}: ({w['block_m']}, {w['block_n']}, {w['block_k']}, "
        f"{w['num_warps']}, {w['num_stages']})" for w in result["winners"]) or "none")]
    with open(os.path.join(FLAGS.out_dir, "bench_moe.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    _plot(result)
    print("\n".join(lines))


def _plot(result: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in FLAGS.models:
        for label in ("xla", "pallas where it wins"):
            rows = [r for r in result["moe_layer"] if r["model"] == name and r["grouped_matmul"] == label]
            if rows:
                axes[0].plot([r["tokens"] for r in rows], [r["us"] for r in rows], "o-",
                             label=f"{name} ({label})")
        axes[0].plot([r["tokens"] for r in rows], [r["floor_us"] for r in rows], "--", label=f"{name} floor")
    up = result["up_projection"]
    axes[1].plot([r["tokens"] for r in up], [r["us"] for r in up], "o-", label="ragged_dot")
    best = [r for r in up if r.get("pallas_best")]
    axes[1].plot([r["tokens"] for r in best], [r["pallas_best"]["us"] for r in best], "s-",
                 label="Pallas (best tiles)")
    axes[1].plot([r["tokens"] for r in up], [r["floor_us"] for r in up], "--", label="weights-read floor")
    for ax, title in zip(axes, ("MoE layer", "Mixtral up-projection")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("us")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(FLAGS.out_dir, "bench_moe.png"), dpi=120)


if __name__ == "__main__":
    app.run(main)

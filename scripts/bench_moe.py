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


def moe_rows(bw_tbps: float) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from bench_common import time_call
    from paxkv.config import get_preset
    rows = []
    for name in FLAGS.models:
        cfg = get_preset(name)
        if FLAGS.smoke:
            import dataclasses
            cfg = dataclasses.replace(cfg, hidden_size=64, moe_intermediate_size=32,
                                      num_heads=4, num_kv_heads=2, head_dim=16)
        params, apply = _moe_layer(cfg, jax.random.key(0))
        expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
        router_bytes = cfg.hidden_size * cfg.num_experts * 2
        for t in (int(b) for b in FLAGS.batches):
            x = jax.random.normal(jax.random.key(t), (t, cfg.hidden_size), jnp.bfloat16)
            touched = _touched(params, cfg, x)
            seconds = time_call(lambda x: apply(params, x), (x,), reps=3 if FLAGS.smoke else 9)
            floor = (router_bytes + touched * expert_bytes + 2 * t * cfg.hidden_size * 2) / (bw_tbps * 1e12)
            rows.append({"model": name, "tokens": t, "experts_touched": touched,
                         "us": seconds * 1e6, "floor_us": floor * 1e6, "fraction_of_floor": floor / seconds})
            print(rows[-1], flush=True)
    return rows


def up_projection_rows(bw_tbps: float) -> tuple[list[dict], dict]:
    """Mixtral's up-projection as one ragged_dot over sorted rows, and the dense GEMM rate."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench_common import time_call
    from paxkv.model.moe import expert_order, grouped_matmul
    e, k, h, i = (8, 2, 4096, 14336) if not FLAGS.smoke else (8, 2, 64, 96)
    w = jax.random.normal(jax.random.key(1), (e, h, i), jnp.bfloat16) * 0.02
    dense_m = 1024 if not FLAGS.smoke else 16
    a = jax.random.normal(jax.random.key(2), (dense_m, h), jnp.bfloat16)
    gemm = jax.jit(lambda a: jnp.dot(a, w[0]))
    gemm_s = time_call(gemm, (a,), chain=False, reps=3 if FLAGS.smoke else 9)
    gemm_tflops = 2 * dense_m * h * i / gemm_s / 1e12
    rows = []
    for t in (int(x) for x in FLAGS.up_tokens):
        rng = np.random.default_rng(t)
        experts = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
        order, counts = expert_order(experts, e)
        x = jax.random.normal(jax.random.key(3), (t, h), jnp.bfloat16)[order // k]
        fn = jax.jit(lambda x, counts: grouped_matmul(x, w, counts))
        seconds = time_call(fn, (x, counts), chain=False, reps=3 if FLAGS.smoke else 9)
        touched = int(np.count_nonzero(np.asarray(counts)))
        floor = touched * h * i * 2 / (bw_tbps * 1e12)
        flops = 2 * t * k * h * i
        rows.append({"tokens": t, "rows": t * k, "experts_touched": touched, "us": seconds * 1e6,
                     "floor_us": floor * 1e6, "fraction_of_floor": floor / seconds,
                     "tflops": flops / seconds / 1e12, "fraction_of_gemm_rate": flops / seconds / 1e12 / gemm_tflops})
        print(rows[-1], flush=True)
    return rows, {"dense_gemm_m": dense_m, "dense_gemm_tflops": gemm_tflops}


def main(argv: list[str]) -> None:
    del argv
    import jax

    from bench_common import copy_bandwidth
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    bw = copy_bandwidth(FLAGS.smoke or jax.default_backend() != "gpu")
    ceiling = max(v for k, v in bw.items() if k.endswith("_tbps"))
    result = {"command": " ".join(sys.argv), "jax": jax.__version__,
              "device": jax.devices()[0].device_kind, "bandwidth": bw, "ceiling_tbps": ceiling}
    result["moe_layer"] = moe_rows(ceiling)
    result["up_projection"], result["gemm"] = up_projection_rows(ceiling)
    with open(os.path.join(FLAGS.out_dir, "bench_moe.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# MoE layer and grouped matmul ({result['device']}, JAX {result['jax']})", "",
             f"Copy bandwidth (ceiling): {ceiling:.2f} TB/s; dense bf16 GEMM "
             f"[{result['gemm']['dense_gemm_m']}, K] x [K, N]: {result['gemm']['dense_gemm_tflops']:.0f} TFLOP/s.", "",
             "## MoE layer (decode: one token per sequence)", "",
             "| model | tokens | experts touched | us | floor us | of floor |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['model']} | {r['tokens']} | {r['experts_touched']} | {r['us']:.1f} | {r['floor_us']:.1f} | "
              f"{r['fraction_of_floor']:.0%} |" for r in result["moe_layer"]]
    lines += ["", "## Up-projection, one ragged_dot (8 experts, top-2, rows sorted by expert)", "",
              "| tokens | experts touched | us | floor us | of floor | TFLOP/s | of GEMM rate |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['tokens']} | {r['experts_touched']} | {r['us']:.1f} | {r['floor_us']:.1f} | "
              f"{r['fraction_of_floor']:.0%} | {r['tflops']:.1f} | {r['fraction_of_gemm_rate']:.0%} |"
              for r in result["up_projection"]]
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
        rows = [r for r in result["moe_layer"] if r["model"] == name]
        axes[0].plot([r["tokens"] for r in rows], [r["us"] for r in rows], "o-", label=f"{name}")
        axes[0].plot([r["tokens"] for r in rows], [r["floor_us"] for r in rows], "--", label=f"{name} floor")
    up = result["up_projection"]
    axes[1].plot([r["tokens"] for r in up], [r["us"] for r in up], "o-", label="ragged_dot")
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

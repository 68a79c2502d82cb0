"""How many tokens of KV cache fit next to the weights: the memory budget behind paging.

Plans the KV pool (`paxkv.sim.capacity.plan_capacity`) for Llama-3-8B and -70B on common
accelerators with bf16 and 8-bit KV caches, and puts it beside the two reference points:
the worked example the project started from (Llama-3-8B on a 24 GB RTX 4090: about 15 GB of
weights, 9 GB left, 72k tokens at 128 KiB each, twice that with FP8) and the paper's Fig. 1
(OPT-13B on an A100-40GB: 26 GB of weights, 65%; KV cache over 30%).

    PYTHONPATH=. python3 experiments/capacity.py                  # arithmetic only (CPU)
    PYTHONPATH=. python3 experiments/capacity.py --setting=gpu    # also checks the plan on the
                                                                  # device: capacity_device.*

It also plans tensor parallelism: Llama-3-8B and -70B split over 1, 2, 4 and 8 H200s.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from absl import app, flags

from configs import experiments as configs
from experiments import common
from paxkv.sim.capacity import GiB, CapacityPlan, plan_capacity
from paxkv.config import ModelConfig, get_preset

FLAGS = flags.FLAGS
flags.DEFINE_enum("setting", "cpu", ["cpu", "gpu"], "Which settings of configs/experiments.py to use.")
flags.DEFINE_string("out_dir", "scratch/results", "Where to write capacity.json/.png/.md (--out_dir=results updates the committed results)")
flags.DEFINE_integer("block_size", None, "Override the settings' block size.")

NAME = "capacity"

# The paper's model: OPT-13B (fp16). Its MLP is not gated, so the Llama parameter formula
# does not apply: the published size is passed instead.
OPT_13B = ModelConfig(vocab_size=50272, hidden_size=5120, intermediate_size=20480, num_layers=40,
                      num_heads=40, num_kv_heads=40, head_dim=128, max_position_embeddings=2048,
                      name="opt-13b")
OPT_13B_PARAMS = 12_850_000_000

WORKED_EXAMPLE = {"weights_gb": 15.0, "kv_gb": 9.0, "tokens_bf16": 72_000, "kv_bytes_per_token": 128 * 1024}


def _row(plan: CapacityPlan, model: str, gpu: str, kv_dtype: str, budget: str, seq_len: int,
         weight_dtype: str = "bf16") -> dict[str, Any]:
    return {
        "model": model, "gpu": gpu, "weight_dtype": weight_dtype, "kv_dtype": kv_dtype, "budget": budget,
        "gpu_gib": plan.gpu_bytes / GiB, "weights_gib": plan.weights_bytes / GiB,
        "reserve_gib": plan.activation_reserve_bytes / GiB, "kv_gib": plan.kv_bytes / GiB,
        "unbudgeted_gib": (plan.gpu_bytes - plan.budget_bytes) / GiB,
        "kv_bytes_per_token": plan.kv_bytes_per_token, "tokens": plan.tokens,
        "blocks": plan.blocks, "block_size": plan.block_size,
        "max_seqs_at_seq_len": plan.max_sequences(seq_len) if plan.blocks else 0,
        "weights_share": plan.weights_bytes / plan.gpu_bytes, "kv_share": plan.kv_bytes / plan.gpu_bytes,
    }


def plan_rows(s: configs.CapacitySettings) -> list[dict[str, Any]]:
    """Every (budget, model, gpu, kv dtype) plan of the settings, plus the paper's OPT-13B row."""
    rows = []
    kv_bytes = dict(s.kv_dtypes)
    # The worked example: Llama-3-8B on the whole RTX 4090, no reserve.
    for kv_name, b in s.kv_dtypes:
        plan = plan_capacity(configs.GPUS["RTX 4090 (24 GB)"], get_preset("llama3-8b"), s.weight_dtype_bytes,
                             b, s.block_size)
        rows.append(_row(plan, "llama3-8b", "RTX 4090 (24 GB)", kv_name, "whole device", s.seq_len))
    # The paper's Fig. 1 setting, with the engine's budget.
    plan = plan_capacity(configs.GPUS["A100 (40 GB)"], OPT_13B, 2.0, 2.0, s.block_size,
                         s.gpu_memory_utilization, s.activation_reserve_bytes, num_params=OPT_13B_PARAMS)
    rows.append(_row(plan, "opt-13b", "A100 (40 GB)", "fp16", "engine default", s.seq_len, "fp16"))
    for model in s.models:
        cfg = get_preset(model)
        for gpu in s.gpus:
            for kv_name in kv_bytes:
                plan = plan_capacity(configs.GPUS[gpu], cfg, s.weight_dtype_bytes, kv_bytes[kv_name],
                                     s.block_size, s.gpu_memory_utilization, s.activation_reserve_bytes)
                rows.append(_row(plan, model, gpu, kv_name, "engine default", s.seq_len,
                                 _dtype_name(s.weight_dtype_bytes)))
            # What the engine's 8-bit pool really stores: one bf16 scale per (token, head) of K and V.
            scales = 2 * cfg.num_layers * cfg.num_kv_heads * 2.0
            plan = plan_capacity(configs.GPUS[gpu], cfg, s.weight_dtype_bytes, 1.0, s.block_size,
                                 s.gpu_memory_utilization, s.activation_reserve_bytes,
                                 kv_scale_bytes_per_token=scales)
            rows.append(_row(plan, model, gpu, "fp8/int8 + scales", "engine default", s.seq_len,
                             _dtype_name(s.weight_dtype_bytes)))
    for model, gpu, wbytes in s.extra_plans:
        for kv_name in kv_bytes:
            plan = plan_capacity(configs.GPUS[gpu], get_preset(model), wbytes, kv_bytes[kv_name],
                                 s.block_size, s.gpu_memory_utilization, s.activation_reserve_bytes)
            rows.append(_row(plan, model, gpu, kv_name, "engine default", s.seq_len, _dtype_name(wbytes)))
    return rows


def tensor_parallel_rows(s: configs.CapacitySettings) -> list[dict[str, Any]]:
    """Each model on 1..8 devices: per-device weights and KV, the pool's tokens (a token
    spans every device) and so the longest one context that fits, bf16 and 8-bit KV."""
    rows = []
    for model in s.tp_models:
        cfg = get_preset(model)
        scales = 2 * cfg.num_layers * cfg.num_kv_heads * 2.0   # the 8-bit pool's bf16 scales
        for tp in s.tp_sizes:
            row: dict[str, Any] = {"model": model, "gpu": s.tp_gpu, "tensor_parallel_size": tp,
                                   "max_position_embeddings": cfg.max_position_embeddings}
            for kv_name, kv_bytes, extra in (("bf16", 2.0, 0.0), ("fp8", 1.0, scales)):
                plan = plan_capacity(configs.GPUS[s.tp_gpu], cfg, s.weight_dtype_bytes, kv_bytes,
                                     s.block_size, s.gpu_memory_utilization, s.activation_reserve_bytes,
                                     kv_scale_bytes_per_token=extra, tensor_parallel_size=tp)
                row.update({"weights_gib_per_device": plan.weights_bytes / GiB,
                            f"kv_gib_per_device_{kv_name}": plan.kv_bytes / GiB,
                            f"kv_bytes_per_token_per_device_{kv_name}": plan.kv_bytes_per_token,
                            f"tokens_{kv_name}": plan.tokens,
                            f"longest_context_{kv_name}": plan.usable_tokens})
            rows.append(row)
    return rows


def _dtype_name(nbytes: float) -> str:
    return {2.0: "bf16", 1.0: "8-bit", 4.0: "fp32", 0.5: "4-bit"}.get(float(nbytes), f"{nbytes} B")


def measure_on_device(s: configs.CapacitySettings) -> dict[str, Any]:
    """Allocate the model's random bf16 weights and the planned pool on the device; compare."""
    import jax
    import jax.numpy as jnp

    from paxkv.cache import kv_pool
    from paxkv.model.weights import random_params

    dev = jax.devices()[0]

    def in_use() -> int:
        return int((dev.memory_stats() or {}).get("bytes_in_use", 0))

    limit = int((dev.memory_stats() or {}).get("bytes_limit", 0))
    if not limit:
        raise RuntimeError(f"{dev.device_kind} reports no memory limit: run the gpu setting on a GPU")
    cfg = get_preset(s.device_model)
    base = in_use()
    params = random_params(cfg, 0, "bfloat16")
    jax.block_until_ready(params)
    weights = in_use() - base
    plan = plan_capacity(limit, cfg, s.weight_dtype_bytes, 2.0, s.block_size,
                         s.gpu_memory_utilization, s.activation_reserve_bytes)
    before_pool = in_use()
    pool = kv_pool.init_pool(cfg, plan.blocks, s.block_size, jnp.bfloat16)
    jax.block_until_ready(pool)
    pool_bytes = in_use() - before_pool
    out = {
        "device": common.device_hardware(), "bytes_limit": limit, "model": s.device_model,
        "weights_planned": plan.weights_bytes, "weights_measured": weights,
        "pool_blocks": plan.blocks, "pool_planned": int(plan.blocks * plan.block_bytes),
        "pool_measured": pool_bytes, "tokens": plan.tokens,
        "left_after_pool": limit - in_use(),
    }
    del pool, params
    return out


def _fig(rows: list[dict[str, Any]]):
    import matplotlib.pyplot as plt
    shown = [r for r in rows if r["kv_dtype"] in ("bf16", "fp16") and
             (r["budget"] == "engine default" or r["gpu"].startswith("RTX"))]
    labels = [f"{r['model']} ({r['weight_dtype']})\n{r['gpu']}" + ("\n(whole device)" if r["budget"] == "whole device" else "")
              for r in shown]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    bottom = [0.0] * len(shown)
    for key, color, label in (("weights_gib", "#7f7f7f", "weights"), ("reserve_gib", "#c7c7c7", "activation reserve"),
                              ("kv_gib", "#1f77b4", "KV cache"), ("unbudgeted_gib", "#eeeeee", "outside the budget")):
        vals = [r[key] for r in shown]
        ax.bar(range(len(shown)), vals, bottom=bottom, color=color, label=label, edgecolor="white")
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(shown):
        txt = f"{r['tokens'] / 1000:.0f}k tok" if r["tokens"] else "does not fit"
        ax.text(i, bottom[i] + 1, txt, ha="center", fontsize=7)
    ax.set_xticks(range(len(shown)), labels, fontsize=6.5, rotation=0)
    ax.set_ylabel("GiB")
    ax.set_title("Where the memory goes (bf16/fp16 KV; weights as labelled)")
    ax.legend(fontsize=8)
    llama8 = [r for r in rows if r["model"] == "llama3-8b" and r["budget"] == "engine default"]
    gpus = list(dict.fromkeys(r["gpu"] for r in llama8))
    kvs = list(dict.fromkeys(r["kv_dtype"] for r in llama8))
    width = 0.8 / max(1, len(kvs))
    for j, kv in enumerate(kvs):
        vals = [next(r["tokens"] for r in llama8 if r["gpu"] == g and r["kv_dtype"] == kv) / 1000 for g in gpus]
        ax2.bar([i + j * width for i in range(len(gpus))], vals, width=width, label=f"KV {kv}")
    ax2.set_xticks([i + width * (len(kvs) - 1) / 2 for i in range(len(gpus))], gpus, fontsize=7)
    ax2.set_ylabel("cacheable tokens (thousands)")
    ax2.set_title("Llama-3-8B KV capacity (90% budget, 1 GiB reserve)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _tp_table(tp_rows: list[dict[str, Any]], s: configs.CapacitySettings) -> str:
    return ("## Tensor parallelism: one model over several devices\n\n"
            f"Each device a {s.tp_gpu}, bf16 weights, the engine's budget "
            f"({common.pct(s.gpu_memory_utilization, 0)} minus {s.activation_reserve_bytes / GiB:.0f} GiB per "
            "device). Weights and KV are per device (every weight but the norms split N ways, each "
            "device holding 1/N of every token's KV heads); tokens count the pool's token slots, each "
            "spanning all N devices, so the longest context is one sequence using the whole pool "
            "(whole blocks, the null block excluded). FP8 counts the 8-bit pool's bf16 scales.\n\n"
            + common.markdown_table(
                ["model", "devices", "weights GiB / device", "KV GiB / device (bf16)", "KV bytes / token / device (bf16)",
                 "longest context, bf16 KV", "longest context, FP8 KV", "model's max positions"],
                [[r["model"], r["tensor_parallel_size"], f"{r['weights_gib_per_device']:.2f}",
                  f"{r['kv_gib_per_device_bf16']:.2f}", f"{r['kv_bytes_per_token_per_device_bf16'] / 1024:.0f} KiB",
                  f"{r['longest_context_bf16']:,}" if r["longest_context_bf16"] else "does not fit",
                  f"{r['longest_context_fp8']:,}" if r["longest_context_fp8"] else "does not fit",
                  f"{r['max_position_embeddings']:,}"] for r in tp_rows]))


def _tables(rows: list[dict[str, Any]], device: dict[str, Any] | None, s: configs.CapacitySettings) -> tuple[str, str]:
    we = [r for r in rows if r["budget"] == "whole device"]
    bf, f8 = we[0], we[1]
    opt = next(r for r in rows if r["model"] == "opt-13b")
    ref = common.PAPER["memory_layout"]
    compare = common.markdown_table(
        ["what", "reference", "paxkv planner"],
        [["Llama-3-8B on RTX 4090: weights (bf16)", "about 15 GB", f"{bf['weights_gib']:.2f} GiB"],
         ["... left for KV (whole device)", "about 9 GB", f"{bf['kv_gib']:.2f} GiB"],
         ["... KV bytes per token, bf16", "128 KiB", f"{bf['kv_bytes_per_token'] / 1024:.0f} KiB"],
         ["... cacheable tokens, bf16 KV", "about 72k", f"{bf['tokens']:,} ({bf['tokens'] / 1024:.1f} Ki)"],
         ["... cacheable tokens, FP8 KV", "twice bf16", f"{f8['tokens']:,} ({f8['tokens'] / bf['tokens']:.2f}x)"],
         ["OPT-13B on A100-40GB: weights (paper Fig. 1)",
          f"{ref['weights_gb']:.0f} GB, {common.pct(ref['weights_share'], 0)}",
          f"{opt['weights_gib'] * GiB / 1e9:.1f} GB ({opt['weights_gib']:.1f} GiB), "
          f"{common.pct(opt['weights_share'], 0)} of 40 GiB"],
         ["... KV cache share (paper Fig. 1)", f"over {common.pct(ref['kv_share_min'], 0)}",
          f"{common.pct(opt['kv_share'], 0)} ({opt['kv_gib']:.1f} GiB, {opt['tokens']:,} tokens)"],
         ["... KV bytes per token", "800 KB", f"{opt['kv_bytes_per_token'] / 1024:.0f} KiB"]])
    full = common.markdown_table(
        ["model", "GPU", "budget", "weights", "KV dtype", "weights GiB", "KV GiB", "tokens", f"blocks of {s.block_size}",
         f"seqs of {s.seq_len}"],
        [[r["model"], r["gpu"], r["budget"], r["weight_dtype"], r["kv_dtype"], f"{r['weights_gib']:.2f}", f"{r['kv_gib']:.2f}",
          f"{r['tokens']:,}", f"{r['blocks']:,}", r["max_seqs_at_seq_len"]] for r in rows])
    table = "## Against the reference points\n\n" + compare + "\n\n## All plans\n\n" + full
    if device:
        table += ("\n\n## Checked on the device\n\n"
                  f"{device['model']} with random bf16 weights, then a bf16 page pool of the planned size, "
                  "allocated on the device. The plan here is made against the memory JAX may use (its "
                  "`bytes_limit`, set by XLA_PYTHON_CLIENT_MEM_FRACTION), not the driver's total, with the "
                  "same budget and reserve as the \"engine default\" rows; measured = growth of JAX's "
                  "`bytes_in_use`.\n\n") + common.markdown_table(
            ["what", "planned", "measured"],
            [["weights (random bf16)", f"{device['weights_planned'] / GiB:.2f} GiB", f"{device['weights_measured'] / GiB:.2f} GiB"],
             [f"KV pool ({device['pool_blocks']:,} blocks)", f"{device['pool_planned'] / GiB:.2f} GiB",
              f"{device['pool_measured'] / GiB:.2f} GiB"],
             ["JAX memory limit / left after the pool", f"{device['bytes_limit'] / GiB:.2f} GiB",
              f"{device['left_after_pool'] / GiB:.2f} GiB left"]])
    notes = (f"Budgets: \"whole device\" is the back-of-envelope of the worked example (all memory, no "
             f"reserve); \"engine default\" is {common.pct(s.gpu_memory_utilization, 0)} of the device minus "
             f"{s.activation_reserve_bytes / GiB:.0f} GiB for activations. Device memory is what the driver reports "
             "(an H200 \"141 GB\" has 140.4 GiB). Blocks count the pool's pages, block 0 (the null block) included. "
             "FP8 rows exclude per-token scales, except \"fp8/int8 + scales\", which counts the bf16 scale "
             "per (token, head) of K and V that the engine's 8-bit pool stores. \"seqs\" = sequences of the "
             "given length that fit at once.")
    return table, notes


def main(argv: list[str]) -> None:
    del argv
    s = configs.get(NAME, FLAGS.setting)
    if FLAGS.block_size is not None:
        s = dataclasses.replace(s, block_size=FLAGS.block_size)
    rows = plan_rows(s)
    tp_rows = tensor_parallel_rows(s)
    device = measure_on_device(s) if s.measure_on_device else None
    table, notes = _tables(rows, device, s)
    table += "\n\n" + _tp_table(tp_rows, s)
    hardware = device["device"] if device else common.host_hardware("arithmetic only")
    # The device check gets its own files, so the CPU run does not overwrite it.
    name = NAME + "_device" if device else NAME
    paths = common.write_results(
        name, FLAGS.out_dir, title="KV cache capacity: where an accelerator's memory goes",
        command=common.command_line(), hardware=hardware, settings=dataclasses.asdict(s),
        results={"plans": rows, "tensor_parallel": tp_rows, "device_check": device,
                 "worked_example_reference": WORKED_EXAMPLE,
                 "paper": common.PAPER["memory_layout"]},
        table=table, notes=notes, figure=_fig(rows))
    print(table)
    print("wrote", ", ".join(paths.values()))


if __name__ == "__main__":
    app.run(main)

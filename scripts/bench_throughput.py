"""End-to-end throughput and latency of the paged engine, vLLM's benchmark_throughput in spirit.

One run measures, side by side on the same weights and the same requests:
- paxkv (continuous batching over paged KV) on the chosen workload(s);
- with --compare: the engine's static (request-level) policy on the same requests, and
  transformers' generate (PyTorch, same weights copied over DLPack) on a subset;
- with --latency: one stream, 128 tokens in, 512 out, against the weights-read roofline;
- the device copy bandwidth, measured in the same run, as the ceiling.

Compilation is kept out of the timed figures: every step that compiled a new shape bucket
is timed separately, reported, and subtracted from the clock the figures use.

    PYTHONPATH=. python3 scripts/bench_throughput.py --model llama3-8b --compare --latency
    PYTHONPATH=. python3 scripts/bench_throughput.py --model tiny --num_prompts 32   # CPU
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "llama3-8b", "preset (random weights on the device) or checkpoint dir")
flags.DEFINE_string("dtype", "auto", "bfloat16 | float32 | auto")
flags.DEFINE_list("workloads", ["fixed", "sharegpt"], "fixed, sharegpt and/or alpaca")
flags.DEFINE_integer("input_len", 256, "fixed workload: prompt tokens")
flags.DEFINE_integer("output_len", 256, "fixed workload: output tokens")
flags.DEFINE_integer("num_prompts", 1000, "requests per workload")
flags.DEFINE_integer("seed", 0, "workload and weights seed")
flags.DEFINE_integer("max_num_seqs", 256, "engine: running sequences at most")
flags.DEFINE_integer("max_num_batched_tokens", 8192, "engine: tokens per step at most")
flags.DEFINE_integer("max_model_len", 2048, "engine: longest sequence")
flags.DEFINE_integer("block_size", 16, "tokens per KV block")
flags.DEFINE_float("gpu_memory_utilization", 0.9, "share of JAX's device memory for the engine")
flags.DEFINE_integer("num_gpu_blocks_override", None, "fix the KV pool size")
flags.DEFINE_string("attention_backend", "auto", "reference | pallas | auto")
flags.DEFINE_integer("tensor_parallel_size", 1, "devices the weights and KV heads are split over")
flags.DEFINE_bool("compare", False, "also run the static policy and transformers")
flags.DEFINE_integer("static_num_prompts", 400, "requests for the static-policy comparison")
flags.DEFINE_integer("hf_num_prompts", 16, "requests for transformers (one batch)")
flags.DEFINE_integer("num_scheduler_steps", 1, "decode steps per host round trip")
flags.DEFINE_bool("full_compare_workloads", True, "with --compare, also run non-fixed workloads at "
                  "full size (else only the comparison subsets)")
flags.DEFINE_bool("run_transformers", True, "with --compare on a GPU, time transformers too")
flags.DEFINE_bool("latency", False, "one stream, 128 in / 512 out, against the roofline")
flags.DEFINE_list("latency_steps", [], "with --latency, also time one stream at these "
                  "num_scheduler_steps values (e.g. 1,32)")
flags.DEFINE_float("mem_fraction", None, "XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.55 with "
                   "--compare, leaving PyTorch room; else 0.92)")
flags.DEFINE_list("settings", [], "compare engine settings side by side instead: each "
                  "'name:key=value;key=value' builds LLM(model, **those) with nothing else set "
                  "('defaults:' = LLM's own defaults) and runs one stream (128 in / 512 out) and "
                  "the fixed workload on it")
flags.DEFINE_string("out_dir", "scratch/results/throughput", "where the json and markdown go (--out_dir=results/throughput updates the committed results)")
flags.DEFINE_float("deadline_s", 1e9, "skip the parts that would start after this many seconds")


def percentiles(xs: list[float]) -> dict[str, float]:
    import numpy as np
    if not xs:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    a = np.asarray(xs)
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}


def copy_bandwidth() -> dict[str, float]:
    """The kernel benchmarks' copy-bandwidth measurement, plus the ceiling the figures use."""
    from scripts.bench_common import copy_bandwidth as measure
    out = measure(smoke=False)
    out["ceiling_TBps"] = max(v for k, v in out.items() if k.endswith("tbps"))
    return out


def make_requests(name: str, vocab: int, num: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) per request: paxkv.sim.workloads lengths, random ids."""
    from paxkv.sim import workloads
    if name == "fixed":
        trace = workloads.fixed(num, FLAGS.input_len, FLAGS.output_len, seed=seed)
    else:
        trace = workloads.make_trace(name, num, seed=seed)
    return workloads.random_token_requests(trace, vocab, FLAGS.max_model_len, seed + 1)


def run_engine(engine, requests, label: str) -> dict:
    """Offline run: everything arrives at t0; compile steps are timed apart and excluded."""
    from tqdm.auto import tqdm

    from paxkv import SamplingParams
    runner = engine.runner
    engine.block_manager.reset_prefix_cache()  # runs share prompts; no hits across runs
    engine.metrics.reset()
    n_steps0 = len(engine.metrics.steps)
    t0 = time.monotonic()
    ids = []
    for i, (prompt, out_len) in enumerate(requests):
        rid = f"{label}-{i}"
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=out_len,
                                                       ignore_eos=True, detokenize=False),
                           arrival_time=t0)
        ids.append(rid)
    intervals: list[tuple[float, float]] = []   # (start, end) of each step that compiled
    excluded = 0.0
    done = {}
    bar = tqdm(total=len(ids), desc=label, dynamic_ncols=True, mininterval=2.0)
    while engine.has_unfinished_requests():
        before = runner.num_compilations
        ts = time.monotonic()
        outs = engine.step(only_finished=True)
        te = time.monotonic()
        if runner.num_compilations != before:
            excluded += te - ts
            intervals.append((ts, te))
        for o in outs:
            if o.finished:
                done[o.request_id] = o
                bar.update(1)
    bar.close()
    t_end = time.monotonic()

    def eff(t: float) -> float:
        """Seconds since t0 with compile steps cut out (a stamp inside one maps to its start)."""
        cut = 0.0
        for a, b in intervals:
            if b <= t:
                cut += b - a
            elif a < t:
                cut += t - a
        return t - t0 - cut

    elapsed = eff(t_end)
    ttft, tpot, e2e = [], [], []
    in_tok = out_tok = 0
    for rid, (prompt, out_len) in zip(ids, requests):
        o = done[rid]
        n = len(o.outputs[0].token_ids)
        assert n == out_len, f"{rid}: {n} tokens, expected {out_len}"
        in_tok += len(prompt)
        out_tok += n
        m = o.metrics
        ttft.append(eff(m.first_token_time))
        e2e.append(eff(m.finished_time))
        if n > 1:
            tpot.append((eff(m.finished_time) - eff(m.first_token_time)) / (n - 1))
    s = engine.metrics.summary()
    steps = engine.metrics.steps[n_steps0:]
    run = [st for st in steps if not st.compile_s and st.num_seqs_scheduled]
    return {
        "label": label, "num_requests": len(ids), "elapsed_s": elapsed,
        "requests_per_s": len(ids) / elapsed, "output_tokens_per_s": out_tok / elapsed,
        "total_tokens_per_s": (in_tok + out_tok) / elapsed, "input_tokens": in_tok,
        "output_tokens": out_tok, "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot),
        "e2e_s": percentiles(e2e), "mean_running_batch": s["mean_batch"],
        "peak_kv_blocks": s["max_blocks_used"], "mean_kv_usage": s["mean_kv_usage"],
        "num_kv_blocks": engine.metrics.num_blocks - 1, "preemptions": s["preemptions"],
        "compilations_in_run": len(intervals), "compile_s_in_run": excluded,
        "host_share_of_step": s["host_share"], "python_share_of_step": s["python_share"],
        "host_ms_per_step": 1e3 * sum(st.host_s for st in run) / max(1, len(run)),
        "device_ms_per_step": 1e3 * sum(st.device_s for st in run) / max(1, len(run)),
        "steps": len(run),
    }


def host_share_at_full_batch(engine) -> dict:
    """Host share over steps that ran a full decode batch (the steady state at batch 256)."""
    steps = [s for s in engine.metrics.steps if not s.compile_s
             and s.num_seqs_scheduled >= FLAGS.max_num_seqs and s.num_prefill_tokens == 0]
    wall = sum(s.wall_s for s in steps)
    host = sum(s.host_s for s in steps)
    py = sum(s.python_s for s in steps)
    return {"steps": len(steps), "host_share": host / wall if wall else float("nan"),
            "python_share": py / wall if wall else float("nan"), "python_ms": 1e3 * py / max(1, len(steps)),
            "host_ms": 1e3 * host / max(1, len(steps)), "wall_ms": 1e3 * wall / max(1, len(steps))}


def run_transformers(params, cfg, requests) -> dict:
    """transformers' generate on the same weights (copied over DLPack), one padded batch."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from paxkv.model.weights import hf_config_dict, hf_tensors
    hf_cfg = hf_config_dict(cfg, "bfloat16")
    hf_cfg.pop("architectures", None)
    hf_cfg.pop("model_type", None)
    hf_cfg.pop("torch_dtype", None)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**hf_cfg))
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    state = {}
    for name, x in hf_tensors(params, cfg):
        state[name] = torch.from_dlpack(x).clone()
    missing, unexpected = model.load_state_dict(state, strict=False)
    del state
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        raise RuntimeError(f"weights did not map: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    tok_lens = [len(p) for p, _ in requests]
    width = max(tok_lens)
    ids = torch.zeros((len(requests), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(requests):          # left padding, as generate expects
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.cuda(), mask.cuda()
    new = max(o for _, o in requests)
    with torch.no_grad():
        model.generate(ids[:, -8:], attention_mask=mask[:, -8:], max_new_tokens=2, do_sample=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False)
        torch.cuda.synchronize()
        el = time.perf_counter() - t
    useful = sum(o for _, o in requests)  # each request only wants its own output length
    first = out[0, width:width + 8].tolist()
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, out
    torch.cuda.empty_cache()
    return {"label": "transformers", "num_requests": len(requests), "elapsed_s": el,
            "requests_per_s": len(requests) / el, "output_tokens_per_s": useful / el,
            "generated_tokens_per_s": len(requests) * new / el, "batch": len(requests),
            "max_new_tokens": new, "peak_gib": peak, "first_tokens_row0": first}


def latency_run(llm, cfg, bw: dict) -> dict:
    import jax

    from paxkv import SamplingParams
    engine = llm.llm_engine
    rng_prompt = list(range(100, 228))
    sp = SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True, detokenize=False)
    llm.generate([rng_prompt], sp, use_tqdm=False)  # compile every single-stream bucket
    engine.metrics.reset()
    t = time.perf_counter()
    out = llm.generate([rng_prompt], sp, use_tqdm=False)[0]
    el = time.perf_counter() - t - engine.metrics.summary()["compile_s"]
    m = out.metrics
    decode_s = m.finished_time - m.first_token_time
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(llm.llm_engine.runner.params))
    weight_bytes -= cfg.vocab_size * cfg.hidden_size * 2  # the embedding is gathered, not read
    # A mixture-of-experts token reads only its own experts: the active-weights roofline.
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    weight_bytes -= len(cfg.moe_layers) * (cfg.num_experts - cfg.num_experts_per_tok) * expert_bytes
    # Under tensor parallelism each of the N devices reads its 1/N of the weights.
    roofline = FLAGS.tensor_parallel_size * bw["ceiling_TBps"] * 1e12 / weight_bytes
    tps = 511 / decode_s
    return {"output_tokens_per_s": 512 / el, "decode_tokens_per_s": tps,
            "ttft_s": m.first_token_time - m.arrival_time, "weights_read_GB": weight_bytes / 1e9,
            "roofline_tokens_per_s": roofline, "fraction_of_roofline": tps / roofline,
            "host_share": engine.metrics.summary()["host_share"]}


def parse_setting(spec: str) -> tuple[str, dict]:
    """'name:key=value;key=value' -> (name, kwargs) with ints, floats and bools parsed."""
    name, _, rest = spec.partition(":")
    kwargs: dict = {}
    for part in filter(None, rest.split(";")):
        key, _, value = part.partition("=")
        for parse in (int, float):
            try:
                kwargs[key] = parse(value)
                break
            except ValueError:
                pass
        else:
            kwargs[key] = {"True": True, "False": False}.get(value, value)
    return name, kwargs


def run_settings(result: dict, save) -> None:
    """Each setting in a fresh LLM (the previous one shut down first): one stream, then the
    fixed workload, then the host share at full batch. Compilation stays out of the clock."""
    import jax

    from paxkv import LLM
    bw = result.get("bandwidth", {"ceiling_TBps": float("nan")})
    rows = result.setdefault("settings", {})
    for spec in FLAGS.settings:
        name, kwargs = parse_setting(spec)
        t = time.perf_counter()
        llm = LLM(FLAGS.model, tokenizer=None, seed=FLAGS.seed, **kwargs)
        jax.block_until_ready(llm.llm_engine.runner.params)
        row = {"kwargs": kwargs, "setup_s": time.perf_counter() - t,
               "num_kv_blocks": llm.llm_engine.metrics.num_blocks - 1}
        engine, cfg = llm.llm_engine, llm.llm_engine.model_config
        row["latency"] = latency_run(llm, cfg, bw)
        print(name, "latency", row["latency"], flush=True)
        warm = make_requests("fixed", cfg.vocab_size, min(256, FLAGS.num_prompts), 99)
        run_engine(engine, [(p, 4) for p, _ in warm], "warmup")
        reqs = make_requests("fixed", cfg.vocab_size, FLAGS.num_prompts, FLAGS.seed)
        row["fixed"] = run_engine(engine, reqs, f"{name}-fixed")
        row["host_at_full_batch"] = host_share_at_full_batch(engine)
        row["compilations"] = engine.runner.num_compilations
        row["compile_s"] = engine.runner.compile_time_s
        print(name, json.dumps(row["fixed"]), row["host_at_full_batch"], flush=True)
        rows[name] = row
        save()
        llm.shutdown()
    best_lat = max(r["latency"]["output_tokens_per_s"] for r in rows.values())
    best_thr = max(r["fixed"]["requests_per_s"] for r in rows.values())
    lines = ["| setting | engine arguments | one stream tok/s | vs best | 1000 x 256/256 req/s | vs best "
             "| host share at full batch | KV blocks |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        lat, thr = r["latency"]["output_tokens_per_s"], r["fixed"]["requests_per_s"]
        args = ", ".join(f"{k}={v}" for k, v in r["kwargs"].items()) or "(none)"
        lines.append(f"| {name} | {args} | {lat:.1f} | {lat / best_lat:.3f} | {thr:.2f} | "
                     f"{thr / best_thr:.3f} | {r['host_at_full_batch']['host_share']:.3f} | "
                     f"{r['num_kv_blocks']} |")
    result["settings_table"] = "\n".join(lines)
    print(result["settings_table"], flush=True)


def main(argv):
    del argv
    frac = FLAGS.mem_fraction or (0.55 if FLAGS.compare else 0.92)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(frac))
    import jax

    from paxkv import LLM
    from paxkv.engine.llm_engine import LLMEngine
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    result: dict = {"command": " ".join(sys.argv), "jax": jax.__version__,
                    "device": str(jax.devices()[0].device_kind), "flags": {
                        k: FLAGS[k].value for k in ("model", "workloads", "num_prompts", "max_num_seqs",
                                                     "max_num_batched_tokens", "max_model_len",
                                                     "block_size", "static_num_prompts",
                                                     "hf_num_prompts", "num_scheduler_steps",
                                                     "tensor_parallel_size")}}
    out_path = os.path.join(FLAGS.out_dir, "throughput.json")

    def save():
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)

    start = time.monotonic()

    def time_left() -> bool:
        ok = time.monotonic() - start < FLAGS.deadline_s
        if not ok:
            result.setdefault("skipped_after_deadline", True)
        return ok

    on_gpu = jax.default_backend() == "gpu"
    if on_gpu:
        result["bandwidth"] = copy_bandwidth()
        print("bandwidth", result["bandwidth"], flush=True)
    if FLAGS.settings:
        run_settings(result, save)
        save()
        print(f"wrote {out_path}")
        return
    t = time.perf_counter()
    llm = LLM(FLAGS.model, dtype=FLAGS.dtype, block_size=FLAGS.block_size,
              gpu_memory_utilization=FLAGS.gpu_memory_utilization,
              num_gpu_blocks_override=FLAGS.num_gpu_blocks_override,
              max_num_seqs=FLAGS.max_num_seqs, max_num_batched_tokens=FLAGS.max_num_batched_tokens,
              max_model_len=FLAGS.max_model_len, attention_backend=FLAGS.attention_backend,
              seed=FLAGS.seed, tokenizer=None, num_scheduler_steps=FLAGS.num_scheduler_steps,
              tensor_parallel_size=FLAGS.tensor_parallel_size)
    jax.block_until_ready(llm.llm_engine.runner.params)
    result["setup_s"] = time.perf_counter() - t
    engine = llm.llm_engine
    cfg = engine.model_config
    result["num_kv_blocks"] = engine.metrics.num_blocks - 1
    print(f"setup {result['setup_s']:.1f}s, {result['num_kv_blocks']} KV blocks", flush=True)
    save()

    # Warm-up: compile the buckets a run needs (timed apart; the runs exclude any stragglers).
    t = time.perf_counter()
    warm = make_requests("fixed", cfg.vocab_size, min(FLAGS.max_num_seqs, FLAGS.num_prompts), 99)
    run_engine(engine, [(p, 4) for p, _ in warm], "warmup")
    result["warmup"] = {"s": time.perf_counter() - t,
                        "compilations": engine.runner.num_compilations,
                        "compile_s": engine.runner.compile_time_s}
    print("warmup", result["warmup"], flush=True)

    if FLAGS.latency and time_left():
        bw = result.get("bandwidth", {"ceiling_TBps": float("nan")})
        result["latency"] = latency_run(llm, cfg, bw)
        print("latency", result["latency"], flush=True)
        save()
        k_main = engine.num_scheduler_steps
        for k in (int(x) for x in FLAGS.latency_steps):
            if k == k_main or not time_left():
                continue
            engine.num_scheduler_steps = k
            result.setdefault("latency_by_steps", {})[str(k)] = latency_run(llm, cfg, bw)
            print(f"latency k={k}", result["latency_by_steps"][str(k)], flush=True)
            save()
        engine.num_scheduler_steps = k_main

    for name in FLAGS.workloads:
        if not time_left():
            break
        reqs = make_requests(name, cfg.vocab_size, FLAGS.num_prompts, FLAGS.seed)
        if name == "fixed" or FLAGS.full_compare_workloads or not FLAGS.compare:
            r = run_engine(engine, reqs, f"paxkv-{name}")
            if name == FLAGS.workloads[0]:
                result["host_at_full_batch"] = host_share_at_full_batch(engine)
                print("host at full batch", result["host_at_full_batch"], flush=True)
            result[f"paxkv_{name}"] = r
            print(json.dumps(r), flush=True)
            save()
        if FLAGS.compare and name != "fixed" and time_left():
            sub = reqs[:FLAGS.static_num_prompts]
            result[f"paxkv_{name}_subset"] = run_engine(engine, sub, f"paxkv-{name}-subset")
            print(json.dumps(result[f"paxkv_{name}_subset"]), flush=True)
            static_cfg = dataclasses.replace(
                engine.config, scheduler=dataclasses.replace(engine.config.scheduler, policy="static"),
                cache=dataclasses.replace(engine.config.cache, num_cpu_blocks=0))
            static = LLMEngine(static_cfg, engine.runner, None)
            static.num_scheduler_steps = engine.num_scheduler_steps
            result[f"static_{name}_subset"] = run_engine(static, sub, f"static-{name}")
            print(json.dumps(result[f"static_{name}_subset"]), flush=True)
            save()
            if on_gpu and FLAGS.hf_num_prompts and time_left():
                hf_sub = reqs[:FLAGS.hf_num_prompts]
                result[f"paxkv_{name}_hf_subset"] = run_engine(engine, hf_sub, f"paxkv-{name}-hf")
                if FLAGS.run_transformers:
                    try:
                        result[f"transformers_{name}_subset"] = run_transformers(
                            engine.runner.params, cfg, hf_sub)
                    except Exception as e:  # noqa: BLE001 - report, keep the rest of the run
                        result[f"transformers_{name}_subset"] = {"error": repr(e)[:500]}
                    print(json.dumps(result[f"transformers_{name}_subset"]), flush=True)
                save()
    result["compilations_total"] = engine.runner.num_compilations
    result["compile_s_total"] = engine.runner.compile_time_s
    save()
    print(f"wrote {out_path}")


if __name__ == "__main__":
    app.run(main)

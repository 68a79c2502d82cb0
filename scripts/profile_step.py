"""Where one decode step's time goes on the device: kernels, dispatch, and the matmul floor.

For each batch size, the runner's real hot path (`Runner.execute`, packing included) is
timed three ways on the same decode step:
- synchronous: one step and wait for its tokens (what the engine pays per step);
- back to back: N steps dispatched without waiting, then one wait (the device's own time
  per step once the host is out of the way);
- multi-step: `execute_multi_decode` with k steps per call, per token.
Then a few steps run under `jax.profiler` and its Perfetto trace is summarized: kernels per
step, device busy time per step, and the kernels that take the time. Last, each weight
matmul of the model alone (XLA, bf16) against the copy bandwidth, to show what the
projections cost at each batch size.

    PYTHONPATH=. python3 scripts/profile_step.py --model llama3-8b --batches 1,64,256 --out_dir DIR
    PYTHONPATH=. python3 scripts/profile_step.py --model tiny --batches 1,4       # CPU smoke
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "llama3-8b", "preset (random weights) or checkpoint dir")
flags.DEFINE_list("batches", ["1", "64", "256"], "decode batch sizes")
flags.DEFINE_integer("context", 512, "tokens already cached per sequence")
flags.DEFINE_integer("max_model_len", 2048, "engine: longest sequence")
flags.DEFINE_integer("max_num_seqs", 256, "engine: running sequences at most")
flags.DEFINE_integer("multi_steps", 8, "k of the multi-step timing (0: skip)")
flags.DEFINE_integer("reps", 20, "timed steps per figure")
flags.DEFINE_integer("trace_steps", 3, "steps under the profiler (0: no trace)")
flags.DEFINE_bool("matmuls", True, "time the weight matmuls alone")
flags.DEFINE_string("attention_backend", "auto", "reference | pallas | auto")
flags.DEFINE_list("kv_cache_dtypes", ["auto"], "one engine per KV dtype (auto, fp8, fp8_e5m2, int8)")
flags.DEFINE_list("decode_bucket_mins", [], "also profile with the smallest decode batch bucket "
                  "set to each of these (the engine pads decode steps to a power of two, at least 8 rows on a GPU)")
flags.DEFINE_string("out_dir", "", "where profile_step.json / .md go (default: print only)")
flags.DEFINE_integer("tensor_parallel_size", 1, "devices the weights and KV heads are split over")

def time_matmuls(cfg, batches: list[int], ceiling_tbps: float) -> list[dict]:
    """Each weight matmul of one layer (and the LM head) alone in XLA, bf16, at each batch."""
    import jax
    import jax.numpy as jnp

    from scripts.bench_common import time_call
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    shapes = [("q", h, cfg.num_heads * cfg.head_dim), ("k or v", h, kv), ("o", h, h),
              ("gate or up", h, i), ("down", i, h), ("lm head", h, cfg.vocab_size)]
    out = []
    for b in batches:
        for name, k, n in shapes:
            w = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16)
            x = jax.random.normal(jax.random.key(2), (b, k), jnp.bfloat16)
            # Chained calls need q's shape back: fold the whole product into q (no slicing
            # that XLA could push into the weight).
            fn = lambda q, w: q + (q @ w).sum(axis=1, keepdims=True).astype(q.dtype) * 1e-6
            s = time_call(fn, (x, w), reps=5, target_s=0.02)
            floor = (k * n * 2) / (ceiling_tbps * 1e12)
            out.append({"batch": b, "matmul": name, "k": k, "n": n, "us": s * 1e6,
                        "floor_us": floor * 1e6, "share_of_bandwidth": floor / s})
    return out


def profile_batch(runner, b: int) -> dict:
    """Synchronous, back-to-back, multi-step and traced timings of one decode step at batch b."""
    import jax

    from paxkv.engine.step_io import SampleRow, WorkItem
    from paxkv.runner.runner import StepProgram, _jit_step, _pack_inputs
    cfg, bs = runner.cfg, runner.block_size
    per_seq = FLAGS.context // bs + 2 + FLAGS.multi_steps // bs + 2
    items = [WorkItem([7 + i], FLAGS.context, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)))
             for i in range(b)]
    rows = [SampleRow(i) for i in range(b)]
    for _ in range(3):
        runner.execute(items, rows)
    sync = []
    for _ in range(FLAGS.reps):
        t = time.perf_counter()
        runner.execute(items, rows)
        sync.append(time.perf_counter() - t)
    # Back to back: the same device inputs, no wait until the end.
    batch, decode_only, st, mode, k = runner.pack_step(items, rows)
    inputs, spec = _pack_inputs(batch, st, runner.mesh)
    pool = runner.kv_pool
    kw = dict(program=StepProgram(spec, cfg, runner.plan, mode, decode_only=decode_only,
                                  num_logprobs=k, mesh=runner.mesh))
    prev = runner._last_tokens
    res, prev, pool = _jit_step(runner.params, pool, inputs, prev, **kw)
    jax.block_until_ready(res)
    dispatch = []
    t = time.perf_counter()
    for _ in range(FLAGS.reps):
        td = time.perf_counter()
        res, prev, pool = _jit_step(runner.params, pool, inputs, prev, **kw)
        dispatch.append(time.perf_counter() - td)
    jax.block_until_ready(res)
    back_to_back = (time.perf_counter() - t) / FLAGS.reps
    runner.kv_pool, runner._last_tokens = pool, prev
    row = {"batch": b, "context": FLAGS.context, "sync_step_ms": 1e3 * statistics.median(sync),
           "back_to_back_step_ms": 1e3 * back_to_back,
           "dispatch_ms": 1e3 * statistics.median(dispatch)}
    if FLAGS.multi_steps:
        k_steps = FLAGS.multi_steps
        for _ in range(2):
            runner.execute_multi_decode(items, rows, k_steps)
        multi = []
        for _ in range(max(3, FLAGS.reps // 4)):
            t = time.perf_counter()
            runner.execute_multi_decode(items, rows, k_steps)
            multi.append(time.perf_counter() - t)
        row["multi_step_k"] = k_steps
        row["multi_step_ms_per_token_step"] = 1e3 * statistics.median(multi) / k_steps
    if FLAGS.trace_steps:
        from scripts.trace_summary import summarize_trace
        with tempfile.TemporaryDirectory() as d:
            jax.profiler.start_trace(d, create_perfetto_trace=True)
            for _ in range(FLAGS.trace_steps):
                runner.execute(items, rows)
            jax.profiler.stop_trace()
            row["trace"] = summarize_trace(d, FLAGS.trace_steps)
    return row


def main(argv):
    del argv
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    import jax

    from paxkv import LLM
    from paxkv.config import pow2_buckets
    from paxkv.runner.buckets import pick_bucket

    result: dict = {"command": " ".join(sys.argv), "jax": jax.__version__,
                    "device": str(jax.devices()[0].device_kind)}
    on_gpu = jax.default_backend() == "gpu"
    if on_gpu:
        from scripts.bench_common import copy_bandwidth
        result["bandwidth"] = copy_bandwidth(smoke=False)
    ceiling = max([v for k, v in result.get("bandwidth", {}).items() if k.endswith("tbps")] or [float("nan")])
    batches = [int(b) for b in FLAGS.batches]
    result["steps"] = []

    def save():
        if FLAGS.out_dir:
            os.makedirs(FLAGS.out_dir, exist_ok=True)
            with open(os.path.join(FLAGS.out_dir, "profile_step.json"), "w") as f:
                json.dump(result, f, indent=1)

    cfg = None
    for kv_dtype in FLAGS.kv_cache_dtypes:
        llm = LLM(FLAGS.model, max_num_seqs=max(FLAGS.max_num_seqs, max(batches)),
                  max_model_len=FLAGS.max_model_len, attention_backend=FLAGS.attention_backend,
                  tokenizer=None, kv_cache_dtype=kv_dtype, tensor_parallel_size=FLAGS.tensor_parallel_size,
                  num_gpu_blocks_override=max(max(batches) * (FLAGS.context // 16 + 40),
                                                 FLAGS.max_model_len // 16 + 2) + 64)
        runner = llm.llm_engine.runner
        cfg = runner.cfg
        result["backend"] = runner.backend
        default_buckets = runner.seq_buckets
        cases = [(b, None) for b in batches] + [
            (b, int(m)) for m in FLAGS.decode_bucket_mins for b in batches]
        for b, bucket_min in cases:
            runner.seq_buckets = default_buckets if bucket_min is None else list(pow2_buckets(
                bucket_min, max(bucket_min, default_buckets[-1])))
            row = profile_batch(runner, b)
            row["kv_cache_dtype"] = kv_dtype
            row["decode_rows"] = pick_bucket(b, runner.seq_buckets)
            result["steps"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
            if "trace" in row:
                tr = row["trace"]
                print({k: v for k, v in tr.items() if k not in ("top", "boundaries")}, flush=True)
                for t in tr.get("top", [])[:16]:
                    print(f"   {t['ms_per_step']:8.3f} ms  x{t['calls_per_step']:6.1f}  "
                          f"{t['mean_us']:8.2f} us  {t['name']}", flush=True)
                for g in tr.get("boundaries", []):
                    print(f"   gap {g['median_gap_us']:6.2f} us x{g['per_step']:6.1f} "
                          f"= {g['us_per_step']:7.1f} us/step  {g['before']} -> {g['after']}", flush=True)
            save()
        del llm, runner
        gc.collect()
    if FLAGS.matmuls and on_gpu:
        result["matmuls"] = time_matmuls(cfg, batches, ceiling)
        for m in result["matmuls"]:
            print(f"B={m['batch']:4d} {m['matmul']:10s} {m['us']:8.1f} us  floor {m['floor_us']:7.1f}"
                  f"  {100 * m['share_of_bandwidth']:5.1f}%", flush=True)
        save()
    print("done", flush=True)


if __name__ == "__main__":
    # appended, so a tree first on PYTHONPATH (another commit's, for an A/B) is the one run
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    app.run(main)

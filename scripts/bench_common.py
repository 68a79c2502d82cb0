"""What the kernel benchmarks share: the reference figures' shapes, timing, test data, and
the run scaffolding (flags, time budget, copy bandwidth, section loop, report files).

Timing: median over repeats of N back-to-back calls chained in one executable (each call's
output is the next call's query), after compile and warm-up (`time_call`); the probes'
method, one jit of many launches dispatched a fixed number of times, is `back_to_back`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from typing import Callable

import numpy as np
import jax
import jax.numpy as jnp

# The reference figures' decode shapes: 32 query / 8 KV heads, head_dim 128, block 16.
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DECODE_SHAPES = [(32, 1024), (64, 2048), (128, 2048), (256, 1024), (16, 8192)]
# Prefill work: (label, sequences, new tokens each, context after them).
PREFILL_WORK = [("prompts 8 x 2048", 8, 2048, 2048), ("chunks 8 x 512 over 4096", 8, 512, 4608)]
CHAIN = 8


def decode_shapes(smoke: bool, only: str = "") -> list[tuple[int, int]]:
    """(batch, context) of each decode case; `smoke`: two tiny ones for CPU interpret mode;
    `only`: a comma list of indices into that list."""
    shapes = [(4, 64), (2, 256)] if smoke else DECODE_SHAPES
    return [shapes[int(i)] for i in only.split(",")] if only else shapes


def prefill_work(smoke: bool) -> list[tuple[str, int, int, int]]:
    """PREFILL_WORK, or two tiny cases (one prompt, one chunk over context) with `smoke`."""
    return [("prompts", 2, 64, 64), ("chunks", 2, 32, 96)] if smoke else PREFILL_WORK


class Clock:
    """Seconds left of the run's time budget."""

    def __init__(self, budget_s: float):
        self.start = time.perf_counter()
        self.budget = budget_s

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)


def log(msg: str) -> None:
    print(msg, flush=True)


def chained(fn: Callable, n: int = CHAIN) -> Callable:
    """One executable running `fn` n times, each call's output fed back as the next query:
    a true dependency (nothing can be hoisted) and no host dispatch between the calls."""
    def run(q, *rest):
        for _ in range(n):
            q = fn(q, *rest)
        return q
    return jax.jit(run)


def time_call(fn: Callable, args: tuple, reps: int = 7, target_s: float = 0.03,
              chain: bool = True) -> float:
    """Median device seconds per call of `fn(*args)` (`fn` maps q -> output shaped like q):
    `CHAIN` chained calls per executable, repeated back to back, after compile + warm-up."""
    n = CHAIN if chain else 1
    f = chained(fn) if chain else fn
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


def back_to_back(fn: Callable, *args, reps: int = 20, trials: int = 5, donated: int = 0) -> float:
    """Median seconds per dispatch of `fn(*args)`: after one warm-up call, `reps` dispatches
    back to back and one wait, `trials` times (the probes' method: each dispatch is one jit
    holding many launches). `donated`: fn donates its last `donated` arguments and returns
    their successors as its last outputs; they are threaded through the calls."""
    args = list(args)

    def call():
        out = fn(*args)
        if donated:
            args[-donated:] = out[-donated:]
        return out
    jax.block_until_ready(call())
    samples = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = call()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def decode_backend(args: argparse.Namespace) -> str:
    """The `backend=` for paged_attention from `--backend` ("all" -> "auto")."""
    return "auto" if args.backend == "all" else args.backend


def rel_err(out, ref) -> float:
    """Relative L2 error of `out` against `ref`, in float32."""
    out = jnp.asarray(out, jnp.float32)
    ref = jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def check_and_time(fn: Callable, args: tuple, ref, smoke: bool) -> tuple[float, float, jax.Array]:
    """Run `fn(*args)` once, compare it with `ref`, then time it (`time_call`; fewer repeats
    in a smoke run): (seconds per call, relative error, the output)."""
    out = fn(*args)
    err = rel_err(out, ref)
    return time_call(fn, args, reps=3 if smoke else 7), err, out


def copy_bandwidth(smoke: bool) -> dict:
    """Device-to-device copy (bytes read + written), PyTorch memcpy and XLA elementwise."""
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
        except Exception as e:  # torch missing or no GPU: report XLA's copy only
            res["torch_copy_error"] = repr(e)[:200]
    x = jax.random.normal(jax.random.key(0), (n_bytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: x + jnp.bfloat16(1))
    t = time_call(f, (x,), chain=False)          # chained x + 1 would fuse into one pass
    res["xla_elementwise_tbps"] = 2 * n_bytes / t / 1e12
    del x
    return res


def make_pool(key: jax.Array, num_blocks: int, dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
    """Random K and V pages `[num_blocks, BLOCK, KV_HEADS, HEAD_DIM]`."""
    kk, kv = jax.random.split(key)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return (jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype))


def permuted_tables(seed: int, batch: int, pages_per_seq: int, num_blocks: int) -> jax.Array:
    """Block tables `[batch, pages_per_seq]` over randomly permuted blocks (never block 0)."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(np.arange(1, num_blocks))[: batch * pages_per_seq]
    return jnp.asarray(perm.reshape(batch, pages_per_seq).astype(np.int32))


def decode_inputs(case: int, batch: int, ctx: int):
    """Random bf16 inputs of decode case `case`: `(q, k, v, tables, lens)`, one query token
    per sequence, every sequence at the full context, over randomly permuted pages."""
    pages = ctx // BLOCK
    num_blocks = batch * pages + 1
    key = jax.random.key(100 + case)
    k, v = make_pool(key, num_blocks)
    q = jax.random.normal(jax.random.fold_in(key, 7), (batch, Q_HEADS, HEAD_DIM), jnp.bfloat16)
    tables = permuted_tables(case, batch, pages, num_blocks)
    lens = jnp.full((batch,), ctx, jnp.int32)
    return q, k, v, tables, lens


def prefill_inputs(case: int, seqs: int, q_len: int, ctx: int):
    """Random bf16 inputs of prefill case `case`: `(q, k, v, tables, lens, cu_q_lens)`, the
    last `q_len` of `ctx` positions of each sequence as new tokens, over permuted pages."""
    pages = ctx // BLOCK
    num_blocks = seqs * pages + 1
    key = jax.random.key(300 + case)
    k, v = make_pool(key, num_blocks)
    tables = permuted_tables(50 + case, seqs, pages, num_blocks)
    q = jax.random.normal(jax.random.fold_in(key, 3), (seqs * q_len, Q_HEADS, HEAD_DIM),
                          jnp.bfloat16)
    lens = jnp.full((seqs,), ctx, jnp.int32)
    cu = jnp.arange(seqs + 1, dtype=jnp.int32) * q_len
    return q, k, v, tables, lens, cu


def fmt(x, spec: str = "{:.1f}") -> str:
    """A table cell: `spec` of x, or "-" when there is no figure."""
    return "-" if x is None else spec.format(x)


def parse_args(doc: str, budget_s: float, quick_help: str, sections: str) -> argparse.Namespace:
    """The flags every kernel benchmark takes."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="directory for the table/json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    parser.add_argument("--budget", type=float, default=budget_s, help="seconds for the whole run")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--skip", default="", help=f"comma list of sections to skip: {sections}")
    parser.add_argument("--backend", default="auto", choices=("triton", "mosaic", "auto", "all"),
                        help="paxkv decode kernel backend (Mosaic GPU needs a Hopper GPU); "
                        "bench_decode_backends.py runs both unless one is named")
    parser.add_argument("--shapes", default="", help="comma list of decode shape indices to run "
                        "(0-4, the reference figures' order; default all)")
    return parser.parse_args()


def run_sections(args: argparse.Namespace,
                 sections: list[tuple[str, Callable[[argparse.Namespace, Clock, dict], None]]],
                 write_report: Callable[[argparse.Namespace, dict], str]) -> dict:
    """Measures the copy bandwidth, then runs each section not in `--skip` within the time
    budget (a failing section is logged, not fatal), then writes and prints the report;
    returns the results."""
    clock = Clock(args.budget)
    dev = jax.devices()[0]
    results = {"jax": jax.__version__, "device": getattr(dev, "device_kind", str(dev)),
               "decode": [], "prefill": []}
    log(f"JAX {jax.__version__} on {results['device']}")
    results["bandwidth"] = copy_bandwidth(args.smoke)
    log(f"copy bandwidth: {results['bandwidth']}")
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
    return results


def pipelined_ms(dispatch, fetch, steps: int) -> float:
    """Time per step with each step dispatched before the previous one is read, as the
    asynchronous engine runs them: the host's packing overlaps the device's last step."""
    prev = dispatch()
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = dispatch()
        fetch(prev)
        prev = nxt
    fetch(prev)
    return 1e3 * (time.perf_counter() - t0) / steps


def dispatched_ms(dispatch, fetch, steps: int, trials: int = 1) -> float:
    """Device time per step of one step program: after a warm-up call, `steps` dispatches
    back to back with no host work between and the last one waited for (they run in order
    on the device); the median over `trials`."""
    fetch(dispatch())
    per = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(steps):
            pending = dispatch()
        fetch(pending)
        per.append(1e3 * (time.perf_counter() - t0) / steps)
    return statistics.median(per)


def pipelined_rounds(cases: dict, steps: int, rounds: int, base: str) -> dict:
    """Every case's pipelined time per step, `rounds` times interleaved (`cases`: name ->
    (dispatch, fetch)); median ms and the median over rounds of the round's ratio to `base`
    (the ratio's range over rounds in `ratio_spread`)."""
    per = {name: [] for name in cases}
    for name, (dispatch, fetch) in cases.items():   # warm-up (and compile) every case
        pipelined_ms(dispatch, fetch, 2)
    for _ in range(rounds):
        for name, (dispatch, fetch) in cases.items():
            per[name].append(pipelined_ms(dispatch, fetch, steps))
    out = {}
    for name, ms in per.items():
        ratios = [m / b for m, b in zip(ms, per[base])]
        out[name] = {"median_ms": statistics.median(ms), "round_ms": ms,
                     "ratio_to_base": statistics.median(ratios),
                     "ratio_spread": [min(ratios), max(ratios)]}
    return out


def decode_batch_engine(model: str, batch: int, context: int, smoke: bool,
                        rng: np.random.Generator):
    """An `LLM` whose pool holds `batch` sequences of `context` tokens, and the decode
    WorkItems that step all of them (one new token each, every row at the same context,
    16-token blocks, no prefix caching; token ids from `rng`) -> (llm, items)."""
    import math

    from paxkv import LLM
    from paxkv.engine.step_io import WorkItem

    bs = 16
    per_seq = math.ceil((context + 1) / bs)
    llm = LLM(model, num_gpu_blocks_override=batch * per_seq + 2, max_num_seqs=batch,
              max_model_len=max(2048, context + 64) if not smoke else 128,
              max_num_batched_tokens=max(batch, 256), block_size=bs, tokenizer=None,
              enable_prefix_caching=False)
    vocab = llm.llm_engine.runner.cfg.vocab_size
    items = [WorkItem([int(rng.integers(3, vocab))], context - 1,
                      list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))) for i in range(batch)]
    return llm, items


def save_report(out_dir: str | None, stem: str, text: str, results: dict) -> None:
    """Writes the table to OUT_DIR/STEM_table.md and the results to OUT_DIR/STEM.json."""
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}_table.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)

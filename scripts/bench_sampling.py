"""What the sampling features cost at batch-256 decode: penalties, structured outputs, neither.

One run, on the same weights, pool and decode batch (every sequence at the same context),
times the runner's decode step end to end: packing on the host, one transfer in, the jitted
step (forward + sampler), one transfer out, synchronized on the sampled ids. Cases:

- today: the same forward with the sampler as it was before the features existed (a copy of
  its body kept here as the baseline);
- off: the current sampler with no row using any feature (must equal today);
- penalties: presence, frequency and repetition penalties on every row (history = the
  whole context, counted on the device);
- structured: a JSON schema on a quarter of the rows; every step the host fills the
  llguidance masks for those rows (in llguidance's thread pool) while the device runs the
  forward, the sampler applies them, and the host advances the matchers on the sampled ids. The grammar runs over the embedded model's tokenizer
  (4,096 tokens, ids widened to the 8B vocabulary), so the host share is a lower bound for a
  128k-token tokenizer; the device share is at full width.

The cases run interleaved, `--rounds` rounds of `--steps` steps each (today, off, penalties,
structured, today, off, ...) after `--warmup` steps of each (compilation excluded), so slow
drift of the machine over the run touches every case alike. Reported: the median step of each
case over all its rounds, and the median over rounds of each round's ratio to `off` (the
cost figure: both medians of a ratio come from steps run side by side).

Then the same today / off / penalties steps pipelined, as the asynchronous engine runs them
(step i+1 dispatched before step i is read, so the host's packing overlaps the device): the
per-step cost an engine serving penalized requests pays. Structured outputs are not
pipelined (their masks need step i's token on the host), so they have the first table only.

    PYTHONPATH=. python3 scripts/bench_sampling.py --out_dir results
    PYTHONPATH=. python3 scripts/bench_sampling.py --smoke --out_dir /tmp/s   # CPU, seconds
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import decode_batch_engine, pipelined_rounds  # noqa: E402  (shared with bench_sampler_modes)

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "llama3-8b", "preset (random bf16 weights)")
flags.DEFINE_integer("batch", 256, "decode rows")
flags.DEFINE_integer("context", 512, "tokens of context per row")
flags.DEFINE_integer("steps", 20, "timed steps per case and round")
flags.DEFINE_integer("rounds", 6, "rounds over the cases, interleaved")
flags.DEFINE_integer("warmup", 5, "untimed steps per case (the first compiles)")
flags.DEFINE_float("structured_fraction", 0.25, "share of rows with a JSON schema")
flags.DEFINE_bool("smoke", False, "CPU check: tiny-random, batch 8, context 40")
flags.DEFINE_string("out_dir", "scratch/results", "where sampling.md and sampling.json go (--out_dir=results updates the committed results)")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def today_step_fn():
    """The jitted step with the sampler's body as it was before the features (baseline)."""
    import jax
    import jax.numpy as jnp

    from paxkv.model.forward import forward
    from paxkv.runner import transfer
    from paxkv.runner.runner import _unpack_inputs

    def filtered_sample(x, top_k, top_p, min_p, key):
        """The filtered draw as it was then: sort, k/p/min-p masks, Gumbel over sorted ranks."""
        order = jnp.argsort(-x)
        vals = x[order]
        probs = jax.nn.softmax(vals)
        keep = (top_k <= 0) | (jnp.arange(x.shape[0]) < top_k)
        keep &= jnp.cumsum(probs) - probs < top_p
        keep &= probs >= min_p * probs[0]
        keep = keep.at[0].set(True)
        gumbel = jax.random.gumbel(key, x.shape, jnp.float32)
        return order[jnp.argmax(jnp.where(keep, vals + gumbel, -jnp.inf))].astype(jnp.int32)

    def step(params, pool, inputs, *, spec, cfg, backend, decode_only):
        batch, st, _ = _unpack_inputs(inputs, spec)
        logits, pool = forward(params, batch, pool, cfg, backend=backend, decode_only=decode_only)
        rows = logits[st.logits_rows].astype(jnp.float32)
        raw = jax.nn.log_softmax(rows, axis=-1)
        greedy = jnp.argmax(rows, axis=-1).astype(jnp.int32)
        keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.PRNGKey(s), t))(st.seeds, st.steps)
        temp = jnp.where(st.temperature > 0, st.temperature, 1.0)[:, None]
        sampled = jax.vmap(filtered_sample)(rows / temp, st.top_k, st.top_p, st.min_p, keys)
        tokens = jnp.where(st.temperature > 0, sampled, greedy)
        chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
        return transfer.pack_device((tokens, chosen)), pool

    return jax.jit(step, static_argnames=("spec", "cfg", "backend", "decode_only"), donate_argnums=(1,))


def timed(fn, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def interleaved(cases: dict, steps: int, warmup: int, rounds: int) -> dict:
    """Run every case `rounds` times in turn; per case, its step times of every round."""
    for name, fn in cases.items():
        timed(fn, warmup)
        print("warm", name, flush=True)
    times = {name: [] for name in cases}
    for k in range(rounds):
        for name, fn in cases.items():
            times[name].append(timed(fn, steps))
        print(f"round {k + 1}/{rounds}", {n: round(1e3 * statistics.median(t[-1]), 3)
                                           for n, t in times.items()}, flush=True)
    return times


def summarize(times: dict, base: str = "off") -> dict:
    """Median, p90 and min over all steps; median over rounds of the round's median / base's."""
    out = {}
    for name, per_round in times.items():
        flat = sorted(t for r in per_round for t in r)
        ratios = [statistics.median(r) / statistics.median(b) for r, b in zip(per_round, times[base])]
        out[name] = {"median_ms": 1e3 * statistics.median(flat), "min_ms": 1e3 * flat[0],
                     "p90_ms": 1e3 * flat[int(0.9 * (len(flat) - 1))],
                     "round_medians_ms": [1e3 * statistics.median(r) for r in per_round],
                     "ratio_to_off": statistics.median(ratios),
                     "ratio_spread": [min(ratios), max(ratios)],
                     "steps": len(flat), "rounds": len(per_round)}
    return out


def main(argv):
    del argv
    import jax
    import numpy as np

    from paxkv.engine.step_io import SampleRow
    from paxkv.runner.runner import _pack_inputs
    from paxkv.sampling.rows import RowFeatures

    model, batch, ctx, steps, warmup = FLAGS.model, FLAGS.batch, FLAGS.context, FLAGS.steps, FLAGS.warmup
    rounds = FLAGS.rounds
    if FLAGS.smoke:
        model, batch, ctx, steps, warmup, rounds = "tiny-random", 8, 40, 3, 2, 2
    rng = np.random.default_rng(0)
    llm, items = decode_batch_engine(model, batch, ctx, FLAGS.smoke, rng)
    runner = llm.llm_engine.runner
    cfg = runner.cfg
    plain = [SampleRow(i, 0.8, -1, 0.95, 0.0, i, 7) for i in range(batch)]
    results = {"model": model, "batch": batch, "context": ctx, "jax": jax.__version__,
               "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
               "steps_per_round": steps, "rounds": rounds, "warmup": warmup}

    today = today_step_fn()

    def dispatch_today():
        """One step of today's program, dispatched and not waited for."""
        b, decode_only, st, _, _ = runner.pack_step(items, plain)
        inputs, spec = _pack_inputs(b, st)
        out, runner.kv_pool = today(runner.params, runner.kv_pool, inputs, spec=spec, cfg=cfg,
                                    plan=runner.plan, decode_only=decode_only)
        return out

    def run_today():
        np.asarray(dispatch_today())

    history = [rng.integers(3, cfg.vocab_size, ctx - 1).astype(np.int32) for _ in range(batch)]
    penalized = [r._replace(features=RowFeatures(penalties=(0.4, 0.3, 1.15), history=h,
                                                 output_start=ctx // 2))
                 for r, h in zip(plain, history)]
    cases = {"today": run_today, "off": lambda: runner.execute(items, plain),
             "penalties": lambda: runner.execute(items, penalized)}
    host_s: list[float] = []
    try:
        cases["structured"], rows = structured_case(runner, items, plain, batch, host_s)
    except ImportError as e:
        results["structured_skipped"] = f"llguidance is not installed ({e})"
    results["cases"] = summarize(interleaved(cases, steps, warmup, rounds))

    results["pipelined"] = pipelined_rounds({
        "today": (dispatch_today, np.asarray),
        "off": (lambda: runner.dispatch(items, plain), runner.fetch),
        "penalties": (lambda: runner.dispatch(items, penalized), runner.fetch)}, steps, rounds, "off")
    if "structured" in cases:   # host time of the timed steps only (two entries per step)
        per_step = [a + b for a, b in zip(host_s[0::2], host_s[1::2])][warmup:]
        results["cases"]["structured"].update(host_mask_ms=1e3 * float(np.median(per_step)), rows=rows)
    write_report(results)


def structured_case(runner, items, plain, batch, host_s: list) -> tuple:
    """A JSON schema on a quarter of the rows: masks filled on the host each step.
    Returns (the step, rows constrained); the host's time per step goes to `host_s`."""

    import llguidance  # noqa: F401  (ImportError: the case is skipped)
    from paxkv.assets import tiny_model_dir
    from paxkv.engine.structured_output import StructuredOutputs
    from paxkv.sampling.rows import RowFeatures
    from paxkv.sampling_params import StructuredOutputsParams
    from paxkv.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model_dir())
    so = StructuredOutputs(tok, runner.cfg.vocab_size, tok.eos_token_ids)
    params = StructuredOutputsParams(json=SCHEMA)
    m = max(1, int(round(batch * FLAGS.structured_fraction)))
    constrained = list(range(0, batch, batch // m))[:m]
    matchers = [so.compile(params) for _ in constrained]

    pending = list(plain)
    for i in constrained:
        pending[i] = pending[i]._replace(features=RowFeatures(mask="pending"))

    def fill(rows):   # as the engine does: runs on the host while the forward runs
        t0 = time.perf_counter()
        masks = so.fill_masks(matchers)
        for j, i in enumerate(constrained):
            rows[i] = rows[i]._replace(features=RowFeatures(mask=masks[j]))
        host_s.append(time.perf_counter() - t0)
        return rows

    def step():
        sample, _ = runner.execute(items, pending, fill)
        t1 = time.perf_counter()
        for j, i in enumerate(constrained):
            mt = matchers[j]
            so.consume(mt, int(sample.tokens[i]))
            if mt.is_stopped() or mt.is_error():
                mt.reset()
        host_s.append(time.perf_counter() - t1)

    return step, m


def write_report(results: dict) -> None:
    c = results["cases"]
    lines = [f"# Sampling features: cost at batch-{results['batch']} decode",
             "",
             f"Command: `PYTHONPATH=. python3 scripts/bench_sampling.py --out_dir DIR` "
             f"({results['model']}, random bf16 weights, {results['batch']} rows at context "
             f"{results['context']}); {results['device']}, JAX {results['jax']}. Device-synchronized "
             "runner decode steps (host packing, transfers, forward and sampler), the cases "
             f"interleaved: {results['rounds']} rounds of {results['steps_per_round']} steps each "
             f"after {results['warmup']} warm-up steps. `vs off` is the median over rounds of the "
             "round's median step against `off`'s in the same round (range over rounds in "
             "brackets).", "",
             "| case | median ms | p90 ms | vs off | target |", "| --- | --- | --- | --- | --- |"]
    targets = {"today": "", "off": "= today", "penalties": "<= +3%", "structured": "<= +10%"}
    for name in ("today", "off", "penalties", "structured"):
        r = c.get(name)
        if r is None:
            lines.append(f"| {name} | {results.get(name + '_skipped', 'not run')} | | | {targets[name]} |")
            continue
        lo, hi = (100.0 * (x - 1.0) for x in r["ratio_spread"])
        rel = f"{100.0 * (r['ratio_to_off'] - 1.0):+.1f}% [{lo:+.1f}, {hi:+.1f}]"
        extra = f" (host masks {r['host_mask_ms']:.2f} ms, {r['rows']} rows)" if "host_mask_ms" in r else ""
        lines.append(f"| {name}{extra} | {r['median_ms']:.3f} | {r['p90_ms']:.3f} | {rel} | "
                     f"{targets[name]} |")
    pipe = results.get("pipelined")
    if pipe:
        lines += ["", "Pipelined, as the asynchronous engine runs them (each step dispatched before the "
                  "previous one is read, so host packing overlaps the device; structured outputs "
                  "stay synchronous in the engine and are not repeated here):", "",
                  "| case | median ms per step | vs off | target |", "| --- | --- | --- | --- |"]
        for name in ("today", "off", "penalties"):
            r = pipe[name]
            lo, hi = (100.0 * (x - 1.0) for x in r["ratio_spread"])
            lines.append(f"| {name} | {r['median_ms']:.3f} | {100.0 * (r['ratio_to_base'] - 1.0):+.1f}% "
                         f"[{lo:+.1f}, {hi:+.1f}] | {targets[name]} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if FLAGS.out_dir:
        os.makedirs(FLAGS.out_dir, exist_ok=True)
        with open(os.path.join(FLAGS.out_dir, "sampling.md"), "w") as f:
            f.write(text)
        with open(os.path.join(FLAGS.out_dir, "sampling.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(main)

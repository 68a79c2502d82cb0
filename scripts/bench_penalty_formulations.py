"""The penalties' device work alone, in two exact formulations, on `[rows, vocab]` logits.

- sort (paxkv's, `sampling/processors.apply_penalties`): sort each row's context, count the
  outputs per run of equal ids, gather / penalize / set back only the context's logits;
- dense: one int32 scatter-add over `[rows, vocab]` (the in-use count in the low 16 bits,
  the output count above), then one elementwise pass over every logit.

Both must agree (the script fails if they differ); the median of 30 synchronized calls
after warm-up is reported per context width.

    PYTHONPATH=. python3 scripts/bench_penalty_formulations.py            # 256 x 128256
    PYTHONPATH=. python3 scripts/bench_penalty_formulations.py --smoke    # CPU, seconds
"""
from __future__ import annotations

import json
import statistics
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("rows", 256, "sampling rows")
flags.DEFINE_integer("vocab", 128256, "vocabulary (Llama-3)")
flags.DEFINE_list("contexts", ["513", "1025", "2049"], "context widths (history + fed token)")
flags.DEFINE_integer("reps", 30, "timed calls per figure")
flags.DEFINE_bool("smoke", False, "tiny shapes")


def dense_penalties(logits, penalties, tokens, in_use, is_output):
    """The same penalties through one dense `[R, V]` int32 count array."""
    import jax.numpy as jnp
    rows, vocab = logits.shape
    r = jnp.broadcast_to(jnp.arange(rows)[:, None], tokens.shape)
    valid = in_use & (tokens >= 0) & (tokens < vocab)
    ids = jnp.where(valid, tokens, vocab)
    inc = 1 + (is_output & valid).astype(jnp.int32) * 65536
    c = jnp.zeros((rows, vocab), jnp.int32).at[r, ids].add(inc, mode="drop")
    counts = (c >> 16).astype(jnp.float32)
    presence, frequency, repetition = penalties[:, 0:1], penalties[:, 1:2], penalties[:, 2:3]
    penalized = jnp.where(logits > 0, logits / repetition, logits * repetition)
    out = jnp.where((c & 65535) > 0, penalized, logits)
    return out - frequency * counts - presence * (counts > 0).astype(jnp.float32)


def main(argv) -> None:
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from paxkv.sampling import processors

    rows, vocab, contexts, reps = FLAGS.rows, FLAGS.vocab, [int(c) for c in FLAGS.contexts], FLAGS.reps
    if FLAGS.smoke:
        rows, vocab, contexts, reps = 4, 1000, [65], 2
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows,
              "vocab": vocab, "contexts": {}}
    fns = {"sort": jax.jit(processors.apply_penalties), "dense": jax.jit(dense_penalties)}
    for width in contexts:
        rng = np.random.default_rng(width)
        args = (jnp.asarray(rng.standard_normal((rows, vocab)).astype(np.float32)),
                jnp.asarray(np.tile([[0.4, 0.3, 1.15]], (rows, 1)).astype(np.float32)),
                jnp.asarray(rng.integers(0, min(vocab, 4000), (rows, width)).astype(np.int32)))
        in_use = jnp.asarray(rng.random((rows, width)) < 0.95)
        args += (in_use, in_use & jnp.asarray(np.arange(width)[None, :] > width // 2))
        outs, row = {}, {}
        for name, fn in fns.items():
            for _ in range(3):
                outs[name] = fn(*args).block_until_ready()
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                fn(*args).block_until_ready()
                times.append(time.perf_counter() - t)
            row[f"{name}_ms"] = 1e3 * statistics.median(times)
        row["max_abs_diff"] = float(jnp.max(jnp.abs(outs["sort"] - outs["dense"])))
        result["contexts"][width] = row
        if row["max_abs_diff"] > 1e-5:
            raise SystemExit(f"context {width}: the formulations differ by {row['max_abs_diff']}")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    app.run(main)

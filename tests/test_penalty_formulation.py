"""The sparse penalties (gather the context's logits, penalize, set back) equal the plain
dense formulation ([R, V] seen and count arrays) exactly, on fresh random inputs packed as the
runner packs them: repeated ids, -1 padding, rows without penalties or history, windows that
end mid-history, outputs starting anywhere (or nowhere) in the window."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv.sampling import processors as proc
from paxkv.sampling.rows import RowFeatures, pack_row_features


def dense_penalties(logits, penalties, tokens, in_use, is_output):
    """The straightforward formulation: dense seen mask and output counts over the vocabulary."""
    rows, vocab = logits.shape
    r = jnp.broadcast_to(jnp.arange(rows)[:, None], tokens.shape)
    ok = (tokens >= 0) & (tokens < vocab)
    seen = jnp.zeros((rows, vocab), jnp.bool_).at[r, jnp.where(in_use & ok, tokens, vocab)].set(
        True, mode="drop")
    counts = jnp.zeros((rows, vocab), jnp.float32).at[
        r, jnp.where(is_output & ok, tokens, vocab)].add(1.0, mode="drop")
    presence, frequency, repetition = penalties[:, 0:1], penalties[:, 1:2], penalties[:, 2:3]
    penalized = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = jnp.where(seen, penalized, logits)
    return logits - frequency * counts - presence * (counts > 0).astype(jnp.float32)


def random_step(seed: int, rows: int, vocab: int, distinct: int):
    """Rows as the engine builds them: some penalized with a history window, some with bias
    only (no history), some padding (None); ids drawn from `distinct` values so they repeat."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 3.0, (rows, vocab)).astype(np.float32)
    logits[rng.random((rows, vocab)) < 0.05] = 0.0           # both branches of the repetition rule
    logits[0, :3] = -np.inf                                    # banned earlier in the sampler
    feats = []
    for _ in range(rows):
        kind = rng.integers(0, 4)
        if kind == 3:
            feats.append(None)
            continue
        if kind == 2:
            feats.append(RowFeatures(logit_bias={int(rng.integers(vocab)): 1.0}))
            continue
        n = int(rng.integers(0, 90))
        history = rng.integers(0, distinct, n).astype(np.int32)
        start = int(rng.integers(-3, n + 2))     # <= 0: the whole window is output
        pen = tuple(float(x) for x in (rng.uniform(-2, 2), rng.uniform(-2, 2), rng.uniform(0.5, 2)))
        feats.append(RowFeatures(penalties=pen, history=history, output_start=start))
    pen, hist, meta, *_ = (jnp.asarray(a) for a in pack_row_features(feats, rows, vocab))
    fed = jnp.asarray(rng.integers(0, distinct, rows), jnp.int32)
    return jnp.asarray(logits), pen, proc.contexts(hist, meta, fed)


@pytest.mark.slow
@pytest.mark.parametrize("seed,vocab,distinct", [(0, 97, 12), (1, 97, 97), (2, 1000, 30),
                                                 (3, 50, 50), (4, 4099, 4099)])
def test_sparse_penalties_equal_dense(seed, vocab, distinct):
    logits, pen, (tokens, in_use, is_out) = random_step(seed, 12, vocab, distinct)
    assert int(np.asarray(is_out).sum()) > 0 and not bool(np.asarray(in_use).all())
    # Op by op, every step is one IEEE operation on the same values: equal to the bit.
    fast = proc.apply_penalties(logits, pen, tokens, in_use, is_out)
    want = dense_penalties(logits, pen, tokens, in_use, is_out)
    np.testing.assert_array_equal(np.asarray(fast), np.asarray(want))
    assert not np.array_equal(np.asarray(fast), np.asarray(logits))
    # Compiled, XLA fuses each differently (a contracted multiply-add moves the last bit, as
    # it does between the dense form compiled and run op by op).
    fast = jax.jit(proc.apply_penalties)(logits, pen, tokens, in_use, is_out)
    want = jax.jit(dense_penalties)(logits, pen, tokens, in_use, is_out)
    np.testing.assert_allclose(np.asarray(fast), np.asarray(want), rtol=1e-6, atol=1e-6)

def test_counts_runs_of_equal_ids():
    """Output counts per sorted id, including runs at the row's ends and a run of one."""
    keys = jnp.asarray([[5, 1, 5, 9, 5, 1], [2, 2, 2, 2, 2, 2]], jnp.int32)
    outs = jnp.asarray([[1, 0, 1, 1, 0, 1], [0, 1, 0, 1, 1, 0]], jnp.bool_)
    sorted_keys, counts = proc._output_counts(keys, outs)
    np.testing.assert_array_equal(np.asarray(sorted_keys), [[1, 1, 5, 5, 5, 9], [2] * 6])
    np.testing.assert_array_equal(np.asarray(counts), [[1, 1, 2, 2, 2, 1], [3] * 6])

"""The device logits processors against transformers' logits processors, OpenAI's definition
of presence and frequency penalties, and llguidance's own bitmask application, on fresh
random inputs (packed exactly as the runner packs them)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the transformers reference) is not installed")
from transformers.generation.logits_process import (NoBadWordsLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor)

import jax
import jax.numpy as jnp

from paxkv.sampling import processors as proc
from paxkv.sampling.rows import RowFeatures, pack_row_features

VOCAB = 97


def rand_case(seed: int, rows: int = 6, max_len: int = 23):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 3.0, (rows, VOCAB)).astype(np.float32)
    contexts, starts = [], []
    for _ in range(rows):
        n = int(rng.integers(1, max_len))
        contexts.append(rng.integers(0, 12, n).astype(np.int32))   # few ids: many repeats
        starts.append(int(rng.integers(0, n + 1)))                 # prompt = context[:start]
    return rng, logits, contexts, starts


def packed(features, rows):
    return [jnp.asarray(a) for a in pack_row_features(features, rows, VOCAB)]


def contexts_on_device(contexts, starts, features):
    """history = every token before the fed one; the fed one goes in separately."""
    pen, hist, meta, *_ = packed(features, len(contexts))
    fed = jnp.asarray([c[-1] for c in contexts], jnp.int32)
    return pen, proc.contexts(hist, meta, fed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_repetition_penalty_equals_transformers(seed):
    rng, logits, contexts, starts = rand_case(seed)
    penalty = float(rng.uniform(1.1, 2.0))
    feats = [RowFeatures(penalties=(0.0, 0.0, penalty), history=c[:-1], output_start=s)
             for c, s in zip(contexts, starts)]
    pen, (tokens, in_use, is_out) = contexts_on_device(contexts, starts, feats)
    got = np.asarray(proc.apply_penalties(jnp.asarray(logits), pen, tokens, in_use, is_out))
    ref = RepetitionPenaltyLogitsProcessor(penalty)
    for r, c in enumerate(contexts):   # transformers sees prompt + output as input_ids
        want = ref(torch.tensor(c[None].astype(np.int64)), torch.tensor(logits[r:r + 1].copy()))
        np.testing.assert_allclose(got[r], want[0].numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_presence_and_frequency_follow_openai(seed):
    """OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence, with c[j]
    the count of token j in the output so far (the prompt does not count)."""
    rng, logits, contexts, starts = rand_case(seed)
    feats, want = [], logits.copy()
    for r, (c, s) in enumerate(zip(contexts, starts)):
        pres, freq = (float(x) for x in rng.uniform(-2, 2, 2))
        feats.append(RowFeatures(penalties=(pres, freq, 1.0), history=c[:-1], output_start=s))
        counts = np.bincount(c[s:], minlength=VOCAB).astype(np.float32)
        want[r] = logits[r] - counts * freq - (counts > 0) * pres
    pen, (tokens, in_use, is_out) = contexts_on_device(contexts, starts, feats)
    got = np.asarray(proc.apply_penalties(jnp.asarray(logits), pen, tokens, in_use, is_out))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


@pytest.mark.slow
def test_neutral_and_padding_rows_are_untouched():
    _, logits, contexts, starts = rand_case(5)
    feats = [RowFeatures(penalties=(0.5, 0.5, 1.3), history=contexts[0][:-1], output_start=0),
             None, RowFeatures(logit_bias={3: 1.0})]
    pen, hist, meta, bias_ids, bias_values, allowed, *_ = packed(feats, 8)
    fed = jnp.zeros(8, jnp.int32)
    tokens, in_use, is_out = proc.contexts(hist, meta, fed)
    x = jnp.asarray(np.resize(logits, (8, VOCAB)))
    got = np.asarray(proc.apply_penalties(x, pen, tokens, in_use, is_out))
    np.testing.assert_array_equal(got[1:], np.asarray(x)[1:])   # rows with no penalties
    assert not np.array_equal(got[0], np.asarray(x)[0])


@pytest.mark.parametrize("seed", range(3))
def test_logit_bias_equals_transformers_sequence_bias(seed):
    rng, logits, _, _ = rand_case(seed)
    feats, biases = [], []
    for _ in logits:
        ids = rng.choice(VOCAB, int(rng.integers(1, 9)), replace=False)
        bias = {int(t): float(b) for t, b in zip(ids, rng.uniform(-100, 100, len(ids)))}
        feats.append(RowFeatures(logit_bias=bias))
        biases.append(bias)
    arrays = packed(feats, len(feats))
    bias_ids, bias_values = arrays[3], arrays[4]
    got = np.asarray(proc.apply_logit_bias(jnp.asarray(logits), bias_ids, bias_values))
    for r, bias in enumerate(biases):
        ref = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
        want = ref(torch.tensor([[0]]), torch.tensor(logits[r:r + 1].copy()))
        np.testing.assert_allclose(got[r], want[0].numpy(), rtol=1e-6, atol=1e-4)


def test_allowed_token_ids_keep_only_those():
    rng, logits, _, _ = rand_case(7)
    lists = [rng.choice(VOCAB, int(rng.integers(1, 6)), replace=False).tolist() for _ in logits]
    lists[2] = None                                        # a row without the restriction
    feats = [RowFeatures(allowed_token_ids=a) for a in lists]
    allowed = packed(feats, len(feats))[5]
    got = np.asarray(proc.apply_allowed_token_ids(jnp.asarray(logits), allowed))
    for r, a in enumerate(lists):
        keep = np.zeros(VOCAB, bool)
        keep[a if a is not None else slice(None)] = True
        np.testing.assert_array_equal(got[r], np.where(keep, logits[r], -np.inf))


@pytest.mark.parametrize("seed", range(4))
def test_bad_words_equal_transformers_on_outputs(seed):
    """Multi-token words ban their last token only where the text ends with the rest.
    transformers matches against all of input_ids; with the whole context being output the
    two agree (vLLM's rule, which looks at outputs only, is tested below)."""
    rng, logits, contexts, _ = rand_case(seed, max_len=9)
    words = [[int(rng.integers(0, 12))]] + [rng.integers(0, 12, int(rng.integers(2, 4))).tolist()
                                            for _ in range(3)]
    # Make some rows end with a word's prefix so the multi-token bans fire.
    for r in range(0, len(contexts), 2):
        w = words[1 + r % 3]
        contexts[r] = np.concatenate([contexts[r], np.asarray(w[:-1], np.int32)])
    feats = [RowFeatures(history=c[:-1], output_start=0, bad_words=[tuple(w) for w in words])
             for c in contexts]
    arrays = packed(feats, len(feats))
    hist, meta, bad = arrays[1], arrays[2], arrays[6]
    fed = jnp.asarray([c[-1] for c in contexts], jnp.int32)
    tokens, _, is_out = proc.contexts(hist, meta, fed)
    got = np.asarray(proc.apply_bad_words(jnp.asarray(logits), bad, tokens, is_out, meta[:, 0]))
    ref = NoBadWordsLogitsProcessor(words, eos_token_id=VOCAB - 1)
    fired = 0
    for r, c in enumerate(contexts):
        want = ref(torch.tensor(c[None].astype(np.int64)), torch.tensor(logits[r:r + 1].copy()))
        np.testing.assert_array_equal(got[r], want[0].numpy())
        fired += int(np.isinf(got[r]).sum())
    assert fired > len(contexts)   # more than the one-token word alone


def test_bad_word_prefix_in_the_prompt_does_not_count():
    logits = np.zeros((2, VOCAB), np.float32)
    word = (5, 6)
    feats = [RowFeatures(history=np.asarray([1, 2], np.int32), output_start=3, bad_words=[word]),
             RowFeatures(history=np.asarray([1, 2], np.int32), output_start=2, bad_words=[word])]
    arrays = packed(feats, 2)
    fed = jnp.asarray([5, 5], jnp.int32)      # the fed 5 is prompt in row 0, output in row 1
    tokens, _, is_out = proc.contexts(arrays[1], arrays[2], fed)
    got = np.asarray(proc.apply_bad_words(jnp.asarray(logits), arrays[6], tokens, is_out,
                                          arrays[2][:, 0]))
    assert np.isfinite(got[0]).all()
    assert np.isinf(got[1, 6]) and np.isfinite(np.delete(got[1], 6)).all()


def test_token_bitmask_equals_llguidance_numpy():
    llg_np = pytest.importorskip("llguidance.numpy")
    rng, logits, _, _ = rand_case(9)
    masks = rng.integers(-2**31, 2**31, (len(logits), -(-VOCAB // 32)), dtype=np.int64).astype(np.int32)
    feats = [RowFeatures(mask=m) if r != 1 else None for r, m in enumerate(masks)]
    arrays = packed(feats, len(feats))
    got = np.asarray(proc.apply_token_bitmask(jnp.asarray(logits), arrays[7], arrays[8]))
    want = logits.copy()
    llg_np.apply_token_bitmask_inplace(want, masks)
    want[1] = logits[1]
    np.testing.assert_array_equal(got, want)


def test_features_off_compile_to_the_plain_sampler():
    """A step where no row uses a feature lowers to the same program as before they existed."""
    from paxkv.engine.step_io import SampleRow
    from paxkv.runner import Runner
    from paxkv.sampler import process_logits
    r = Runner.__new__(Runner)
    r.cfg = type("C", (), {"vocab_size": VOCAB})()
    r.row_buckets = [4, 8]
    st, _, _ = Runner.pack_sampling(r, [SampleRow(0, 1.0), SampleRow(0, 0.5)])
    st = jax.tree.map(jnp.asarray, st)
    x = jnp.asarray(rand_case(0, rows=4)[1])
    hlo = jax.jit(lambda x, st: process_logits(x, st, None)).lower(x, st).as_text()
    assert "scatter" not in hlo and "gather" not in hlo

"""The parts of speculative decoding that stand alone: `speculative_config` checking, the
n-gram proposer, and the verify step's rejection sampler, exact in distribution.

Distributions are compared by total variation over 20,000 seeds on a small vocabulary: the
expected distance of an exact sampler is below 0.01; a sampler that kept every draft is off
by more than 0.1 here, and one that drew the token after a refusal from p instead of the
residual by 0.06 to 0.19 (measured by swapping it in).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv.sampler import _filtered_sample
from paxkv.spec_decode.config import SpeculativeConfig, parse_speculative_config
from paxkv.spec_decode.ngram import propose_ngram
from paxkv.spec_decode.rejection import rejection_sample, target_probs
from quick_subset import first_quick

V, K, SEEDS = 8, 3, 20_000
TV_BOUND = 0.025


def _tv(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=probs.shape[-1]) / max(1, samples.shape[0])
    return 0.5 * float(np.abs(counts - probs).sum())


# ---- speculative_config ---------------------------------------------------------------------
def test_config_takes_vllms_keys():
    assert parse_speculative_config(None) is None
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4,
                                     "prompt_lookup_max": 3}) == SpeculativeConfig("ngram", 4, None, 1, 3)
    assert parse_speculative_config({"model": "smollm2-135m-instruct", "num_speculative_tokens": 2}
                                    ).method == "draft_model"
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                     "disable_by_batch_size": 8}).disable_by_batch_size == 8


@pytest.mark.parametrize("raw, key", [
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "eagle", "num_speculative_tokens": 2, "model": "h", "prompt_lookup_min": 1},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel": 1},
     "draft_tensor_parallel"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "disable_by_batch_size"),
])
def test_config_errors_name_the_key(raw, key):
    with pytest.raises(ValueError, match=f"speculative_config.{key}"):
        parse_speculative_config(raw)


# ---- n-gram proposer ------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_longest_recent_match():
    seq = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 3, 4, 6, 7]
    # suffix [6, 7] (n=2): last earlier occurrence at 8, followed by 3, 4, 6
    assert propose_ngram(seq, k=3, n_min=1, n_max=2) == [3, 4, 6]
    # n=3 first: [4, 6, 7] never occurred before, so n=2 decides
    assert propose_ngram(seq, k=2, n_min=2, n_max=3) == [3, 4]
    # the draft stops at the end of the sequence
    assert propose_ngram([1, 2, 3, 1, 2], k=5, n_min=2, n_max=2) == [3, 1, 2]
    assert propose_ngram([1, 2, 3, 4], k=3, n_min=1, n_max=3) == []          # nothing repeats
    assert propose_ngram([9], k=3) == []
    assert propose_ngram([4, 4, 4, 4], k=2, n_min=1, n_max=3) == [4]        # n=3: [4,4,4] at 0


# ---- rejection sampling ---------------------------------------------------------------------
def _case(seed: int):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(K + 1, V)).astype(np.float32) * 1.5
    q = rng.dirichlet(np.ones(V), size=K).astype(np.float32)
    return logits, q


def _verify_many(p: np.ndarray, q: np.ndarray | None, fixed_drafts=None, num_drafts=K):
    """Rows = seeds: drafts drawn from q (or fixed: a point-mass proposer), one verify each."""
    seeds = jnp.arange(SEEDS, dtype=jnp.int32)
    if fixed_drafts is None:
        keys = jax.vmap(lambda s: jax.random.PRNGKey(s + 10**6))(seeds)
        drafts = jax.vmap(lambda kk: jax.random.categorical(kk, jnp.log(jnp.asarray(q)), axis=-1))(keys)
    else:
        drafts = jnp.broadcast_to(jnp.asarray(fixed_drafts, jnp.int32), (SEEDS, K))
    res = jax.jit(rejection_sample)(
        jnp.broadcast_to(jnp.asarray(p), (SEEDS, K + 1, V)), drafts.astype(jnp.int32),
        jnp.full((SEEDS,), num_drafts, jnp.int32), seeds, jnp.zeros((SEEDS,), jnp.int32),
        None if q is None else jnp.broadcast_to(jnp.asarray(q), (SEEDS, K, V)))
    return np.asarray(res.tokens), np.asarray(res.num_emitted), np.asarray(drafts)


FILTERS = {"temperature": (0.8, -1, 1.0, 0.0), "top_k": (1.0, 3, 1.0, 0.0),
           "top_p": (1.0, -1, 0.7, 0.0), "min_p": (1.3, -1, 1.0, 0.1)}


def _probs(logits: np.ndarray, f) -> np.ndarray:
    t, k, tp, mp = f
    n = logits.shape[0]
    return np.asarray(target_probs(jnp.asarray(logits), jnp.full((n,), t), jnp.full((n,), k, jnp.int32),
                                   jnp.full((n,), tp), jnp.full((n,), mp)))


@pytest.mark.parametrize("name", first_quick(list(FILTERS)))
def test_target_probs_are_what_the_ordinary_sampler_draws(name):
    """Without speculation the engine draws by Gumbel-max after its filters: its empirical
    distribution over 20,000 seeds is `target_probs`."""
    logits, _ = _case(1)
    t, k, tp, mp = FILTERS[name]
    want = _probs(logits[:1], FILTERS[name])[0]
    gumbel = jax.vmap(lambda s: jax.random.gumbel(jax.random.PRNGKey(s), (V,)))(jnp.arange(SEEDS))
    drawn = jax.vmap(lambda g: _filtered_sample(jnp.asarray(logits[0]) / t, jnp.int32(k),
                                                jnp.float32(tp), jnp.float32(mp), g))(gumbel)
    assert _tv(np.asarray(drawn), want) < TV_BOUND
    if k > 0:
        assert (want > 0).sum() == k


@pytest.mark.parametrize("name", first_quick(list(FILTERS)))
@pytest.mark.parametrize("proposer", first_quick(["draft_model", "ngram"]))
def test_emitted_tokens_follow_the_target(name, proposer):
    """First token ~ p_0; the second, where the first draft was kept, ~ p_1 (the targets of
    this synthetic model do not depend on the prefix)."""
    logits, q = _case(2)
    p = _probs(logits, FILTERS[name])
    if proposer == "ngram":
        # a point mass on a token p_0 finds likely, then on one it finds unlikely
        drafts = [int(np.argsort(p[0])[-2]), int(np.argsort(p[1])[0]), 0]
        tokens, emitted, _ = _verify_many(p, None, fixed_drafts=drafts)
    else:
        tokens, emitted, _ = _verify_many(p, q)
    assert _tv(tokens[:, 0], p[0]) < TV_BOUND
    second = emitted >= 2
    assert second.sum() > 2000
    assert _tv(tokens[second, 1], p[1]) < TV_BOUND
    for row in range(50):   # padding after the emitted tokens
        assert (tokens[row, emitted[row]:] == -1).all() and (tokens[row, :emitted[row]] >= 0).all()


def test_a_sampler_that_keeps_every_draft_fails_this_test():
    """The bound discriminates: emitting the drafts as they are is far from p_0."""
    logits, q = _case(2)
    p = _probs(logits, FILTERS["temperature"])
    _, _, drafts = _verify_many(p, q)
    assert _tv(drafts[:, 0], p[0]) > 0.1


def test_greedy_keeps_drafts_equal_to_the_argmax():
    logits, _ = _case(3)
    p = _probs(logits, (0.0, -1, 1.0, 0.0))
    best = np.argmax(logits, axis=-1)
    wrong = (best + 1) % V
    cases = [([best[0], best[1], best[2]], 3, [*best[:3], best[3]]),
             ([best[0], wrong[1], best[2]], 3, [best[0], best[1], -1, -1]),
             ([wrong[0], best[1], best[2]], 3, [best[0], -1, -1, -1]),
             ([best[0], best[1], wrong[2]], 2, [best[0], best[1], best[2], -1])]   # 2 drafts only
    for drafts, n, want in cases:
        res = rejection_sample(jnp.asarray(p)[None], jnp.asarray([drafts], jnp.int32),
                               jnp.asarray([n], jnp.int32), jnp.asarray([0], jnp.int32),
                               jnp.asarray([0], jnp.int32))
        assert np.asarray(res.tokens)[0].tolist() == [int(w) for w in want]


def test_seeded_rows_are_reproducible_and_seeds_differ():
    logits, q = _case(4)
    p = _probs(logits, FILTERS["temperature"])
    a, _, _ = _verify_many(p, q)
    b, _, _ = _verify_many(p, q)
    assert np.array_equal(a, b)
    assert len({tuple(r) for r in a[:200].tolist()}) > 20

"""Sampling through the engine on the embedded model: seeds, filters, stops, logprobs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv import LLM, SamplingParams
from paxkv.model.dense import dense_forward


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", dtype="float32", num_gpu_blocks_override=256, max_model_len=256,
               max_num_seqs=16, max_num_batched_tokens=128)


PROMPT = "It is a truth universally acknowledged, that"


def gen(llm, prompts, **kw):
    return llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)


def test_seed_gives_same_output_whatever_shares_the_batch(llm):
    alone = gen(llm, [PROMPT], temperature=1.0, seed=7, max_tokens=16)[0].outputs[0].token_ids
    others = ["The morning", "Mr. Darcy said", "She was", "Emma", "In the drawing-room"]
    mixed = llm.generate(others[:2] + [PROMPT] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=20)] * 2
                         + [SamplingParams(temperature=1.0, seed=7, max_tokens=16)]
                         + [SamplingParams(temperature=0.5, top_k=5, max_tokens=9)] * 3,
                         use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = gen(llm, [PROMPT], temperature=1.0, seed=8, max_tokens=16)[0].outputs[0].token_ids
    assert other_seed != alone


def test_degenerate_filters_equal_greedy(llm):
    greedy = gen(llm, [PROMPT], temperature=0.0, max_tokens=12)[0].outputs[0].token_ids
    assert gen(llm, [PROMPT], temperature=1.0, top_k=1, seed=3, max_tokens=12)[0].outputs[0].token_ids == greedy
    assert gen(llm, [PROMPT], temperature=1.0, top_p=1e-6, seed=3, max_tokens=12)[0].outputs[0].token_ids == greedy
    assert gen(llm, [PROMPT], temperature=1.0, min_p=1.0, seed=3, max_tokens=12)[0].outputs[0].token_ids == greedy


def test_top_k_restricts_to_the_k_most_likely(llm):
    out = gen(llm, [PROMPT], temperature=2.0, top_k=3, seed=1, max_tokens=1, logprobs=3)[0].outputs[0]
    first = out.logprobs[0]
    token = out.token_ids[0]
    top3 = sorted(first.items(), key=lambda kv: -kv[1])[:3]
    assert token in dict(top3)


@pytest.mark.slow
def test_logprobs_match_the_dense_model(llm):
    out = gen(llm, [PROMPT], temperature=0.0, max_tokens=3, logprobs=4)[0]
    comp = out.outputs[0]
    params = llm.llm_engine.runner.params
    cfg = llm.llm_engine.model_config
    ids = out.prompt_token_ids + comp.token_ids
    logits = np.asarray(dense_forward(params, jnp.asarray([ids]), cfg)[0][0])
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    n = len(out.prompt_token_ids)
    for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = lp[n - 1 + i]
        assert tok == int(np.argmax(row))
        np.testing.assert_allclose(entry[tok], row[tok], atol=1e-4)
        best4 = np.argsort(-row)[:4]
        assert set(entry) == set(int(t) for t in best4) | {tok}
    np.testing.assert_allclose(comp.cumulative_logprob, sum(e[t] for t, e in zip(comp.token_ids, comp.logprobs)),
                               atol=1e-4)


def test_stop_token_ids_min_tokens_max_tokens(llm):
    greedy = gen(llm, [PROMPT], temperature=0.0, max_tokens=12, ignore_eos=True)[0].outputs[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 12
    stop_tok = greedy.token_ids[4]
    first_at = greedy.token_ids.index(stop_tok)
    out = gen(llm, [PROMPT], temperature=0.0, max_tokens=12, stop_token_ids=[stop_tok])[0].outputs[0]
    assert out.token_ids == greedy.token_ids[:first_at + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens bans the stop id until enough tokens exist
    out = gen(llm, [PROMPT], temperature=0.0, max_tokens=12, stop_token_ids=[stop_tok],
              min_tokens=first_at + 2)[0].outputs[0]
    assert stop_tok not in out.token_ids[:first_at + 2]
    assert len(out.token_ids) >= first_at + 2


def test_stop_strings_truncate_text(llm):
    full = gen(llm, [PROMPT], temperature=0.0, max_tokens=24, ignore_eos=True)[0].outputs[0]
    words = full.text.split()
    assert len(words) > 4
    stop = words[3]
    out = gen(llm, [PROMPT], temperature=0.0, max_tokens=24, stop=[stop])[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text
    assert full.text.startswith(out.text)
    kept = gen(llm, [PROMPT], temperature=0.0, max_tokens=24, stop=[stop],
               include_stop_str_in_output=True)[0].outputs[0]
    assert kept.text.endswith(stop)


def test_eos_stops_unless_ignored(llm):
    chat = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "What do you think of Mr. Darcy?"}])
    out = gen(llm, [chat], temperature=0.0, max_tokens=120)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.llm_engine.eos_token_ids
    out2 = gen(llm, [chat], temperature=0.0, max_tokens=len(out.token_ids) + 3, ignore_eos=True)[0].outputs[0]
    assert out2.finish_reason == "length" and out2.token_ids[:len(out.token_ids)] == out.token_ids


def _pack(rows, vocab):
    """Sampling tensors and mode for `rows`, as the runner packs them for a step."""
    from paxkv.runner import Runner
    r = Runner.__new__(Runner)
    r.cfg = type("C", (), {"vocab_size": vocab})()
    r.row_buckets = [len(rows)]
    st, mode, _ = Runner.pack_sampling(r, rows)
    return jax.tree.map(jnp.asarray, st), mode


def test_sampling_mode_is_the_cheapest_path_the_rows_need():
    from paxkv.engine.step_io import SampleRow
    assert _pack([SampleRow(0), SampleRow(0, 0.0, top_p=0.5)], 64)[1] == "greedy"
    assert _pack([SampleRow(0), SampleRow(0, 1.0, seed=2)], 64)[1] == "random"
    for filt in (dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1)):
        assert _pack([SampleRow(0, 0.7), SampleRow(0, 1.0, **filt)], 64)[1] == "filtered"


def test_forced_sampling_mode_only_widens():
    """An ablation may force the sort on rows that do not need it, never skip a filter."""
    from paxkv.sampling.rows import widen_sampling_mode
    assert widen_sampling_mode("random", None) == "random"
    assert widen_sampling_mode("random", "filtered") == "filtered"
    assert widen_sampling_mode("greedy", "random") == "random"
    with pytest.raises(ValueError, match="cannot serve rows that need 'filtered'"):
        widen_sampling_mode("filtered", "random")
    with pytest.raises(ValueError, match="sampling_mode must be one of"):
        widen_sampling_mode("greedy", "sorted")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_unfiltered_rows_draw_the_same_token_on_the_sorting_path(seed):
    """A row with every filter off picks the same token whether its step sorts (a batch-mate
    asked for a filter) or not: both paths take Gumbel-max over the same per-token draws.
    Fresh logits with banned (-inf) entries, temperatures, seeds and steps per row."""
    from paxkv.engine.step_io import SampleRow
    from paxkv.sampler import sample
    rng = np.random.default_rng(seed)
    rows_n, vocab = 24, 3000
    logits = rng.normal(size=(rows_n, vocab)).astype(np.float32) * rng.uniform(0.5, 4, (rows_n, 1))
    logits[rng.random((rows_n, vocab)) < 0.05] = -np.inf
    rows = [SampleRow(i, float(rng.uniform(0.3, 2.0)), seed=int(rng.integers(1 << 30)),
                      step=int(rng.integers(100))) for i in range(rows_n)]
    st, mode = _pack(rows, vocab)
    assert mode == "random"
    x = jnp.asarray(logits)
    random_path = np.asarray(sample(x, st, mode="random", num_logprobs=0).tokens)
    sorting_path = np.asarray(sample(x, st, mode="filtered", num_logprobs=0).tokens)
    np.testing.assert_array_equal(random_path, sorting_path)
    assert np.isfinite(logits[np.arange(rows_n), random_path]).all()
    assert len(set(random_path.tolist())) > rows_n // 2        # draws, not one fixed token
    other = [r._replace(seed=r.seed + 1) for r in rows]
    assert (np.asarray(sample(x, _pack(other, vocab)[0], mode="random", num_logprobs=0).tokens)
            != random_path).any()


@pytest.mark.slow
def test_random_path_samples_the_tempered_softmax():
    """Gumbel-max without a sort draws token i with probability softmax(x / T)_i."""
    from paxkv.engine.step_io import SampleRow
    from paxkv.sampler import sample
    x = np.array([1.0, 0.2, -0.5, 0.9, -2.0], np.float32)
    temperature, draws = 0.7, 4000
    rows = [SampleRow(0, temperature, seed=s) for s in range(draws)]
    st, mode = _pack(rows, x.size)
    assert mode == "random"
    tokens = np.asarray(sample(jnp.asarray(x[None]), st, mode="random", num_logprobs=0).tokens)
    freq = np.bincount(tokens, minlength=x.size) / draws
    want = np.exp(x / temperature) / np.exp(x / temperature).sum()
    np.testing.assert_allclose(freq, want, atol=0.03)   # 4 standard errors at p = 0.5


@pytest.mark.slow
def test_top_p_one_keeps_the_tail_float_sums_would_cut():
    """top_p = 1.0 turns the filter off: the float32 running sum of sorted probabilities
    reaches 1.0 before the last tokens on this row, and they must stay drawable."""
    from paxkv.sampler import _filtered_sample
    x = jnp.asarray((np.random.default_rng(0).normal(size=1000) * 3).astype(np.float32))
    probs = jax.nn.softmax(x[jnp.argsort(-x)])
    assert bool(((jnp.cumsum(probs) - probs) >= 1.0).any())    # the case this test is about
    tail = int(jnp.argmin(x))
    gumbel = jnp.zeros_like(x).at[tail].set(1e4)                # a draw that favours the tail
    assert int(_filtered_sample(x, jnp.int32(-1), jnp.float32(1.0), jnp.float32(0.0), gumbel)) == tail
    assert int(_filtered_sample(x, jnp.int32(-1), jnp.float32(0.999), jnp.float32(0.0), gumbel)) != tail

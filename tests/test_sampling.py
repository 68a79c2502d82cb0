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

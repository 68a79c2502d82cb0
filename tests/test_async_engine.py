"""The asynchronous engine (step t+1 dispatched before step t is read) gives exactly the
synchronous engine's outputs, token for token, across every feature that touches the step:
chunked prefill, preemption in both modes, n > 1 with copy-on-write, beam search, prefix
caching, quantized KV, seeded sampling, stop strings, min_tokens and logprobs."""
from __future__ import annotations

import random

import pytest

from paxkv import LLM, BeamSearchParams, SamplingParams
from tests.engine_helpers import assert_no_leaks


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 40, vocab: int = 4096) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _run(prompts, params, **kw):
    llm = LLM("tiny", compilation_cache_dir=None, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert_no_leaks(llm)
    return llm, [[(c.token_ids, c.finish_reason, c.text,
                   None if c.logprobs is None else [sorted(d) for d in c.logprobs])
                  for c in o.outputs] for o in outs]


def _same(prompts, params, **kw):
    sync_llm, want = _run(prompts, params, async_scheduling=False, **kw)
    async_llm, got = _run(prompts, params, async_scheduling=True, **kw)
    assert got == want
    return sync_llm, async_llm


@pytest.mark.slow
def test_greedy_with_chunked_prefill_and_mid_block_lengths():
    prompts = _prompts(6, seed=1, lo=5, hi=70)   # chunks of 32 tokens, blocks of 16
    _same(prompts, SamplingParams(temperature=0.0, max_tokens=23), max_num_batched_tokens=32)


@pytest.mark.slow
def test_seeded_sampling_stops_and_logprobs():
    prompts = _prompts(5, seed=2)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=12 + i, logprobs=2,
                             stop_token_ids=[7 + i], min_tokens=2) for i in range(5)]
    _same(prompts, params)


def test_stop_strings_and_eos_end_early():
    prompts = ["It is a truth universally", "Mr. Darcy said", "She was"]
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=[" and", "."])
    _same(prompts, params)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(mode):
    prompts = _prompts(8, seed=3, lo=10, hi=30)
    _, async_llm = _same(prompts, SamplingParams(temperature=0.0, max_tokens=24),
                         num_gpu_blocks_override=14, max_model_len=128, preemption_mode=mode,
                         swap_space=0.01)
    assert async_llm.metrics.summary()["preemptions"] > 0


def test_parallel_sampling_with_copy_on_write():
    prompts = _prompts(3, seed=4, lo=14, hi=20)   # forks inside a partly filled block
    params = SamplingParams(n=3, best_of=4, temperature=1.0, seed=11, max_tokens=10)
    _same(prompts, params)


def test_prefix_caching_over_generated_tokens():
    """A second turn's prompt holds the first turn's output: its cache hits include blocks
    filled by tokens the async engine only knew as placeholders when they were computed."""
    first = _prompts(3, seed=5, lo=20, hi=40)
    params = SamplingParams(temperature=0.0, max_tokens=37)
    results = []
    for async_scheduling in (False, True):
        llm = LLM("tiny", async_scheduling=async_scheduling, compilation_cache_dir=None)
        outs = llm.generate(first, params, use_tqdm=False)
        second = [p + o.outputs[0].token_ids + [11, 12, 13] for p, o in zip(first, outs)]
        outs2 = llm.generate(second, params, use_tqdm=False)
        results.append(([o.outputs[0].token_ids for o in outs + outs2],
                        [o.num_cached_tokens for o in outs2]))
        assert_no_leaks(llm)
    assert results[0] == results[1]
    assert all(n >= 48 for n in results[1][1])   # prompt + output blocks came from the cache


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv(kv_cache_dtype):
    _same(_prompts(4, seed=7), SamplingParams(temperature=0.0, max_tokens=15),
          kv_cache_dtype=kv_cache_dtype)


def test_beam_search():
    prompts = _prompts(2, seed=8, lo=5, hi=12)
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    want = LLM("tiny", async_scheduling=False, compilation_cache_dir=None).beam_search(prompts, params)
    got = LLM("tiny", async_scheduling=True, compilation_cache_dir=None).beam_search(prompts, params)
    assert [[(s.tokens, s.score) for s in o.sequences] for o in got] == \
        [[(s.tokens, s.score) for s in o.sequences] for o in want]


def test_multi_step_after_async_steps():
    prompts = _prompts(4, seed=9)
    _same(prompts, SamplingParams(temperature=0.0, max_tokens=30), num_scheduler_steps=4)


def test_abort_while_a_step_is_in_flight():
    """An aborted request frees its blocks at once; its in-flight token is discarded, its
    final output comes out of the next step, and the other requests are not disturbed."""
    prompts = _prompts(3, seed=10)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    _, want = _run(prompts[1:], params, async_scheduling=False)
    llm = LLM("tiny", compilation_cache_dir=None)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    engine.step()
    engine.step()
    engine.abort_request("0")
    assert engine.has_unfinished_requests()
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
    assert finals["0"].outputs[0].finish_reason == "abort"
    assert all(t >= 0 for t in finals["0"].outputs[0].token_ids)
    got = [[(c.token_ids, c.finish_reason, c.text, None) for c in finals[r].outputs] for r in ("1", "2")]
    assert got == want
    assert_no_leaks(llm)


# ---- sampling features: only structured outputs need the host between steps -------------------
AUSTEN = ["It is a truth universally acknowledged, that", "Emma Woodhouse, handsome,",
          "Mr. Darcy said", "She was"]


def _feature_params() -> list[SamplingParams]:
    """One row per feature, greedy and seeded, beside plain rows (the prompts cycle)."""
    return [
        SamplingParams(temperature=0.0, max_tokens=20),                               # plain
        SamplingParams(temperature=0.0, max_tokens=20, bad_words=["be happy", "very happy", "to see"]),
        SamplingParams(temperature=0.0, max_tokens=18, presence_penalty=0.8, frequency_penalty=0.5,
                       repetition_penalty=1.3, logprobs=2),
        SamplingParams(temperature=0.9, seed=5, max_tokens=17, repetition_penalty=1.2,
                       frequency_penalty=0.4),
        SamplingParams(temperature=0.0, max_tokens=16, logit_bias={13: 5.0, 42: -100.0, 7: 2.5}),
        SamplingParams(temperature=0.8, seed=9, top_p=0.9, max_tokens=15,
                       allowed_token_ids=[13, 42, 7, 99, 300, 1024, 2]),
        SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=3, logprobs=1),
        SamplingParams(temperature=0.7, seed=3, max_tokens=14, return_hidden_states=[0, 2]),
        SamplingParams(temperature=1.0, seed=1, max_tokens=19),                        # plain
        SamplingParams(temperature=0.0, max_tokens=21, bad_words=["I am"], presence_penalty=-0.5,
                       prompt_logprobs=0, return_hidden_states=[1]),
        SamplingParams(n=2, best_of=3, temperature=0.8, seed=2, max_tokens=10, frequency_penalty=0.5,
                       logit_bias={13: 1.5}),                 # forks (sync once), then async
    ]


def _everything(out) -> tuple:
    """All a RequestOutput carries that features touch, comparable with ==."""
    comps = []
    for c in out.outputs:
        hidden = None if c.hidden_states is None else {k: v.tolist() for k, v in c.hidden_states.items()}
        comps.append((c.token_ids, c.finish_reason, c.cumulative_logprob, c.logprobs, hidden))
    return out.prompt_token_ids, out.prompt_logprobs, comps


def _drive(prompts, params, **kw):
    """Step an engine to the end by hand; also whether a step was ever left in flight (the
    asynchronous path) while a request with features was live."""
    llm = LLM("tiny", compilation_cache_dir=None, **kw)
    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    finals, overlapped = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
        live = [r for r in engine.requests.values() if r.features is not None]
        overlapped += engine._in_flight is not None and bool(live)
    assert_no_leaks(llm)
    return llm, [_everything(finals[str(i)]) for i in range(len(prompts))], overlapped


def _same_features(prompts, params, **kw):
    sync_llm, want, overlapped = _drive(prompts, params, async_scheduling=False, **kw)
    assert overlapped == 0
    async_llm, got, overlapped = _drive(prompts, params, async_scheduling=True, **kw)
    assert overlapped > 0               # the features ran asynchronously
    for g, w in zip(got, want):
        assert g == w
    return async_llm, got


@pytest.mark.slow
@pytest.mark.parametrize("steps", [1, 4])
def test_features_run_async_and_equal_sync(steps):
    """With num_scheduler_steps=4 the plain rows may run several steps per call, never the
    rows with features."""
    params = _feature_params()
    prompts = [AUSTEN[i % len(AUSTEN)] for i in range(len(params))]
    llm, got = _same_features(prompts, params, num_scheduler_steps=steps)
    tok = llm.llm_engine.tokenizer
    banned = tok.encode(" be happy", add_special_tokens=False)
    assert len(banned) == 2

    def has(ids, word):
        return any(ids[j:j + len(word)] == word for j in range(len(ids)))
    assert has(got[0][2][0][0], banned) and not has(got[1][2][0][0], banned)   # the ban acted
    prompt_ids, prompt_logprobs, _ = got[6]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt_ids)
    assert all(len(d) >= 3 for d in prompt_logprobs[1:])
    tokens, hidden = got[7][2][0][0], got[7][2][0][4]
    assert sorted(hidden) == [0, 2] and len(hidden[0]) == len(tokens)
    assert set(got[5][2][0][0]) <= {13, 42, 7, 99, 300, 1024, 2}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_features_under_preemption(mode):
    params = _feature_params()
    prompts = [AUSTEN[i % len(AUSTEN)] + " " + AUSTEN[(i + 1) % len(AUSTEN)] for i in range(len(params))]
    llm, _ = _same_features(prompts, params, num_gpu_blocks_override=16, max_model_len=128,
                            preemption_mode=mode, swap_space=0.01)
    assert llm.metrics.summary()["preemptions"] > 0


def test_structured_outputs_and_forks_keep_the_step_synchronous():
    from paxkv.sampling_params import StructuredOutputsParams
    llm = LLM("tiny", compilation_cache_dir=None)
    engine = llm.llm_engine
    engine.add_request("pen", AUSTEN[0], SamplingParams(max_tokens=4, repetition_penalty=1.2))
    assert not engine._needs_sync()
    engine.add_request("fork", AUSTEN[1], SamplingParams(max_tokens=4, n=2))
    assert engine._needs_sync()                 # until its first token forks it
    engine.add_request("json", AUSTEN[2], SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(json_object=True)))
    while engine.has_unfinished_requests():
        engine.step()
        if "json" in engine.requests:
            assert engine._in_flight is None

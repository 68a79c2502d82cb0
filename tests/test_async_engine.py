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


def test_greedy_with_chunked_prefill_and_mid_block_lengths():
    prompts = _prompts(6, seed=1, lo=5, hi=70)   # chunks of 32 tokens, blocks of 16
    _same(prompts, SamplingParams(temperature=0.0, max_tokens=23), max_num_batched_tokens=32)


def test_seeded_sampling_stops_and_logprobs():
    prompts = _prompts(5, seed=2)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=12 + i, logprobs=2,
                             stop_token_ids=[7 + i], min_tokens=2) for i in range(5)]
    _same(prompts, params)


def test_stop_strings_and_eos_end_early():
    prompts = ["It is a truth universally", "Mr. Darcy said", "She was"]
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=[" and", "."])
    _same(prompts, params)


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

"""Synthetic traces: fitted means, reproducibility, arrivals, bad input; the capacity planner."""
import math

import numpy as np
import pytest

from paxkv.sim import workloads as wl
from paxkv.sim.capacity import GiB, plan_capacity
from paxkv.config import PRESETS


@pytest.mark.parametrize("make,prompt_mean,output_mean", [
    (wl.sharegpt_like, 161.0, 338.0),
    (wl.alpaca_like, 19.0, 58.0),
])
def test_trace_means_match_paper(make, prompt_mean, output_mean):
    reqs = make(200_000, seed=1)
    p = np.array([r.prompt_len for r in reqs])
    o = np.array([r.output_len for r in reqs])
    # Standard errors at this n are below 0.6% of the mean; 2% is over 3 of them.
    assert abs(p.mean() - prompt_mean) < 0.02 * prompt_mean
    assert abs(o.mean() - output_mean) < 0.02 * output_mean
    assert p.min() >= 1 and o.min() >= 1
    assert p.max() <= 1024 and o.max() <= 1024
    # A spread, not a constant: the long tail that makes reservation wasteful.
    assert np.percentile(o, 90) > 2 * np.median(o)


def test_fitted_mean_is_exact_for_the_clipped_rounded_law():
    for d in (wl.SHAREGPT_INPUT, wl.SHAREGPT_OUTPUT, wl.ALPACA_INPUT, wl.ALPACA_OUTPUT):
        assert d.expected_mean() == pytest.approx(d.mean, rel=1e-9)


def test_traces_reproducible_from_seed():
    a = wl.sharegpt_like(500, seed=7)
    b = wl.sharegpt_like(500, seed=7)
    c = wl.sharegpt_like(500, seed=8)
    assert a == b
    assert a != c
    # The arrival rate does not change the lengths.
    d = wl.sharegpt_like(500, seed=7, rate=4.0)
    assert [(r.prompt_len, r.output_len) for r in a] == [(r.prompt_len, r.output_len) for r in d]
    assert all(r.arrival_time == 0.0 for r in a)


def test_poisson_arrivals_rate_and_order():
    t = wl.poisson_arrivals(50_000, rate=10.0, seed=3)
    assert t[0] == 0.0
    assert np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    assert abs(gaps.mean() - 0.1) < 0.003  # 1/rate; standard error 0.00045
    assert np.array_equal(t, wl.poisson_arrivals(50_000, rate=10.0, seed=3))
    assert np.all(wl.poisson_arrivals(5, math.inf, seed=0) == 0.0)


def test_fixed_and_make_trace():
    reqs = wl.fixed(4, 256, 128)
    assert reqs == [wl.Request(256, 128, 0.0)] * 4
    assert wl.make_trace("alpaca", 10, seed=2) == wl.alpaca_like(10, seed=2)


def test_random_token_requests_fit_the_model_and_repeat_from_seed():
    trace = [wl.Request(5, 7), wl.Request(400, 400), wl.Request(98, 50)]
    reqs = wl.random_token_requests(trace, vocab_size=100, max_model_len=100, seed=3)
    assert [(len(ids), out) for ids, out in reqs] == [(5, 7), (98, 1), (98, 1)]
    assert all(10 <= t < 90 for ids, _ in reqs for t in ids)
    assert reqs == wl.random_token_requests(trace, vocab_size=100, max_model_len=100, seed=3)


@pytest.mark.parametrize("call,field", [
    (lambda: wl.fixed(2, 0, 5), "input_len"),
    (lambda: wl.fixed(2, 5, 0), "output_len"),
    (lambda: wl.fixed(-1, 5, 5), "num"),
    (lambda: wl.poisson_arrivals(3, 0.0, 0), "rate"),
    (lambda: wl.make_trace("lmsys", 3), "trace"),
    (lambda: wl.LengthDist(mean=2000.0, sigma=1.0, max_len=1024).mu, "mean"),
])
def test_bad_input_names_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def test_capacity_worked_example_llama3_8b_on_24gb():
    cfg = PRESETS["llama3-8b"]
    bf16 = plan_capacity(24564 * 2**20, cfg, 2, 2, 16)
    assert bf16.weights_bytes / GiB == pytest.approx(14.96, abs=0.01)   # "about 15 GB"
    assert bf16.kv_bytes / GiB == pytest.approx(9.03, abs=0.01)         # "about 9 GB"
    assert bf16.kv_bytes_per_token == 128 * 1024
    assert 72 * 1024 <= bf16.tokens <= 73 * 1024                         # "about 72k"
    assert bf16.blocks == bf16.kv_bytes // (16 * 128 * 1024)
    assert bf16.usable_tokens == (bf16.blocks - 1) * 16
    fp8 = plan_capacity(24564 * 2**20, cfg, 2, 1, 16)
    assert fp8.tokens in (2 * bf16.tokens, 2 * bf16.tokens + 1)


def test_capacity_budget_reserve_and_too_small_device():
    cfg = PRESETS["llama3-8b"]
    full = plan_capacity(80 * GiB, cfg, 2, 2, 16)
    part = plan_capacity(80 * GiB, cfg, 2, 2, 16, gpu_memory_utilization=0.9,
                         activation_reserve_bytes=GiB)
    assert full.kv_bytes - part.kv_bytes == pytest.approx(8 * GiB + GiB, abs=1)
    tiny = plan_capacity(8 * GiB, cfg, 2, 2, 16)
    assert tiny.tokens == 0 and tiny.blocks == 0
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_capacity(80 * GiB, cfg, 2, 2, 16, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="block_size"):
        plan_capacity(80 * GiB, cfg, 2, 2, 0)


def test_translation_like_means_and_reproducibility():
    reqs = wl.translation_like(100_000, seed=3)
    p = np.array([r.prompt_len for r in reqs])
    o = np.array([r.output_len for r in reqs])
    assert abs(p.mean() - 30.0) < 0.6 and abs(o.mean() - 30.0) < 0.6
    assert wl.translation_like(50, seed=3, rate=4.0) == wl.make_trace("translation", 50, seed=3, rate=4.0)


def test_chatbot_like_prompts_are_histories_cut_to_the_limit():
    reqs = wl.chatbot_like(20_000, seed=2, max_prompt_len=384, mean_prior_turns=2.0)
    p = np.array([r.prompt_len for r in reqs])
    o = np.array([r.output_len for r in reqs])
    assert p.max() == 384 and p.min() >= 1
    # A history of one earlier turn is already about 500 tokens: most prompts sit at the cut,
    # the rest are first questions (about a third, the geometric law's mass at zero turns).
    at_cut = (p == 384).mean()
    assert 0.55 < at_cut < 0.8
    assert abs(o.mean() - 338.0) < 0.03 * 338.0
    assert p.mean() > 1.5 * wl.SHAREGPT_INPUT.mean
    assert wl.chatbot_like(30, seed=2, max_prompt_len=384) == wl.chatbot_like(30, seed=2, max_prompt_len=384)
    with pytest.raises(ValueError, match="max_prompt_len"):
        wl.chatbot_like(3, max_prompt_len=0)
    with pytest.raises(ValueError, match="mean_prior_turns"):
        wl.chatbot_like(3, mean_prior_turns=-1.0)

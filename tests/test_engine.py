"""The whole engine on CPU against transformers: preemption, chunking, bad input, aborts."""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import assert_no_leaks
from hf_fixtures import hf_greedy, make_hf_checkpoint, make_hf_llama
from paxkv import LLM, SamplingParams

CFG = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16)
MAX_LEN = 96


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "gqa"
    make_hf_checkpoint(path, seed=3, **CFG)
    return str(path)


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_llama(seed=3, **CFG)


@pytest.fixture(scope="module")
def workload():
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 384, size=int(rng.integers(1, 41))).tolist() for _ in range(24)]
    max_tokens = [int(rng.integers(4, 25)) for _ in prompts]
    return prompts, max_tokens


@pytest.fixture(scope="module")
def hf_outputs(hf_model, workload):
    prompts, max_tokens = workload
    return [hf_greedy(hf_model, p, m) for p, m in zip(prompts, max_tokens)]


def make_llm(checkpoint, **kw):
    args = dict(dtype="float32", block_size=8, num_gpu_blocks_override=20, max_model_len=MAX_LEN,
                max_num_seqs=8, max_num_batched_tokens=64, swap_space=0.01, tokenizer=None)
    args.update(kw)
    return LLM(checkpoint, **args)


@pytest.mark.slow
@pytest.mark.parametrize("mode,chunk", [("recompute", 64), ("swap", 64), ("recompute", 16)])
def test_greedy_equals_transformers_under_preemption(checkpoint, workload, hf_outputs, mode, chunk):
    prompts, max_tokens = workload
    llm = make_llm(checkpoint, preemption_mode=mode, max_num_batched_tokens=chunk)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (o, ref) in enumerate(zip(outs, hf_outputs)):
        assert o.prompt_token_ids == prompts[i]
        assert o.outputs[0].token_ids == ref, f"request {i} differs from transformers"
        assert o.outputs[0].finish_reason == "length"
    assert llm.metrics.summary()["preemptions"] > 0, "the pool was meant to force preemption"
    if mode == "swap":
        assert llm.llm_engine.scheduler.num_swapped == 0
    assert_no_leaks(llm)


def test_static_policy_matches(checkpoint, workload, hf_outputs):
    prompts, max_tokens = workload
    llm = make_llm(checkpoint, scheduler="static", num_gpu_blocks_override=60)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompts[:10], params[:10], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_outputs[:10]
    assert_no_leaks(llm)


@pytest.mark.slow
def test_no_compilations_in_steady_state(checkpoint, workload):
    prompts, max_tokens = workload
    llm = make_llm(checkpoint, num_gpu_blocks_override=80)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm.generate(prompts[:12], params[:12], use_tqdm=False)
    runner = llm.llm_engine.runner
    first = runner.num_compilations
    assert first > 0
    llm.generate(prompts[:12], params[:12], use_tqdm=False)
    assert runner.num_compilations == first
    from paxkv.runner.runner import _jit_step
    if hasattr(_jit_step, "_cache_size"):  # JAX's own count agrees: nothing new was traced
        size = _jit_step._cache_size()
        llm.generate(prompts[:12], params[:12], use_tqdm=False)
        assert _jit_step._cache_size() == size


def test_bad_input_rejected_without_disturbing_others(checkpoint, workload, hf_outputs):
    prompts, max_tokens = workload
    llm = make_llm(checkpoint, num_gpu_blocks_override=60)
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(f"ok{i}", prompts[i], SamplingParams(temperature=0.0, max_tokens=max_tokens[i],
                                                                ignore_eos=True))
    engine.step()
    engine.step()
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("long", list(range(3, 3 + MAX_LEN)), SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("oov", [5, 384], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="n must"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("ok0", [5], SamplingParams())
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("text", "hello", SamplingParams())
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert done == {f"ok{i}": hf_outputs[i] for i in range(4)}
    assert_no_leaks(llm)


def test_pool_too_small_for_one_sequence(checkpoint):
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        make_llm(checkpoint, num_gpu_blocks_override=5)


def test_abort_frees_blocks_at_once(checkpoint, workload):
    prompts, _ = workload
    llm = make_llm(checkpoint, num_gpu_blocks_override=60, enable_prefix_caching=False)
    engine = llm.llm_engine
    bm = engine.block_manager
    engine.add_request("a", prompts[0] + prompts[1], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("b", prompts[2], SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    used_before = bm.num_used_blocks
    a_blocks = len(engine.requests["a"].samples[0].block_table)
    engine.abort_request("a")
    assert bm.num_used_blocks == used_before - a_blocks
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finished and outs["a"].outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(llm)

"""The engine as a training loop's rollout engine: weights updated in place (by Hugging Face
name or as the engine's own tree), sleep and wake. Every check is against a fresh engine
built on the same weights: same greedy tokens, same logprobs.
"""
from __future__ import annotations

import types

import jax
import numpy as np
import pytest

from hf_fixtures import import_torch, make_hf_family_checkpoint
from paxkv import LLM, SamplingParams
from paxkv.model.weights import hf_tensors, load_checkpoint

ENGINE = dict(dtype="float32", block_size=8, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, num_gpu_blocks_override=80, attention_backend="reference")
SP = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two checkpoints of one Qwen2 shape (biases: the fused bias path too), and prompts."""
    import_torch()
    a = make_hf_family_checkpoint(tmp_path_factory.mktemp("a"), "qwen2", seed=1)
    b = make_hf_family_checkpoint(tmp_path_factory.mktemp("b"), "qwen2", seed=2)
    params_b, cfg = load_checkpoint(b, dtype="float32")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (21, 9, 40)]
    return types.SimpleNamespace(a=a, b=b, params_b=params_b, cfg=cfg, prompts=prompts)


def _run(llm: LLM, prompts) -> list[tuple[list[int], list]]:
    outs = llm.generate(prompts, SP, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _hf_pairs(params, cfg):
    return [(name, np.asarray(x)) for name, x in hf_tensors(params, cfg)]


def test_update_by_hf_names_equals_a_fresh_engine(ckpts):
    llm = LLM(ckpts.a, **ENGINE)
    before = _run(llm, ckpts.prompts)
    compiled = llm.llm_engine.runner.num_compilations
    llm.update_weights(_hf_pairs(ckpts.params_b, ckpts.cfg))
    after = _run(llm, ckpts.prompts)
    want = _run(LLM(ckpts.b, **ENGINE), ckpts.prompts)
    assert after == want and after != before
    assert llm.llm_engine.runner.num_compilations == compiled     # nothing recompiled


def test_partial_update_touches_only_what_it_names(ckpts):
    """Layer 0's k projection (a slice of the fused q/k/v kernel, with its bias) and the
    final norm from checkpoint b, the rest from a: equal to an engine built on that mix."""
    params_a, cfg = load_checkpoint(ckpts.a, dtype="float32")
    names = {"model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.bias",
             "model.norm.weight"}
    new = [(n, x) for n, x in _hf_pairs(ckpts.params_b, cfg) if n in names]
    mixed = dict(_hf_pairs(params_a, cfg))
    mixed.update(new)
    from paxkv.model.weights import load_tensors
    mixed_params = load_tensors(cfg, mixed.keys(), lambda n: mixed[n], "float32")
    llm = LLM(ckpts.a, **ENGINE)
    untouched = llm.llm_engine.runner.params["layers_1"]["self_attn"]["qkv_proj"]["kernel"]
    llm.update_weights(new)
    assert llm.llm_engine.runner.params["layers_1"]["self_attn"]["qkv_proj"]["kernel"] is untouched
    assert _run(llm, ckpts.prompts) == _run(LLM(ckpts.a, **{**ENGINE, "params": mixed_params}),
                                           ckpts.prompts)


def test_update_with_the_engines_own_tree_takes_the_arrays_without_a_copy(ckpts):
    source = LLM(ckpts.b, **ENGINE)
    tree = source.llm_engine.runner.params
    llm = LLM(ckpts.a, **ENGINE)
    llm.update_weights(tree)
    got = jax.tree.leaves(llm.llm_engine.runner.params)
    assert all(x is y for x, y in zip(got, jax.tree.leaves(tree)))
    assert _run(llm, ckpts.prompts) == _run(source, ckpts.prompts)


def test_bad_updates_name_the_tensor_and_keep_the_old_weights(ckpts):
    llm = LLM(ckpts.a, **ENGINE)
    before = _run(llm, ckpts.prompts)
    pairs = _hf_pairs(ckpts.params_b, ckpts.cfg)
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight"):
        llm.update_weights(pairs + [("model.layers.9.mlp.up_proj.weight", pairs[0][1])])
    wrong = [(n, x[:-1] if n == "model.norm.weight" else x) for n, x in pairs]
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        llm.update_weights(wrong)
    tree = jax.tree.map(lambda x: x, llm.llm_engine.runner.params)
    tree["norm"] = {"scale": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match="norm/scale"):
        llm.update_weights(tree)
    llm.reset_prefix_cache()     # a prefix hit computes in other chunks: float noise
    assert _run(llm, ckpts.prompts) == before


def test_in_flight_requests_refuse_an_update_and_the_prefix_cache_is_dropped(ckpts):
    llm = LLM(ckpts.a, **ENGINE)
    prompt = ckpts.prompts[2]
    llm.generate([prompt], SP, use_tqdm=False)
    assert llm.generate([prompt], SP, use_tqdm=False)[0].num_cached_tokens > 0
    llm.llm_engine.add_request("busy", prompt, SP)
    with pytest.raises(RuntimeError, match="in flight"):
        llm.update_weights(_hf_pairs(ckpts.params_b, ckpts.cfg))
    llm.llm_engine.abort_request(["busy"])
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    llm.update_weights(_hf_pairs(ckpts.params_b, ckpts.cfg))
    out = llm.generate([prompt], SP, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0                      # the old weights' KV is gone
    assert (out.outputs[0].token_ids, out.outputs[0].logprobs) == _run(LLM(ckpts.b, **ENGINE), [prompt])[0]


def test_sleep_and_wake_up(ckpts):
    llm = LLM(ckpts.a, **ENGINE)
    before = _run(llm, ckpts.prompts)
    runner = llm.llm_engine.runner
    held = sum(x.nbytes for x in jax.tree.leaves((runner.params, runner.kv_pool)))
    live = sum(x.nbytes for x in jax.live_arrays())
    llm.sleep(level=1)
    assert runner.kv_pool is None and runner.params is None     # the device holds nothing
    assert sum(x.nbytes for x in jax.live_arrays()) <= live - held
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(ckpts.prompts, SP, use_tqdm=False)
    llm.wake_up()
    assert _run(llm, ckpts.prompts) == before
    llm.sleep(level=2)
    llm.wake_up()
    with pytest.raises(RuntimeError, match="update_weights"):
        llm.generate(ckpts.prompts, SP, use_tqdm=False)
    llm.update_weights(_hf_pairs(ckpts.params_b, ckpts.cfg))
    assert _run(llm, ckpts.prompts) == _run(LLM(ckpts.b, **ENGINE), ckpts.prompts)
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)


@pytest.mark.slow
def test_update_under_tensor_parallelism_and_of_experts(tmp_path_factory):
    """The grouped (tensor-parallel) layout, and a mixture of experts' stacked leaves (two
    experts of one layer updated, the others kept)."""
    import_torch()
    a = make_hf_family_checkpoint(tmp_path_factory.mktemp("ma"), "mixtral", seed=1)
    b = make_hf_family_checkpoint(tmp_path_factory.mktemp("mb"), "mixtral", seed=2)
    params_a, cfg = load_checkpoint(a, dtype="float32")
    params_b, _ = load_checkpoint(b, dtype="float32")
    prompts = [list(range(5, 30)), list(range(40, 49))]
    tp = dict(ENGINE, tensor_parallel_size=2)   # against fresh engines of the same layout
    llm = LLM(a, **tp)
    llm.update_weights(_hf_pairs(params_b, cfg))
    assert _run(llm, prompts) == _run(LLM(b, **tp), prompts)
    pick = {f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight"
            for e in (0, 3) for w in ("w1", "w2", "w3")}
    new = [(n, x) for n, x in _hf_pairs(params_a, cfg) if n in pick]
    mixed = dict(_hf_pairs(params_b, cfg))
    mixed.update(new)
    from paxkv.model.weights import load_tensors
    want = LLM(a, **{**tp, "params": load_tensors(cfg, mixed.keys(), lambda n: mixed[n], "float32")})
    llm.update_weights(new)
    assert _run(llm, prompts) == _run(want, prompts)

"""`LLM(batch_invariant=True)`: a request's tokens and logprobs are bitwise the same alone or
among other requests, whatever its prefill chunking and step buckets, from a prefix-cache
hit, and equal to the trainer's `token_logprobs` on the engine's config (float32).

Every comparison is `==` on float32 values: no tolerance.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv import LLM, SamplingParams
from paxkv.config import get_preset
from paxkv.model import batch_invariant as bi
from paxkv.model.dense import dense_forward, token_logprobs

ENGINE = dict(dtype="float32", batch_invariant=True, num_gpu_blocks_override=160,
              max_model_len=256, max_num_seqs=16, block_size=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True,
                         logprobs=3)


@functools.lru_cache(maxsize=None)
def _llm(max_num_batched_tokens: int, model: str = "tiny") -> LLM:
    return LLM(model, max_num_batched_tokens=max_num_batched_tokens, **ENGINE)


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    vocab = _llm(64).model_config.vocab_size
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def _run(llm: LLM, prompts, sp=GREEDY) -> list[tuple]:
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module")
def target():
    """The request under test (41 tokens: ends mid-block) and 11 batch mates of 3-150 tokens."""
    (prompt,) = _prompts(0, [41])
    mates = _prompts(1, np.random.default_rng(2).integers(3, 150, 11))
    return prompt, mates


@pytest.mark.slow
@pytest.mark.parametrize("sp", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_alone_equals_among_batch_mates(target, sp):
    prompt, mates = target
    llm = _llm(64)
    alone = _run(llm, [prompt], sp)[0]
    among = _run(llm, mates[:6] + [prompt] + mates[6:], sp)[6]
    among_few = _run(llm, mates[:2] + [prompt], sp)[2]
    assert alone == among == among_few


@pytest.mark.slow
def test_prefill_chunking_and_prefix_cache_change_nothing(target):
    """Chunks of 16 against the whole prompt in one step, and the second run of a prompt
    reading its first blocks from the prefix cache."""
    prompt, mates = target
    whole = _run(_llm(256), [prompt] + mates[:3])[0]
    chunked = _run(_llm(16), [prompt])[0]
    second = _llm(256).generate([prompt], GREEDY, use_tqdm=False)[0]   # its blocks are cached
    assert second.num_cached_tokens == 32
    cached = (second.outputs[0].token_ids, second.outputs[0].logprobs)
    assert whole == chunked == cached


@pytest.mark.slow
def test_engine_logprobs_equal_the_trainers(target):
    """Sampled tokens' logprobs == `token_logprobs` on the engine's params and config, jitted
    as a training step would, for a batch of sequences of different lengths."""
    prompt, mates = target
    llm = _llm(64)
    prompts = [prompt] + mates[:3]
    outs = llm.generate(prompts, SAMPLED, use_tqdm=False)
    trainer = jax.jit(token_logprobs, static_argnums=2)
    params = llm.llm_engine.runner.params
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        ids = jnp.asarray([p + list(c.token_ids)])
        want = np.asarray(trainer(params, ids, llm.model_config))[0, len(p) - 1:]
        got = np.asarray([lp[t] for lp, t in zip(c.logprobs, c.token_ids)], np.float32)
        assert np.array_equal(got, want), np.abs(got - want).max()


@pytest.mark.slow
def test_bfloat16_is_bitwise_too(target):
    """In bfloat16 as well (the bound the issue asks to measure is 0 on the CPU): alone ==
    among batch mates == the trainer's function."""
    prompt, mates = target
    llm = LLM("tiny", dtype="bfloat16", max_num_batched_tokens=64,
              **{k: v for k, v in ENGINE.items() if k != "dtype"})
    alone = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    among = llm.generate(mates[:6] + [prompt] + mates[6:], GREEDY, use_tqdm=False)[6].outputs[0]
    assert (alone.token_ids, alone.logprobs) == (among.token_ids, among.logprobs)
    ids = jnp.asarray([prompt + list(alone.token_ids)])
    want = np.asarray(jax.jit(token_logprobs, static_argnums=2)(
        llm.llm_engine.runner.params, ids, llm.model_config))[0, len(prompt) - 1:]
    got = np.asarray([lp[t] for lp, t in zip(alone.logprobs, alone.token_ids)], np.float32)
    assert np.array_equal(got, want), np.abs(got - want).max()


def test_dense_forward_is_invariant_to_batch_and_length():
    """The trainer's side alone: a row's logits do not depend on the other rows, nor on
    tokens after it (the same prefix in a longer sequence), for a family with q/k norms,
    sliding windows and logit soft-capping (Gemma 3's switches)."""
    cfg = dataclasses.replace(get_preset("tiny-random"), batch_invariant=True, qk_norm=True,
                              layer_types=("sliding_attention", "full_attention") * 2,
                              sliding_window=7, final_logit_softcapping=30.0)
    from paxkv.model.params import init_params
    params = init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    ids = jax.random.randint(jax.random.PRNGKey(1), (5, 37), 0, cfg.vocab_size)
    f = jax.jit(dense_forward, static_argnums=2)
    one = np.asarray(f(params, ids[:1, :23], cfg)[0])[0]
    longer = np.asarray(f(params, ids[:1], cfg)[0])[0, :23]
    batched = np.asarray(f(params, ids, cfg)[0])[0, :23]
    assert np.array_equal(one, longer) and np.array_equal(one, batched)
    # and it is the same model: equal to the default forward up to float rounding
    plain = np.asarray(f(params, ids[:1, :23], dataclasses.replace(cfg, batch_invariant=False))[0])[0]
    np.testing.assert_allclose(one, plain, atol=2e-4, rtol=0)


def test_matmul_rows_do_not_depend_on_row_count_or_place():
    w = jax.random.normal(jax.random.PRNGKey(0), (96, 200), jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(1), (70, 96), jnp.float32)
    f = jax.jit(bi.matmul)
    ref = np.asarray(f(x[:1], w))[0]
    for n, at in [(2, 1), (9, 4), (33, 32), (70, 17)]:
        assert np.array_equal(np.asarray(f(x[:n].at[at].set(x[0]), w))[at], ref)
    np.testing.assert_allclose(np.asarray(f(x, w)), np.asarray(x @ w), rtol=1e-5, atol=1e-4)


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("tiny", batch_invariant=True, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="batch_invariant"):
        dataclasses.replace(get_preset("tiny-random"), batch_invariant=True, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, moe_layers=(0,))

"""Sharing KV blocks: parallel sampling, beam search vs transformers, prefix caching."""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import assert_no_leaks
from hf_fixtures import hf_greedy, import_torch, make_hf_checkpoint, make_hf_llama
from paxkv import LLM, BeamSearchParams, SamplingParams

CFG = dict(num_attention_heads=4, num_key_value_heads=2)
BS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("share") / "m"
    make_hf_checkpoint(path, seed=5, **CFG)
    return str(path)


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_llama(seed=5, **CFG)


def make_llm(checkpoint, **kw):
    args = dict(dtype="float32", block_size=BS, num_gpu_blocks_override=64, max_model_len=128,
                max_num_seqs=16, max_num_batched_tokens=128, tokenizer=None)
    args.update(kw)
    return LLM(checkpoint, **args)


@pytest.mark.parametrize("prompt_len", [13, 16], ids=["mid-block", "block-boundary"])
def test_n4_greedy_gives_four_copies_and_shares_the_prompt(checkpoint, hf_model, prompt_len):
    prompt = np.random.default_rng(prompt_len).integers(3, 384, size=prompt_len).tolist()
    ref = hf_greedy(hf_model, prompt, 10)
    llm = make_llm(checkpoint)
    engine = llm.llm_engine
    engine.add_request("r", prompt, SamplingParams(n=4, temperature=0.0, max_tokens=10, ignore_eos=True))
    engine.step()                       # prefill once, sample 4 first tokens, fork
    seqs = engine.requests["r"].samples
    assert len(seqs) == 4
    full = prompt_len // BS
    for s in seqs[1:]:                  # full prompt blocks are shared by all four
        assert s.block_table[:full] == seqs[0].block_table[:full]
    bm = engine.block_manager
    for b in seqs[0].block_table[:full]:
        assert bm.ref_count(b) == 4
    engine.step()                       # the first decode writes: copy-on-write if mid-block
    tables = [s.block_table for s in seqs]
    if prompt_len % BS:
        lasts = {t[full] for t in tables}
        assert len(lasts) == 4, "each sample must own its partly filled block after its write"
    for t in tables[1:]:
        assert t[:full] == tables[0][:full]
    while engine.has_unfinished_requests():
        engine.step()
    out = engine.step()
    llm2 = make_llm(checkpoint)
    res = llm2.generate([prompt], SamplingParams(n=4, temperature=0.0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0]
    assert [c.token_ids for c in res.outputs] == [ref] * 4
    assert llm2.metrics.summary()["sharing_saving"] > 0.0
    assert_no_leaks(llm)
    assert_no_leaks(llm2)
    del out


@pytest.mark.slow
def test_parallel_samples_are_distinct_and_reproducible(checkpoint):
    llm = make_llm(checkpoint)
    prompt = list(range(5, 25))
    sp = SamplingParams(n=3, best_of=5, temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    a = llm.generate([prompt], sp, use_tqdm=False)[0]
    b = llm.generate([prompt, list(range(30, 40))], [sp, SamplingParams(n=2, temperature=1.0)],
                     use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len(a.outputs) == 3
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3
    lps = [c.cumulative_logprob for c in a.outputs]
    assert lps == sorted(lps, reverse=True), "best_of keeps the n most likely samples"
    assert_no_leaks(llm)


def hf_beams(model, prompt, width, max_tokens, length_penalty, eos):
    torch = import_torch()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                             num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
                             length_penalty=length_penalty, early_stopping=True,
                             output_scores=True, return_dict_in_generate=True)
    seqs = []
    for row in out.sequences.tolist():
        gen = row[len(prompt):]
        if eos is not None and eos in gen:      # strip the padding after EOS
            gen = gen[:gen.index(eos) + 1]
        seqs.append(gen)
    return seqs, out.sequences_scores.tolist()


@pytest.mark.parametrize("width,length_penalty,eos_at", [(4, 1.0, None), (3, 0.5, 2), (4, 2.0, 1)])
def test_beam_search_equals_transformers(tmp_path, hf_model, width, length_penalty, eos_at):
    use_eos = eos_at is not None
    rng = np.random.default_rng(width)
    prompts = [rng.integers(3, 384, size=n).tolist() for n in (7, 16, 21)]
    eos = None
    if use_eos:   # an EOS that the beams actually meet: a token greedy decoding emits early
        eos = hf_greedy(hf_model, prompts[0], 4)[eos_at]
    path = tmp_path / "beam"
    make_hf_checkpoint(path, seed=5, eos_token_id=eos if eos is not None else 2, **CFG)
    llm = make_llm(str(path))
    params = BeamSearchParams(beam_width=width, max_tokens=10, length_penalty=length_penalty,
                              ignore_eos=not use_eos)
    outs = llm.beam_search(prompts, params)
    finished_early = False
    for prompt, out in zip(prompts, outs):
        ref, ref_scores = hf_beams(hf_model, prompt, width, 10, length_penalty, eos)
        got = [s.tokens[len(prompt):] for s in out.sequences]
        assert got == ref
        np.testing.assert_allclose([s.score for s in out.sequences], ref_scores, atol=1e-4)
        finished_early |= any(len(g) < 10 for g in got)
    if use_eos and length_penalty <= 1.0:   # a strong length penalty prefers the long beams
        assert finished_early, "the test meant some beams to end at EOS"
    assert_no_leaks(llm)


@pytest.mark.slow
def test_prefix_caching_under_eviction_keeps_outputs(checkpoint):
    rng = np.random.default_rng(9)
    system = rng.integers(3, 384, size=37).tolist()          # a shared prefix, ends mid-block
    prompts = [system + rng.integers(3, 384, size=int(rng.integers(1, 12))).tolist() for _ in range(16)]
    prompts += [rng.integers(3, 384, size=30).tolist() for _ in range(8)]   # evicting traffic
    prompts += prompts[:4]                                                  # repeats
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        llm = make_llm(checkpoint, enable_prefix_caching=caching, num_gpu_blocks_override=24,
                       max_num_seqs=4)
        results = llm.generate(prompts, sp, use_tqdm=False)
        outs[caching] = [o.outputs[0].token_ids for o in results]
        cached = [o.num_cached_tokens for o in results]
        assert all(c % BS == 0 and c < len(p) for c, p in zip(cached, prompts))
        assert (sum(cached) > 0) == caching
        summary = llm.metrics.summary()
        if caching:
            assert summary["prefix_cache_hit_rate"] > 0.3
            assert llm.llm_engine.block_manager.num_evictions > 0
        else:
            assert summary["prefix_cache_hit_rate"] == 0.0
        assert_no_leaks(llm)
    assert outs[True] == outs[False]

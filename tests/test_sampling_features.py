"""vLLM's sampling fields through the engine on the embedded model: greedy outputs with
penalties, logit bias, allowed ids and bad words equal a reference loop over transformers'
model and logits processors (OpenAI's formula for presence/frequency), and in a mixed batch
every row gets exactly its solo output."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the transformers reference) is not installed")
from transformers.generation.logits_process import (NoBadWordsLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor)

from engine_helpers import assert_no_leaks, shared_tiny_llm
from paxkv import LLM, SamplingParams

PROMPTS = ["It is a truth universally acknowledged, that", "Emma Woodhouse, handsome,",
           "Mr. Darcy said", "She was"]


def reference_greedy(tiny_hf, prompt, max_tokens, *, presence=0.0, frequency=0.0, repetition=1.0,
                     bias=None, allowed=None, bad_words=()):
    """Greedy decoding with the processors applied in vLLM's order to transformers' logits."""
    out: list[int] = []
    for _ in range(max_tokens):
        ids = torch.tensor([prompt + out])
        with torch.no_grad():
            x = tiny_hf(ids).logits[:, -1].float().clone()
        if allowed is not None:
            keep = torch.zeros_like(x, dtype=torch.bool)
            keep[0, allowed] = True
            x = x.masked_fill(~keep, -float("inf"))
        if bad_words:
            singles = [w[0] for w in bad_words if len(w) == 1]
            x[0, singles] = -float("inf")
            multi = [list(w) for w in bad_words if len(w) > 1]
            if multi and out:   # vLLM matches the outputs only, not the prompt
                x = NoBadWordsLogitsProcessor(multi, eos_token_id=None)(torch.tensor([out]), x)
        for t, b in (bias or {}).items():
            x[0, t] += b
        if repetition != 1.0:
            x = RepetitionPenaltyLogitsProcessor(repetition)(ids, x)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.shape[1]).float()
        x = x - frequency * counts - presence * (counts > 0).float()
        out.append(int(torch.argmax(x[0])))
    return out


CASES = {
    "repetition": dict(repetition_penalty=1.8),
    "presence_frequency": dict(presence_penalty=1.5, frequency_penalty=0.8),
    "negative_penalties": dict(presence_penalty=-0.5, frequency_penalty=-0.3, repetition_penalty=0.7),
    "bias_and_allowed": dict(logit_bias={264: 4.0, 11: -50.0, 78: 7.5},
                             allowed_token_ids=[264, 78, 11, 300, 1030, 369, 565]),
    "bad_words": dict(bad_words=["be", "happy", "very happy"]),
}


def ref_kwargs(tiny_llm, kw):
    out = dict(presence=kw.get("presence_penalty", 0.0), frequency=kw.get("frequency_penalty", 0.0),
               repetition=kw.get("repetition_penalty", 1.0), bias=kw.get("logit_bias"),
               allowed=kw.get("allowed_token_ids"))
    if "bad_words" in kw:
        out["bad_words"] = tiny_llm.llm_engine.features.tokenize_bad_words(kw["bad_words"])
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_with_processors_equals_reference(tiny_llm, tiny_hf, case):
    kw = CASES[case]
    tok = tiny_llm.get_tokenizer()
    prompt = tok.encode(PROMPTS[0])
    plain = tiny_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    got = tiny_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kw),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert got == reference_greedy(tiny_hf, prompt, 12, **ref_kwargs(tiny_llm, kw))
    assert got != plain, "the feature should change this output"


def test_bad_words_are_tokenized_at_the_start_and_after_a_space(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    ids = tiny_llm.llm_engine.features.tokenize_bad_words(["happy"])
    assert tuple(tok.encode("happy", add_special_tokens=False)) in ids
    assert tuple(tok.encode(" happy", add_special_tokens=False)) in ids
    text = tiny_llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                     bad_words=["happy"]), use_tqdm=False)[0].outputs[0].text
    assert "happy" not in text


@pytest.mark.slow
def test_mixed_batch_gives_each_row_its_solo_output(tiny_llm):
    """Rows with and without each feature share steps (and shape buckets) without effect on
    each other: tokens equal exactly, float outputs to float32 noise."""
    base = dict(max_tokens=8, ignore_eos=True)
    params = [
        SamplingParams(temperature=0.0, **base),
        SamplingParams(temperature=0.9, seed=3, presence_penalty=1.0, frequency_penalty=0.5,
                       repetition_penalty=1.5, **base),
        SamplingParams(temperature=0.0, logit_bias={264: 3.0}, allowed_token_ids=list(range(200, 700)),
                       bad_words=["the", "of her"], **base),
        SamplingParams(temperature=1.0, seed=11, n=2, frequency_penalty=1.0, **base),
        SamplingParams(temperature=0.7, seed=5, prompt_logprobs=2, return_hidden_states=[2], **base),
        SamplingParams(temperature=1.0, seed=9, top_k=20, **base),
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    solo = [tiny_llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    mixed = tiny_llm.generate(prompts, params, use_tqdm=False)
    for i, (a, b) in enumerate(zip(solo, mixed)):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs], f"row {i}"
        if a.prompt_logprobs is not None:
            for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                assert x.keys() == y.keys()
                np.testing.assert_allclose(list(x.values()), list(y.values()), atol=1e-5)
        if a.outputs[0].hidden_states is not None:
            np.testing.assert_allclose(a.outputs[0].hidden_states[2], b.outputs[0].hidden_states[2],
                                       atol=1e-5)
    assert_no_leaks(tiny_llm)


@pytest.mark.slow
def test_penalties_survive_preemption_and_chunking():
    """The token history is the engine's own, so recompute preemption and chunked prefill
    (which re-feed tokens) leave penalized outputs unchanged."""
    roomy = shared_tiny_llm()
    tight = LLM("tiny", dtype="float32", num_gpu_blocks_override=6, max_model_len=64,
                max_num_seqs=8, max_num_batched_tokens=16, params=roomy.llm_engine.runner.params)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=20, ignore_eos=True,
                             repetition_penalty=1.4, frequency_penalty=0.5, bad_words=["the"])
              for i in range(4)]
    prompts = PROMPTS
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.metrics.summary()["preemptions"] > 0
    assert got == want
    assert_no_leaks(tight)

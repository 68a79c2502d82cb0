"""prompt_logprobs through the engine: equal to transformers' log-softmax of the prompt, across
chunked prefill and prefix-cache hits, and the embedded model's held-out perplexity from them
equals the eval-window figure."""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the transformers reference) is not installed")

from engine_helpers import assert_no_leaks
from paxkv import SamplingParams
from paxkv.sim.eval_windows import eval_windows
from paxkv.model.dense import dense_forward
from test_tiny_model import HELD_OUT


def hf_logprobs(tiny_hf, ids):
    with torch.no_grad():
        return torch.log_softmax(tiny_hf(torch.tensor([ids])).logits[0].double(), -1).numpy()


def test_prompt_logprobs_equal_transformers(tiny_llm, tiny_hf):
    """A 150-token prompt spans two 128-token chunks; the second request with the same
    prompt would hit the prefix cache, and still gets every position."""
    rng = np.random.default_rng(0)
    tok = tiny_llm.get_tokenizer()
    prompts = [tok.encode(" ".join(HELD_OUT))[:150], tok.encode(HELD_OUT[1])[:37],
               rng.integers(3, 4096, 23).tolist()]
    prompts.append(list(prompts[0]))
    k = 3
    outs = tiny_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=k),
                        use_tqdm=False)
    for ids, out in zip(prompts, outs):
        plp = out.prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        ref = hf_logprobs(tiny_hf, ids)
        for pos in range(1, len(ids)):
            row = ref[pos - 1]
            entry = plp[pos]
            np.testing.assert_allclose(entry[ids[pos]], row[ids[pos]], atol=1e-4)
            top = np.argsort(-row)[:k]
            assert set(entry) == set(int(t) for t in top) | {ids[pos]}
            np.testing.assert_allclose([entry[int(t)] for t in top], row[top], atol=1e-4)
    # The prefix-cache hit gives each position the same tokens, with the same logprobs.
    repeat, first = outs[3].prompt_logprobs, outs[0].prompt_logprobs
    assert len(repeat) == len(first) and repeat[0] is None
    for pos in range(1, len(first)):
        assert repeat[pos].keys() == first[pos].keys(), pos
        for token, logprob in first[pos].items():
            assert repeat[pos][token] == pytest.approx(logprob), (pos, token)
    assert_no_leaks(tiny_llm)


def test_held_out_perplexity_from_prompt_logprobs_equals_eval_windows(tiny_llm):
    """The eval-window protocol of eval_windows.py on the held-out paragraphs: every stream
    token predicted once, from a window that starts with BOS. Through the engine, each window
    is a prompt and its prompt logprobs are the targets' log-likelihoods."""
    tok = tiny_llm.get_tokenizer()
    engine = tiny_llm.llm_engine
    cfg = engine.model_config
    stream = np.asarray([t for p in HELD_OUT for t in tok.encode(p, add_special_tokens=False)],
                        np.int32)
    windows, mask = eval_windows(stream, cfg.bos_token_id, 96)
    logits, _ = dense_forward(engine.runner.params, np.asarray(windows), cfg)
    lp = np.asarray(torch.log_softmax(torch.tensor(np.asarray(logits[:, :-1])).double(), -1))
    targets = windows[:, 1:]
    nll_ref = -np.take_along_axis(lp, targets[..., None], -1)[..., 0]
    ppl_ref = math.exp(float((nll_ref * mask).sum() / mask.sum()))

    outs = tiny_llm.generate([w.tolist() for w in windows],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    nll = 0.0
    for w, m, out in zip(windows, mask, outs):
        for pos in range(1, len(w)):
            if m[pos - 1]:
                nll -= out.prompt_logprobs[pos][int(w[pos])]
    ppl = math.exp(nll / mask.sum())
    assert ppl == pytest.approx(ppl_ref, rel=1e-5)
    assert ppl < 200     # the trained model, far below the uniform 4096

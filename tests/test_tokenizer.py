"""Tokenizer wrapper: loading, encode/decode, stop ids, the Llama-3 chat template."""
from __future__ import annotations

import pytest

from hf_fixtures import make_hf_checkpoint, make_tiny_tokenizer
from paxkv.tokenizer import LLAMA3_CHAT_TEMPLATE, Tokenizer, load_tokenizer

MESSAGES = [{"role": "system", "content": "You are a helpful assistant. "},
            {"role": "user", "content": "  Hello world!\n"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def test_checkpoint_without_tokenizer_gives_none(tmp_path):
    path = make_hf_checkpoint(tmp_path, num_hidden_layers=1)
    assert load_tokenizer(path) is None
    assert load_tokenizer(tmp_path / "does-not-exist") is None


def test_encode_decode_round_trip_and_special_ids(tok_dir):
    tok = load_tokenizer(tok_dir)
    assert isinstance(tok, Tokenizer)
    text = "The quick brown fox: paged attention, 42 blocks!"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == tok.hf.convert_tokens_to_ids("<|begin_of_text|>")
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text
    assert all(0 <= t < tok.vocab_size for t in ids)
    # EOS of the tokenizer first, then <|eot_id|> from generation_config.json.
    assert tok.eos_token_ids == (tok.hf.convert_tokens_to_ids("<|end_of_text|>"),
                                 tok.hf.convert_tokens_to_ids("<|eot_id|>"))
    assert tok.eos_token_id == tok.eos_token_ids[0]
    with pytest.raises(ValueError, match="prompt"):
        tok.encode(["not", "a", "string"])


def test_eos_without_generation_config(tmp_path):
    tok = load_tokenizer(make_tiny_tokenizer(tmp_path, add_generation_config=False))
    assert tok.eos_token_ids == (tok.hf.convert_tokens_to_ids("<|end_of_text|>"),)


def test_builtin_llama3_chat_template(tok_dir):
    tok = load_tokenizer(tok_dir)
    assert tok.chat_template == LLAMA3_CHAT_TEMPLATE  # the fixture ships none
    text = tok.apply_chat_template(MESSAGES, tokenize=False)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                    "You are a helpful assistant.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHello world!<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    no_prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert no_prompt == text[:-len("<|start_header_id|>assistant<|end_header_id|>\n\n")]
    ids = tok.apply_chat_template(MESSAGES)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    eot = tok.hf.convert_tokens_to_ids("<|eot_id|>")
    header = tok.hf.convert_tokens_to_ids("<|start_header_id|>")
    assert ids.count(eot) == 2 and ids.count(header) == 3   # special markers are single tokens


def test_checkpoint_template_wins(tmp_path):
    own = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    tok = load_tokenizer(make_tiny_tokenizer(tmp_path, chat_template=own))
    assert tok.chat_template == own
    assert tok.apply_chat_template(MESSAGES, tokenize=False) == \
        "[system]You are a helpful assistant. [user]  Hello world!\n"


@pytest.mark.parametrize("messages,match", [
    ([], "messages"),
    ("hello", "messages"),
    ([{"role": "user"}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": "hi"}, {"role": 3, "content": "x"}], r"messages\[1\]\.role"),
])
def test_bad_messages_are_named(tok_dir, messages, match):
    with pytest.raises(ValueError, match=match):
        load_tokenizer(tok_dir).apply_chat_template(messages)

"""The incremental detokenizer equals the full decode and never emits half a character."""
from __future__ import annotations

import random

import pytest

from paxkv.assets import tiny_model_dir
from paxkv.engine.detokenizer import IncrementalDetokenizer
from paxkv.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(tiny_model_dir())


def _stream(tok, ids, rng, skip_special_tokens=True):
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    pieces, i = [], 0
    while i < len(ids):
        k = rng.randrange(1, 4)
        pieces.append(d.push(ids[i:i + k]))
        i += k
    return pieces, d.flush()


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_concatenate_to_the_full_decode(tok, skip):
    rng = random.Random(1234 + skip)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 50))]
        pieces, tail = _stream(tok, ids, rng, skip)
        assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)


def test_window_decoding_agrees_for_tokenizers_without_a_byte_table(tok, monkeypatch):
    import paxkv.engine.detokenizer as detok
    monkeypatch.setattr(detok, "_table_for", lambda *a: None)
    rng = random.Random(99)
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        pieces, tail = _stream(tok, ids, rng)
        assert "".join(pieces) + tail == tok.decode(ids)
    text = "naïve café — 日本語 😀"
    d = detok.IncrementalDetokenizer(tok)
    pieces = [d.push([t]) for t in tok.encode(text, add_special_tokens=False)]
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) + d.flush() == text


def test_multibyte_characters_are_never_split(tok):
    text = "héllo wörld — “quotes” 日本語 😀 and émigré façade"
    ids = tok.encode(text, add_special_tokens=False)
    # The byte-level BPE splits several of these characters across tokens.
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    d = IncrementalDetokenizer(tok)
    pieces = [d.push([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + d.flush() == text


def test_dangling_partial_character_is_flushed_like_the_full_decode(tok):
    ids = tok.encode("日", add_special_tokens=False)
    assert len(ids) > 1
    d = IncrementalDetokenizer(tok)
    assert d.push(ids[:-1]) == ""
    assert d.flush() == tok.decode(ids[:-1])

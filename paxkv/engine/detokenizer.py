"""Incremental detokenization: text deltas that never split a multi-byte UTF-8 character.

Decoding a growing list of ids from scratch every step costs O(length) per token; decoding
token by token splits characters whose bytes span several byte-level BPE tokens (the
decoder then yields U+FFFD). This keeps a short window instead: the text of
`ids[prefix:read]` is already emitted, and the text of `ids[prefix:]` minus that is the new
part, held back while it ends in an incomplete character. Starting the window a few tokens
before `read` lets tokenizers whose pieces depend on their left neighbour (SentencePiece's
leading-space marker) decode each new token in context.

Byte-level BPE tokenizers (Llama-3's, the tiny model's) take a faster road: each id maps to
its bytes through a table built once, and Python's incremental UTF-8 decoder (which holds an
incomplete character back and replaces invalid bytes exactly as the full decode does) turns
them into text at O(1) per token. Measured on the tiny model's tokenizer: about 100 us per
token through the window, a few us through the table (a loaded 2-core CPU).

Host-only: no JAX.
"""
from __future__ import annotations

import codecs
import logging
import weakref
from typing import Any, Sequence

_REPLACEMENT = "\ufffd"
# Tokens of left context kept in the decoding window; a UTF-8 character has at most 4 bytes,
# so 6 tokens always reach back past any character still open.
_CONTEXT_TOKENS = 6


def _byte_level_table(tokenizer: Any, skip_special_tokens: bool) -> list[bytes] | None:
    """id -> the bytes it stands for, when decoding is plain byte-level BPE (Llama-3, the tiny
    model): the full decode is then `b"".join(table[ids]).decode("utf-8", "replace")`, so a
    stream can be decoded with an incremental UTF-8 decoder at O(1) per token. None otherwise."""
    hf = getattr(tokenizer, "hf", None)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or getattr(hf, "clean_up_tokenization_spaces", False):
        return None
    from tokenizers import decoders
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    byte_of = _unicode_to_byte()
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    table = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        piece = backend.id_to_token(i)
        if piece is None or (skip_special_tokens and i in special):
            table.append(b"")
            continue
        table.append(b"".join(bytes([byte_of[c]]) if c in byte_of else c.encode("utf-8")
                              for c in piece))
    return table


def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character map that byte-level BPE uses."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_TABLES: "weakref.WeakKeyDictionary[Any, dict[bool, list[bytes] | None]]" = weakref.WeakKeyDictionary()


def _table_for(tokenizer: Any, skip_special_tokens: bool) -> list[bytes] | None:
    try:
        per = _TABLES.setdefault(tokenizer, {})
    except TypeError:   # not weak-referenceable: build every time (tests' stand-ins)
        return _byte_level_table(tokenizer, skip_special_tokens)
    if skip_special_tokens not in per:
        per[skip_special_tokens] = _byte_level_table(tokenizer, skip_special_tokens)
    return per[skip_special_tokens]


class IncrementalDetokenizer:
    """Feed the ids of one sample as they come; get back only complete new text.

    The concatenation of everything `push` returns plus `flush()` equals
    `tokenizer.decode(all_ids, skip_special_tokens=...)` for byte-level tokenizers; `flush`
    returns whatever that full decode has beyond what was emitted (a dangling partial
    character, as U+FFFD, exactly like the full decode).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""          # everything emitted so far
        self._prefix = 0        # window start
        self._read = 0          # ids up to here are reflected in `text`
        self._table = _table_for(tokenizer, skip_special_tokens)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if self._table else None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: Sequence[int]) -> str:
        """Append ids; return the newly completed text (possibly empty)."""
        if self._table is not None:   # byte-level fast path
            new_ids = [int(t) for t in new_ids]
            self.ids.extend(new_ids)
            table = self._table
            delta = self._utf8.decode(b"".join(table[t] if 0 <= t < len(table) else b""
                                               for t in new_ids))
            self.text += delta
            return delta
        self.ids.extend(int(t) for t in new_ids)
        if self._read >= len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if after.endswith(_REPLACEMENT) or len(after) <= len(before) or not after.startswith(before):
            return ""   # an incomplete character at the end (or nothing visible yet): wait
        delta = after[len(before):]
        self.text += delta
        self._read = len(self.ids)
        self._prefix = max(0, self._read - _CONTEXT_TOKENS)
        return delta

    def flush(self) -> str:
        """The rest of the full decode (call once, at the end of the sample)."""
        if self._utf8 is not None:
            delta = self._utf8.decode(b"", final=True)
            self.text += delta
            return delta
        full = self._decode(self.ids)
        if not full.startswith(self.text):   # cannot happen for byte-level tokenizers
            raise RuntimeError("incremental text diverged from the full decode")
        delta = full[len(self.text):]
        self.text = full
        self._read = len(self.ids)
        return delta


class StreamedText:
    """The text one sample streams: deltas that are always a prefix of the final text.

    Stop strings end a sample at the token that completes one, and the final text is cut
    before it; while the sample runs, the last `len(longest stop string) - 1` characters are
    held back, so no streamed delta ever shows part of a stop string. Shared by DELTA outputs
    (`RequestOutputKind.DELTA`) and the server's frontend, which detokenizes apart from the
    engine.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = ""

    def push(self, new_ids: Sequence[int]) -> str:
        """Add ids; the text newly safe to show (possibly empty)."""
        detok = self.detok
        detok.push(new_ids)
        visible = detok.text[:len(detok.text) - self.holdback] if self.holdback else detok.text
        if len(visible) <= len(self.sent):
            return ""
        delta = visible[len(self.sent):]
        self.sent = visible
        return delta

    def finish(self, new_ids: Sequence[int], final_text: str | None = None) -> str:
        """The last ids of the sample; the rest of its text. `final_text`: the stop-truncated
        text when a stop string ended it (else the full decode)."""
        self.detok.push(new_ids)
        self.detok.flush()
        full = final_text if final_text is not None else self.detok.text
        if not full.startswith(self.sent):   # a bug, not an input: say so, keep serving
            logging.getLogger("paxkv").error("streamed text is not a prefix of the final text")
        delta = full[len(self.sent):]
        self.sent = full
        return delta

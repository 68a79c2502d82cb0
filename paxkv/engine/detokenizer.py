"""Incremental detokenization: text deltas that never split a multi-byte UTF-8 character.

Decoding a growing list of ids from scratch every step costs O(length) per token; decoding
token by token splits characters whose bytes span several byte-level BPE tokens (the
decoder then yields U+FFFD). This keeps a short window instead: the text of
`ids[prefix:read]` is already emitted, and the text of `ids[prefix:]` minus that is the new
part, held back while it ends in an incomplete character. Starting the window a few tokens
before `read` lets tokenizers whose pieces depend on their left neighbour (SentencePiece's
leading-space marker) decode each new token in context.

Host-only: no JAX.
"""
from __future__ import annotations

from typing import Any, Sequence

_REPLACEMENT = "\ufffd"
# Tokens of left context kept in the decoding window; a UTF-8 character has at most 4 bytes,
# so 6 tokens always reach back past any character still open.
_CONTEXT_TOKENS = 6


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

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: Sequence[int]) -> str:
        """Append ids; return the newly completed text (possibly empty)."""
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
        full = self._decode(self.ids)
        if not full.startswith(self.text):   # cannot happen for byte-level tokenizers
            raise RuntimeError("incremental text diverged from the full decode")
        delta = full[len(self.text):]
        self.text = full
        self._read = len(self.ids)
        return delta

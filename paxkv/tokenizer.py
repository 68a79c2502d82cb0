"""Text <-> token ids for a checkpoint, and the Llama-3 chat format.

A thin wrapper over transformers' fast tokenizer (Rust `tokenizers` underneath; nothing here
needs torch). Checkpoints without tokenizer files are fine: `load_tokenizer` returns None and
the engine takes token-id prompts only.

Stop tokens: Llama-3-Instruct ends a turn with `<|eot_id|>` but its tokenizer's EOS is
`<|end_of_text|>`; the extra id is listed in `generation_config.json`. `eos_token_ids`
merges the tokenizer's EOS with those of generation_config.json and config.json, so
generation stops where the checkpoint's authors meant it to.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

# Llama-3's chat format: every turn is a header, a blank line, the trimmed content and
# <|eot_id|>; BOS once at the start; the generation prompt opens an assistant header.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- endif %}"
)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def _eos_from_json(path: str) -> list[int]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


class Tokenizer:
    """encode / decode / chat template / stop ids over a transformers fast tokenizer."""

    def __init__(self, hf_tokenizer: Any, extra_eos_token_ids: Sequence[int] = ()) -> None:
        self.hf = hf_tokenizer
        eos: list[int] = []
        if hf_tokenizer.eos_token_id is not None:
            eos.append(int(hf_tokenizer.eos_token_id))
        for e in extra_eos_token_ids:
            if int(e) not in eos:
                eos.append(int(e))
        self.eos_token_ids: tuple[int, ...] = tuple(eos)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Tokenizer":
        path = os.fspath(path)
        if os.path.exists(os.path.join(path, "tokenizer.json")):
            # The generic fast tokenizer runs tokenizer.json exactly as written (Llama-3's own
            # tokenizer_config names this class too).
            from transformers import PreTrainedTokenizerFast
            hf = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            from transformers import AutoTokenizer
            hf = AutoTokenizer.from_pretrained(path)
        extra = (_eos_from_json(os.path.join(path, "generation_config.json"))
                 + _eos_from_json(os.path.join(path, "config.json")))
        return cls(hf, extra)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added special tokens included)."""
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def chat_template(self) -> str:
        """The checkpoint's own template if it ships one, else Llama-3's."""
        return getattr(self.hf, "chat_template", None) or LLAMA3_CHAT_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a string, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(t) for t in token_ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            add_generation_prompt: bool = True,
                            tokenize: bool = True,
                            chat_template: str | None = None) -> list[int] | str:
        """Render a conversation with `chat_template` (default: the checkpoint's); token ids
        by default (BOS, where the model wants one, comes from the template)."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
            for key in ("role", "content"):
                if not isinstance(m.get(key), str):
                    raise ValueError(f"messages[{i}].{key} must be a string")
        text = self.hf.apply_chat_template([dict(m) for m in messages],
                                           chat_template=chat_template or self.chat_template,
                                           tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        if not tokenize:
            return text
        # The rendered text already holds BOS and the special markers.
        return self.encode(text, add_special_tokens=False)


def has_tokenizer_files(path: str | os.PathLike) -> bool:
    path = os.fspath(path)
    return os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer | None:
    """The checkpoint's tokenizer (a GGUF file's own, with its chat template), or None when it
    has no tokenizer files."""
    from paxkv.model.gguf_file import gguf_hf_tokenizer, is_gguf   # plain numpy until used
    if is_gguf(path):
        return Tokenizer(*gguf_hf_tokenizer(path))
    if not has_tokenizer_files(path):
        return None
    return Tokenizer.from_pretrained(path)

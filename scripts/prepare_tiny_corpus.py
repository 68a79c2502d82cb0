"""Build the embedded tiny model's corpus and tokenizer from Jane Austen's six novels.

Source: the Debian package `r-cran-janeaustenr` (CRAN package janeaustenr by Julia Silge,
MIT license; the novels themselves are in the public domain). Its data lives in an R
lazy-load database (`data/Rdata.rdx` + `data/Rdata.rdb`); this script reads it with a small
R-unserializer, so neither R nor any download beyond the package is needed:

    apt-get download r-cran-janeaustenr
    dpkg-deb -x r-cran-janeaustenr_1.0.0-1_all.deb scratch/janeaustenr
    PYTHONPATH=. python3 scripts/prepare_tiny_corpus.py \
        --austen_root=scratch/janeaustenr --out_dir=scratch/tiny_corpus

(`apt-get install r-cran-janeaustenr` works too; then the default --austen_root finds it.)

Outputs in --out_dir:
  tokenizer/        tokenizer.json + tokenizer_config.json (byte-level BPE, Llama-3 specials)
  corpus.npz        uint16 token streams train / valid / test and their paragraph spans
  valid.txt, test.txt  the held-out text, for reading
  stats.json        sizes of every split
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import re
import struct
import zlib
from typing import Any, Sequence

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("austen_root", "/", "Root under which usr/lib/R/site-library/janeaustenr lives "
                    "(an extracted .deb or the system root).")
flags.DEFINE_string("out_dir", "scratch/tiny_corpus", "Where to write tokenizer/ and corpus.npz.")
flags.DEFINE_integer("vocab_size", 4096, "BPE vocabulary size, special tokens included.")
flags.DEFINE_float("heldout_fraction", 0.06, "Fraction of each novel (its closing paragraphs) held "
                   "out: half for validation, half for the reported test perplexity.")

# Llama-3's special tokens (same strings); ids 0..5 here. Id 0 is Llama-3.1's padding token.
SPECIAL_TOKENS = (
    "<|finetune_right_pad_id|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
)
BOS, EOS, EOT, START_HEADER, END_HEADER = (SPECIAL_TOKENS[i] for i in range(1, 6))

# Llama-3's chat template (system/user/assistant headers, <|eot_id|> after each turn).
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

NOVELS = {  # R object name -> title
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}


# ----------------------------------------------------------------------------------------
# A minimal reader for R's serialization format (XDR, versions 2 and 3): enough for the
# character vectors, pairlists and lists of a lazy-load data base.
class _RReader:
    def __init__(self, data: bytes):
        self.data, self.pos, self.refs = data, 0, []

    def _int(self) -> int:
        (v,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return v

    def _len(self) -> int:
        n = self._int()
        if n == -1:
            hi, lo = self._int(), self._int()
            n = (hi << 32) + lo
        return n

    def read(self) -> Any:
        if self.data[:2] != b"X\n":
            raise ValueError("R data: only the XDR serialization format is supported")
        self.pos = 2
        version = self._int()
        self._int(), self._int()  # writer and minimal reader R versions
        if version == 3:
            name_len = self._int()  # then the native encoding's name
            self.pos += name_len
        elif version != 2:
            raise ValueError(f"R data: serialization version {version} is not supported")
        return self._item()

    def _item(self) -> Any:
        flags_ = self._int()
        kind, has_attr, has_tag = flags_ & 0xFF, bool(flags_ & (1 << 9)), bool(flags_ & (1 << 10))
        if kind in (254, 242, 241, 253, 252, 251, 250):  # NULL and the special environments
            return None
        if kind == 255:  # reference to an earlier symbol/environment
            idx = flags_ >> 8
            return self.refs[(idx or self._int()) - 1]
        if kind == 1:  # symbol: its name as a CHARSXP
            name = self._item()
            self.refs.append(name)
            return name
        if kind == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None
            raw = self.data[self.pos:self.pos + n]
            self.pos += n
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                return raw.decode("latin-1")
        if kind in (2, 6):  # pairlist / language object: a tagged linked list
            out: dict[str, Any] = {}
            if has_attr:
                self._item()  # a cell's own attributes: not needed here
            tag = self._item() if has_tag else None
            car = self._item()
            cdr = self._item()
            out[tag if tag is not None else f"_{len(out)}"] = car
            if isinstance(cdr, dict):
                out.update(cdr)
            return out
        if kind in (10, 13):  # logical / integer
            n = self._len()
            vals = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == 14:  # double
            n = self._len()
            vals = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        elif kind in (16, 19, 20):  # character vector / list / expression
            vals = [self._item() for _ in range(self._len())]
        else:
            raise ValueError(f"R data: object type {kind} is not supported by this reader")
        if has_attr:
            attrs = self._item()
            names = attrs.get("names") if isinstance(attrs, dict) else None
            if names is not None and kind == 19:
                return dict(zip(names, vals))
        return vals


def read_r_lazyload(data_dir: str) -> dict[str, Any]:
    """Read every object of an R lazy-load database (Rdata.rdx index + Rdata.rdb blobs)."""
    with gzip.open(os.path.join(data_dir, "Rdata.rdx"), "rb") as f:
        index = _RReader(f.read()).read()
    with open(os.path.join(data_dir, "Rdata.rdb"), "rb") as f:
        blobs = f.read()
    objects = {}
    for name, (offset, length) in index["variables"].items():
        blob = blobs[int(offset):int(offset) + int(length)]
        (size,) = struct.unpack(">I", blob[:4])
        raw = zlib.decompress(blob[4:])
        if len(raw) != size:
            raise ValueError(f"R data: object {name!r} decompressed to {len(raw)} bytes, expected {size}")
        objects[name] = _RReader(raw).read()
    return objects


def find_austen_data_dir(root: str) -> str:
    pattern = os.path.join(root, "usr/lib/R/site-library/janeaustenr/data/Rdata.rdx")
    hits = glob.glob(pattern)
    if not hits and os.path.abspath(root) != os.path.sep:  # never crawl the whole filesystem
        hits = glob.glob(os.path.join(root, "**/janeaustenr/data/Rdata.rdx"), recursive=True)
    if not hits:
        raise ValueError(f"--austen_root={root!r}: janeaustenr/data/Rdata.rdx not found; "
                         "apt-get download r-cran-janeaustenr and extract it with dpkg-deb -x")
    return os.path.dirname(hits[0])


# ----------------------------------------------------------------------------------------
def normalize(text: str) -> str:
    """Plain-ASCII typography and single spaces: a small vocabulary learns more per entry."""
    table = {"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2014": "--",
             "\u2013": "-", "\u00a0": " ", "\u00e9": "e", "\u00e8": "e", "\u00ea": "e",
             "\u00e0": "a", "\u00e2": "a", "\u00ef": "i", "\u00f4": "o", "\u00e7": "c",
             "\u00fc": "u", "\u00e6": "ae", "\u00c6": "AE", "\u00a3": "L"}
    text = "".join(table.get(ch, ch) for ch in text)
    text = re.sub(r"_([^_]+)_", r"\1", text)  # _italics_ markers of the Gutenberg texts
    return re.sub(r"\s+", " ", text).strip()


def paragraphs(lines: Sequence[str | None]) -> list[str]:
    """Re-join the novels' hard-wrapped lines into paragraphs (blank lines separate them)."""
    out, cur = [], []
    for line in lines:
        line = (line or "").strip()
        if line:
            cur.append(line)
        elif cur:
            out.append(normalize(" ".join(cur)))
            cur = []
    if cur:
        out.append(normalize(" ".join(cur)))
    return [p for p in out if p]


def load_novels(root: str) -> dict[str, list[str]]:
    objects = read_r_lazyload(find_austen_data_dir(root))
    missing = [k for k in NOVELS if k not in objects]
    if missing:
        raise ValueError(f"janeaustenr data lacks {missing}")
    return {title: paragraphs(objects[key]) for key, title in NOVELS.items()}


def split_novels(novels: dict[str, list[str]], heldout_fraction: float
                 ) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Hold out the closing paragraphs of every novel (contiguous text the model never saw)."""
    train, heldout = {}, {}
    for title, paras in novels.items():
        cut = int(round(len(paras) * (1.0 - heldout_fraction)))
        train[title], heldout[title] = paras[:cut], paras[cut:]
    return train, heldout


# ----------------------------------------------------------------------------------------
def train_tokenizer(texts: Sequence[str], vocab_size: int):
    """Byte-level BPE (GPT-2/Llama-3 style byte alphabet) with Llama-3's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def save_tokenizer_dir(tok, out_dir: str, model_max_length: int = 2048) -> None:
    """tokenizer.json + tokenizer_config.json that transformers.AutoTokenizer loads."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "rstrip": False,
                                       "normalized": False, "single_word": False, "special": True}
             for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOT,  # chat turns end with <|eot_id|>, as in Llama-3-Instruct
        "pad_token": SPECIAL_TOKENS[0],
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "added_tokens_decoder": added,
        "chat_template": LLAMA3_CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


PARAGRAPH_SEPARATOR = "\n\n"


def encode_stream(tok, novels: dict[str, list[str]]) -> tuple[np.ndarray, np.ndarray]:
    """One token stream: per novel <|begin_of_text|> paragraphs joined by blank lines
    <|end_of_text|>. Also returns each paragraph's token span `[start, end)` (its text only,
    without the separator): training windows start there and chat examples are cut from them."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    sep = tok.encode(PARAGRAPH_SEPARATOR, add_special_tokens=False).ids
    tokens, spans = [], []
    for paras in novels.values():
        tokens.append(bos)
        for i, enc in enumerate(tok.encode_batch(list(paras), add_special_tokens=False)):
            if i:
                tokens.extend(sep)
            spans.append((len(tokens), len(tokens) + len(enc.ids)))
            tokens.extend(enc.ids)
        tokens.append(eos)
    return np.asarray(tokens, np.uint16), np.asarray(spans, np.int64).reshape(-1, 2)


def split_three(novels: dict[str, list[str]], heldout_fraction: float):
    """train / valid / test: the closing `heldout_fraction` of every novel is held out; its
    first half picks the training schedule (valid), its second half is only reported (test)."""
    train, heldout = split_novels(novels, heldout_fraction)
    valid = {t: p[:len(p) // 2] for t, p in heldout.items()}
    test = {t: p[len(p) // 2:] for t, p in heldout.items()}
    return train, valid, test


def prepare(root: str, out_dir: str, vocab_size: int, heldout_fraction: float) -> dict:
    novels = load_novels(root)
    splits = dict(zip(("train", "valid", "test"), split_three(novels, heldout_fraction)))
    train_texts = [p if i == 0 else PARAGRAPH_SEPARATOR + p
                   for paras in splits["train"].values() for i, p in enumerate(paras)]
    tok = train_tokenizer(train_texts, vocab_size)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"tokenizer came out with {tok.get_vocab_size()} entries, not {vocab_size}")
    save_tokenizer_dir(tok, os.path.join(out_dir, "tokenizer"))
    arrays, stats = {}, {"source": "Debian package r-cran-janeaustenr 1.0.0-1 (janeaustenr, MIT; "
                                   "texts in the public domain)",
                         "novels": list(novels),
                         "paragraphs": {t: len(p) for t, p in novels.items()},
                         "characters": sum(len(p) for ps in novels.values() for p in ps),
                         "vocab_size": vocab_size, "heldout_fraction": heldout_fraction}
    for name, part in splits.items():
        ids, spans = encode_stream(tok, part)
        arrays[name], arrays[f"{name}_spans"] = ids, spans
        stats[f"{name}_tokens"] = int(ids.size)
        stats[f"{name}_characters"] = sum(len(p) for ps in part.values() for p in ps)
        if name != "train":
            with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
                for title, paras in part.items():
                    f.write(f"# {title}\n\n" + "\n\n".join(paras) + "\n\n")
    np.savez_compressed(os.path.join(out_dir, "corpus.npz"), **arrays)
    with open(os.path.join(out_dir, "stats.json"), "w") as f:
        json.dump(stats, f, indent=2)
    return stats


def main(argv: Sequence[str]) -> None:
    del argv
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    stats = prepare(FLAGS.austen_root, FLAGS.out_dir, FLAGS.vocab_size, FLAGS.heldout_fraction)
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    app.run(main)

"""GGUF files (llama.cpp's format) as checkpoints: config, weights and tokenizer in one file.

Read with the `gguf` package. The file's metadata becomes a Hugging Face style config dict,
parsed by the family the registry names for its `general.architecture`, so a GGUF model and
the same model's safetensors checkpoint get the same `ModelConfig`. Quantized tensors (Q4_1,
Q8_0, and every type `gguf.quants` knows) are dequantized to float32 on the host, one tensor
at a time, then cast to the engine's dtype on the device, as vLLM's and transformers' GGUF
loaders do: the engine computes in bf16 / fp32, the file's quantization only sets the weights'
values.

llama.cpp stores a Llama's q and k projections with their rows permuted (it converts RoPE's
rotate-half layout to its interleaved one); `_unpermute` undoes that, as transformers does.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

# general.architecture -> the checkpoint architecture whose family parses the config.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Per-layer GGUF tensor names (after "blk.{i}.") -> HF names (after "model.layers.{i}.").
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}
GGUF_MAGIC = b"GGUF"


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether `path` is a GGUF file (by its magic bytes)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _reader(path: str) -> Any:
    try:
        import gguf
    except ImportError as e:   # a dependency of paxkv: only a broken install lacks it
        raise ImportError("reading GGUF files needs the 'gguf' package: pip install gguf") from e
    return gguf.GGUFReader(path)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor ("blk.3.attn_q.weight" ->
    "model.layers.3.self_attn.q_proj.weight"), None for tensors no family uses."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, name = stem.split(".", 2)
        hf = _LAYER_TENSORS.get(name)
        return None if hf is None else f"model.layers.{layer}.{hf}.{suffix}"
    hf = _GLOBAL_TENSORS.get(stem)
    return None if hf is None else f"{hf}.{suffix}"


def hf_config(reader: Any) -> dict[str, Any]:
    """The file's metadata as a Hugging Face config.json dict."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF field 'general.architecture'={arch!r} is not supported "
                         f"(supported: {sorted(GGUF_ARCHITECTURES)})")

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF field '{arch}.rope.scaling.type'={scaling!r}: scaled RoPE is not "
                         "supported in GGUF files")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("GGUF tensor 'rope_freqs.weight': Llama-3.1 RoPE scaling is not "
                         "supported in GGUF files")
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", ()))
    names = {t.name for t in reader.tensors}
    config = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": _MODEL_TYPES[arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(get("context_length", 8192)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
    }
    if arch == "qwen2":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    return config


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of a Llama q or k projection `[heads * d, ...]`."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """One GGUF file: its HF-style config, its `ModelConfig`, and its tensors by HF name,
    dequantized to float32 on request."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        if not is_gguf(self.path):
            raise ValueError(f"{self.path!r} is not a GGUF file")
        from paxkv.model.registry import config_from_hf
        self.reader = _reader(self.path)
        self.raw = hf_config(self.reader)
        self.arch = _field(self.reader, "general.architecture")
        name = os.path.splitext(os.path.basename(self.path))[0]
        self.cfg = config_from_hf(self.raw, name=name)
        self.tensors = {}
        for t in self.reader.tensors:
            hf = hf_name(t.name)
            if hf is None:
                raise ValueError(f"GGUF tensor {t.name!r} has no place in a "
                                 f"{self.cfg.architecture}")
            self.tensors[hf] = t

    def tensor(self, hf: str) -> np.ndarray:
        """The tensor HF calls `hf`, float32, in HF's layout (`[out, in]` for linears)."""
        import gguf
        t = self.tensors[hf]
        x = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        if self.arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.cfg.num_heads if "q_proj" in hf else self.cfg.num_kv_heads
            x = _unpermute(x, heads)
        return x



# GGUF's `tokenizer.*` metadata keys -> the names transformers' converter and tokenizer take
# (kept here: transformers' own table of them has moved and been renamed between releases).
GGUF_TOKENIZER_KEYS = {
    "tokenizer": {
        "ggml.model": "tokenizer_type", "ggml.pre": "pre_tokenizer_type", "ggml.tokens": "tokens",
        "ggml.scores": "scores", "ggml.token_type": "token_type", "ggml.merges": "merges",
        "ggml.precompiled_charsmap": "precompiled_charsmap", "ggml.bos_token_id": "bos_token_id",
        "ggml.eos_token_id": "eos_token_id", "ggml.unknown_token_id": "unk_token_id",
        "ggml.padding_token_id": "pad_token_id", "ggml.add_space_prefix": "add_prefix_space",
    },
    "tokenizer_config": {
        "chat_template": "chat_template", "ggml.add_bos_token": "add_bos_token",
        "ggml.add_eos_token": "add_eos_token",
    },
}


def gguf_hf_tokenizer(path: str | os.PathLike) -> tuple[Any, tuple[int, ...]]:
    """(the file's tokenizer with its chat template, built by transformers from the GGUF
    vocabulary; the file's EOS ids), for `paxkv.tokenizer.load_tokenizer` to wrap.

    The metadata is read here with the `gguf` package and handed to transformers' converter,
    the same steps as `PreTrainedTokenizerFast.from_pretrained(gguf_file=...)` takes, whose
    own GGUF reader needs PyTorch, which paxkv does not."""
    from transformers import PreTrainedTokenizerFast
    try:       # where transformers keeps its GGUF tokenizer converter moved between releases
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:
        from transformers.integrations.ggml import convert_gguf_tokenizer
    reader = _reader(os.fspath(path))
    meta = {key: _field(reader, key) for key in reader.fields if key.startswith("tokenizer.")}
    grouped = {group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in meta}
               for group, renames in GGUF_TOKENIZER_KEYS.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":   # llama.cpp adds BOS unless told otherwise
        config.setdefault("add_bos_token", True)
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(_field(reader, "general.architecture"), tokenizer)
    # Newer converters also return some of the special tokens: the file's own values win,
    # theirs fill what the file leaves unset.
    kwargs = {**extra, **{k: v for k, v in config.items() if v is not None or k not in extra}}
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return hf, () if eos is None else (int(eos),)

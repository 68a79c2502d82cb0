"""Tiny Hugging Face checkpoints and tokenizers for tests (torch CPU, float32).

`make_hf_checkpoint(path, **overrides)` saves a random `LlamaForCausalLM` with
`save_pretrained`; `TINY_CONFIGS` names the variants the model tests cover. Weights use a
larger init range than HF's default and random RMSNorm gains, so that logits are spread out
(greedy choices are not near-ties) and a model that ignored a norm weight would fail.
`make_tiny_tokenizer(path)` writes a byte-level BPE tokenizer with Llama-3's special tokens.
"""
from __future__ import annotations

import os
from typing import Any

import pytest

NO_TORCH = ("torch is not installed: it runs the transformers reference checkpoints, and the "
            "test extra pins its CPU wheel for Python 3.11 only")


def import_torch():
    """torch, or skip the calling test (see NO_TORCH)."""
    return pytest.importorskip("torch", reason=NO_TORCH)

BASE_CONFIG: dict[str, Any] = dict(
    vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=1, rope_theta=10000.0,
    max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2,
)

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # 8 query heads over 2 kv heads (ratio 4), head_dim 16 != hidden / heads.
    "gqa": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16),
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # original_max_position_embeddings 32, prompts longer than that; theta 10000 and
    # head_dim 16 put frequencies in all three bands (kept, blended, divided by factor).
    "llama3_rope": dict(num_attention_heads=4, num_key_value_heads=1, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    "sharded": dict(num_attention_heads=4, num_key_value_heads=2, _max_shard_size="40KB"),
}


def make_hf_llama(seed: int = 0, init_std: float = 0.1, **overrides: Any):
    """A random transformers LlamaForCausalLM (float32, eval mode)."""
    torch = import_torch()
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = {**BASE_CONFIG, "initializer_range": init_std}
    kwargs.update({k: v for k, v in overrides.items() if not k.startswith("_")})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def make_hf_checkpoint(path: str | os.PathLike, seed: int = 0, init_std: float = 0.1,
                       **overrides: Any) -> str:
    """Save a random tiny Llama with `save_pretrained`; `_max_shard_size` shards it."""
    model = make_hf_llama(seed=seed, init_std=init_std, **overrides)
    shard = overrides.get("_max_shard_size")
    path = os.fspath(path)
    if shard:
        model.save_pretrained(path, max_shard_size=shard)
    else:
        model.save_pretrained(path)
    return path


def load_hf_model(path: str | os.PathLike):
    """transformers' own load of a checkpoint directory, float32, eval mode."""
    torch = import_torch()
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(os.fspath(path), dtype=torch.float32).eval()


def hf_logits(model, token_ids: list[int]):
    """Float32 numpy logits `[len, vocab]` of one unpadded prompt."""
    torch = import_torch()

    with torch.no_grad():
        out = model(torch.tensor([token_ids], dtype=torch.long))
    return out.logits[0].float().numpy()


def hf_greedy(model, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate(do_sample=False), never stopping early; new tokens only."""
    torch = import_torch()

    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.tensor([token_ids], dtype=torch.long)
    with torch.no_grad():
        # An explicit mask: otherwise generate() masks every prompt token equal to the pad id.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
    return out[0, len(token_ids):].tolist()


LLAMA3_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                         "<|end_header_id|>", "<|eot_id|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the key value cache in fixed size blocks.",
    "A block table maps logical blocks of a sequence to physical blocks in memory.",
    "Hello world! How are you today? I am fine, thank you.",
    "user assistant system: you are a helpful assistant.",
] * 20


def make_tiny_tokenizer(path: str | os.PathLike, vocab_size: int = 320,
                        chat_template: str | None = None, add_generation_config: bool = True) -> str:
    """Byte-level BPE with Llama-3's special tokens, saved as tokenizer.json + config.

    BOS is prepended by the post-processor (as Llama-3's tokenizer does); `<|eot_id|>` is
    listed as an extra EOS in generation_config.json, as Llama-3-Instruct checkpoints do.
    """
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=LLAMA3_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    bos_id = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
        special_tokens=[("<|begin_of_text|>", bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|end_of_text|>")
    if chat_template is not None:
        fast.chat_template = chat_template
    path = os.fspath(path)
    fast.save_pretrained(path)
    if add_generation_config:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": bos_id,
                       "eos_token_id": [tok.token_to_id("<|end_of_text|>"),
                                        tok.token_to_id("<|eot_id|>")]}, f)
    return path


# ---------------------------------------------------------------------------- other families
# Tiny random checkpoints of every family the registry serves, saved by transformers itself.
# Windows are short (24 tokens) so the tests' prompts run past them; Gemma 3 has sliding and
# global layers, its own local RoPE base, a linearly scaled global RoPE and a logit cap.
FAMILY_WINDOW = 24
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16),
    "mistral": dict(num_attention_heads=4, num_key_value_heads=2,
                    sliding_window=FAMILY_WINDOW),
    "gemma3": dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, sliding_window=FAMILY_WINDOW, query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_theta=1000.0, rope_local_base_freq=100.0,
                   rope_scaling={"rope_type": "linear", "factor": 2.0},
                   final_logit_softcapping=30.0, tie_word_embeddings=True),
    # 4 experts, top 2, every layer sparse, the window as Mistral's.
    "mixtral": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=FAMILY_WINDOW),
    # 3 layers: 0 and 2 sparse (top 2 of 4 experts, weights not renormalised), 1 dense.
    "qwen3_moe": dict(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[1],
                      norm_topk_prob=False),
}


def _family_classes(family: str):
    import transformers as tf
    return {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
            "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
            "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
            "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
            "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM)}[family]


def make_hf_family(family: str, seed: int = 0, init_std: float = 0.1, **overrides: Any):
    """A random transformers model of `family` (float32, eval mode, eager attention), with
    random norm gains and biases so that a model ignoring either would fail."""
    torch = import_torch()
    config_cls, model_cls = _family_classes(family)
    kwargs = {**BASE_CONFIG, "initializer_range": init_std, **FAMILY_CONFIGS[family], **overrides}
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    model = model_cls(config).eval()
    unit_offset = family == "gemma3"        # Gemma's gains are applied as 1 + w
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((0.0 if unit_offset else 1.0) + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def make_hf_family_checkpoint(path: str | os.PathLike, family: str, seed: int = 0,
                              **overrides: Any) -> str:
    model = make_hf_family(family, seed=seed, **overrides)
    path = os.fspath(path)
    model.save_pretrained(path)
    return path


def load_hf_family(path: str | os.PathLike, family: str):
    """transformers' own load of a family checkpoint, float32, eager attention."""
    torch = import_torch()
    _, model_cls = _family_classes(family)
    return model_cls.from_pretrained(os.fspath(path), dtype=torch.float32,
                                     attn_implementation="eager").eval()

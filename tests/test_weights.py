"""Checkpoint loading / saving: HF layout, dtypes, shards, errors, round trips through transformers."""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hf_fixtures import TINY_CONFIGS, hf_logits, import_torch, load_hf_model, make_hf_checkpoint
from paxkv.model import dense, params as model_params
from paxkv.model.weights import (load_checkpoint, random_params, read_safetensors_header,
                                 save_checkpoint, tensor_specs, write_safetensors)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("gqa"), seed=11, **TINY_CONFIGS["gqa"])


def _hf_state(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    out = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def _copy_without(src: str, dst: str, drop: str | None = None,
                  replace: dict[str, np.ndarray] | None = None, extra: dict | None = None) -> str:
    """Copy a single-file checkpoint, dropping / replacing / adding tensors."""
    shutil.copytree(src, dst)
    tensors = _hf_state(src)
    if drop:
        del tensors[drop]
    tensors.update(replace or {})
    tensors.update(extra or {})
    write_safetensors(os.path.join(dst, "model.safetensors"), tensors, {"format": "pt"})
    return dst


def test_load_matches_hf_tensors_in_layout_and_dtype(ckpt):
    state = _hf_state(ckpt)
    p32, cfg = load_checkpoint(ckpt, dtype="float32")
    p16, _ = load_checkpoint(ckpt, dtype="bfloat16")
    assert cfg.num_heads == 8 and cfg.num_kv_heads == 2 and cfg.head_dim == 16
    assert cfg.name == os.path.basename(ckpt)
    for spec in tensor_specs(cfg):
        ref = state[spec.hf_name].T if spec.transpose else state[spec.hf_name]
        got32 = p32
        got16 = p16
        for key in spec.path:
            got32, got16 = got32[key], got16[key]
        assert got32.dtype == jnp.float32 and got16.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got32), ref)
        np.testing.assert_array_equal(np.asarray(got16), ref.astype(ml_dtypes.bfloat16))
    # No stray leaves: the tree is exactly the model's parameter tree.
    assert jax.tree_util.tree_structure(p32) == jax.tree_util.tree_structure(
        model_params.param_shapes(cfg, jnp.float32))


def test_bf16_checkpoint_and_sharded_checkpoint_load_the_same_values(tmp_path):
    """A bf16 safetensors file (unreadable by safetensors' numpy backend) and a sharded one."""
    torch = import_torch()
    from hf_fixtures import make_hf_llama
    model = make_hf_llama(seed=5, **TINY_CONFIGS["tied"])
    model.save_pretrained(tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="30KB")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")  # .to() converts in place
    assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    single, cfg = load_checkpoint(tmp_path / "single", dtype="float32")
    sharded, cfg2 = load_checkpoint(tmp_path / "sharded", dtype="float32")
    from_bf16, _ = load_checkpoint(tmp_path / "bf16", dtype="float32")
    assert cfg.tie_word_embeddings and "lm_head" not in single
    assert dataclasses_equal_but_name(cfg, cfg2)
    jax.tree_util.tree_map(np.testing.assert_array_equal, single, sharded)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_array_equal(
            np.asarray(a), np.asarray(b).astype(ml_dtypes.bfloat16).astype(np.float32)),
        from_bf16, single)
    auto, _ = load_checkpoint(tmp_path / "bf16", dtype="auto")
    assert jax.tree_util.tree_leaves(auto)[0].dtype == jnp.bfloat16


def dataclasses_equal_but_name(a, b) -> bool:
    import dataclasses
    return dataclasses.replace(a, name="x") == dataclasses.replace(b, name="x")


def test_missing_tensor_is_named(ckpt, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    bad = _copy_without(ckpt, str(tmp_path / "bad"), drop=name)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_checkpoint(bad)


def test_wrong_shape_is_named(ckpt, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"
    bad = _copy_without(ckpt, str(tmp_path / "bad"),
                        replace={name: np.zeros((16, 64), np.float32)})
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + r".*\(16, 64\)"):
        load_checkpoint(bad)


def test_config_that_disagrees_with_tensors_is_caught(ckpt, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(ckpt, bad)
    with open(os.path.join(bad, "config.json")) as f:
        raw = json.load(f)
    raw["intermediate_size"] = 96
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight"):
        load_checkpoint(bad)


def test_unexpected_tensor_is_named(ckpt, tmp_path):
    bad = _copy_without(ckpt, str(tmp_path / "bad"),
                        extra={"model.layers.0.self_attn.q_proj.bias": np.zeros(128, np.float32)})
    with pytest.raises(ValueError, match=r"q_proj\.bias"):
        load_checkpoint(bad)


@pytest.mark.parametrize("field,value,match", [
    ("architectures", ["GPT2LMHeadModel"], "architectures"),
    ("model_type", "gpt2", "model_type"),
    ("hidden_act", "gelu", "hidden_act"),
    ("mlp_bias", True, "mlp_bias"),
])
def test_unsupported_config_is_named(ckpt, tmp_path, field, value, match):
    bad = str(tmp_path / "bad")
    shutil.copytree(ckpt, bad)
    with open(os.path.join(bad, "config.json")) as f:
        raw = json.load(f)
    raw[field] = value
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match=match):
        load_checkpoint(bad)


def test_missing_files_and_bad_dtype(ckpt, tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(tmp_path)
    empty = str(tmp_path / "noweights")
    os.makedirs(empty)
    shutil.copy(os.path.join(ckpt, "config.json"), empty)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_checkpoint(empty)
    with pytest.raises(ValueError, match="dtype"):
        load_checkpoint(ckpt, dtype="int8")


def test_missing_shard_is_named(tmp_path):
    path = make_hf_checkpoint(tmp_path / "sharded", seed=1, **TINY_CONFIGS["sharded"])
    shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(ValueError, match=shard):
        load_checkpoint(path)


@pytest.mark.parametrize("variant", ["llama3_rope", "tied"])
def test_save_checkpoint_loads_in_transformers(tmp_path, variant):
    """Our writer's config.json + safetensors load in transformers and give our logits."""
    src = make_hf_checkpoint(tmp_path / "src", seed=2, **TINY_CONFIGS[variant])
    params, cfg = load_checkpoint(src, dtype="float32")
    # Perturb so the saved model is not just the source files copied back.
    params = jax.tree_util.tree_map(lambda x: x * 1.01, params)
    save_checkpoint(params, cfg, tmp_path / "out")
    hf = load_hf_model(tmp_path / "out")
    assert hf.config.tie_word_embeddings == cfg.tie_word_embeddings
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 40).tolist()
    ours = np.asarray(jax.jit(dense.dense_forward, static_argnames="cfg")(
        params, jnp.asarray([prompt]), cfg)[0][0])
    np.testing.assert_allclose(ours, hf_logits(hf, prompt), atol=1e-4, rtol=0)
    reloaded, cfg2 = load_checkpoint(tmp_path / "out", dtype="float32")
    assert dataclasses_equal_but_name(cfg, cfg2)
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, reloaded)


def test_save_checkpoint_bf16_header(tmp_path):
    from paxkv.config import ModelConfig
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, eos_token_ids=(2, 3))
    params = random_params(cfg, 0, "bfloat16")
    save_checkpoint(params, cfg, tmp_path)
    header, _ = read_safetensors_header(str(tmp_path / "model.safetensors"))
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    assert header["lm_head.weight"]["shape"] == [32, 16]
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["eos_token_id"] == [2, 3]
    back, _ = load_checkpoint(tmp_path, dtype="bfloat16")
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, back)


def test_random_params_layout():
    from paxkv.config import PRESETS
    cfg = PRESETS["tiny-random"]
    params = random_params(cfg, 1, "bfloat16")
    shapes = model_params.param_shapes(cfg, jnp.bfloat16)
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(shapes)
    for a, s in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(shapes)):
        assert a.shape == s.shape and a.dtype == jnp.bfloat16
    q = np.asarray(params["layers_0"]["self_attn"]["q_proj"]["kernel"], np.float32)
    k = np.asarray(params["layers_0"]["self_attn"]["k_proj"]["kernel"], np.float32)
    assert 0.015 < q.std() < 0.025 and not np.array_equal(q[:, :k.shape[1]], k)
    np.testing.assert_array_equal(np.asarray(params["norm"]["scale"], np.float32), 1.0)
    with pytest.raises(ValueError, match="dtype"):
        random_params(cfg, 0, "float64")

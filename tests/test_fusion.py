"""The fused serving layout of the projections (paxkv/model/fusion.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv.config import get_preset
from paxkv.model.dense import dense_forward
from paxkv.model.fusion import fuse_projections, is_fused
from paxkv.model.params import init_params
from paxkv.model.weights import hf_tensors


@pytest.fixture(scope="module")
def model():
    cfg = get_preset("tiny-random")
    return cfg, init_params(cfg, jax.random.PRNGKey(3))


@pytest.mark.slow
def test_fused_layout_gives_the_same_logits(model):
    cfg, params = model
    fused = fuse_projections(params)
    assert not is_fused(params) and is_fused(fused)
    assert set(fused["layers_0"]["self_attn"]) == {"qkv_proj", "o_proj"}
    assert set(fused["layers_0"]["mlp"]) == {"gate_up_proj", "down_proj"}
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 13)))
    a, _ = dense_forward(params, ids, cfg)
    b, _ = dense_forward(fused, ids, cfg)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)


def test_fusing_is_idempotent_and_exports_the_same_checkpoint(model):
    cfg, params = model
    fused = fuse_projections(params)
    assert fuse_projections(fused) is fused
    plain = dict(hf_tensors(params, cfg))
    from_fused = dict(hf_tensors(fused, cfg))
    assert plain.keys() == from_fused.keys()
    for name in plain:
        assert np.array_equal(np.asarray(plain[name]), np.asarray(from_fused[name])), name


def test_engine_serves_from_the_fused_layout():
    from paxkv import LLM
    llm = LLM("tiny-random", tokenizer=None, num_gpu_blocks_override=16, max_model_len=64)
    assert is_fused(llm.llm_engine.runner.params)

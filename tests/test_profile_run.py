"""KV pool sizing: the profile measures only its own step, so the pool does not depend on
what the process allocated before; shutdown releases the device memory at once."""
import gc

import jax
import jax.numpy as jnp

from paxkv import LLM
from paxkv.config import ModelConfig
from paxkv.model.llama import init_params
from paxkv.runner import memory, profile_activation_bytes

from engine_helpers import make_runner_config

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=16)


def _profile(tokens: int) -> int:
    params = init_params(CFG, jax.random.PRNGKey(0), jnp.float32)
    return profile_activation_bytes(make_runner_config(
        CFG, block_size=8, num_blocks=None, max_num_seqs=4, max_num_batched_tokens=tokens,
        max_model_len=512), params)


def test_profile_grows_with_the_step_and_ignores_history():
    small, large = _profile(40), _profile(400)
    assert 0 < small < large
    hog = jnp.ones((1 << 22,), jnp.float32)   # 16 MiB held by someone else meanwhile
    assert _profile(40) == small
    del hog


def _live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def test_two_engines_in_one_process_get_the_same_pool(monkeypatch):
    """An accelerator-style budget: the allocator reports what is live now."""
    limit = _live_bytes() + (256 << 20)
    monkeypatch.setattr(memory, "device_memory_stats",
                        lambda: {"bytes_limit": limit, "bytes_in_use": _live_bytes()})
    pools = []
    for _ in range(2):
        llm = LLM("tiny", max_model_len=512, compilation_cache_dir=None)
        pools.append(llm.llm_engine.metrics.num_blocks)
        llm.shutdown()
        gc.collect()
    assert pools[0] == pools[1] > 64


def test_shutdown_releases_device_memory():
    before = {id(x) for x in jax.live_arrays()}
    with LLM("tiny", compilation_cache_dir=None) as llm:
        llm.generate(["It is a truth"], use_tqdm=False)
        assert len([x for x in jax.live_arrays() if id(x) not in before]) > 0
    left = [x for x in jax.live_arrays() if id(x) not in before]
    assert left == []

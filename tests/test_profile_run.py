"""KV pool sizing: the profile measures only its own step, so the pool does not depend on
what the process allocated before; shutdown releases the device memory at once."""
import gc

import jax
import jax.numpy as jnp
import pytest

from paxkv import LLM
from paxkv.config import ModelConfig
from paxkv.model.params import init_params
from paxkv.runner import memory, profile_activation_bytes

from engine_helpers import make_runner_config

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=16)


def _profile(tokens: int) -> int:
    params = init_params(CFG, jax.random.PRNGKey(0), jnp.float32)
    return profile_activation_bytes(make_runner_config(
        CFG, block_size=8, num_blocks=None, max_num_seqs=4, max_num_batched_tokens=tokens,
        max_model_len=512), params)


@pytest.mark.slow
def test_profile_grows_with_the_step_and_ignores_history():
    small, large = _profile(40), _profile(400)
    assert 0 < small < large
    hog = jnp.ones((1 << 22,), jnp.float32)   # 16 MiB held by someone else meanwhile
    assert _profile(40) == small
    del hog


def test_profile_samples_max_num_seqs_rows():
    """The profile step samples `max_num_seqs` rows at a temperature, as vLLM's dummy sampler
    run does: the sampler's temporaries grow with the rows (on an H100 a 1,024-row sampled
    step needed 4.9 GiB that a greedy profile never counted), at least one float32 copy of
    each extra row's logits."""
    import dataclasses
    cfg = dataclasses.replace(CFG, vocab_size=8192)
    params = init_params(cfg, jax.random.PRNGKey(0), jnp.float32)

    def profile(seqs: int) -> int:
        return profile_activation_bytes(make_runner_config(
            cfg, block_size=8, num_blocks=None, max_num_seqs=seqs, max_num_batched_tokens=64,
            max_model_len=512), params)
    assert profile(256) - profile(4) >= (256 - 4) * cfg.vocab_size * 4


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


def test_pool_leaves_room_to_autotune_the_largest_weight():
    """XLA autotunes a new program's matmuls on buffers of its operands' size while the pool
    is live: the sizing keeps `AUTOTUNE_RESERVE_WEIGHTS` times the largest weight free."""
    params = init_params(CFG, jax.random.PRNGKey(0), jnp.float32)
    largest = memory.largest_weight_bytes(params)
    assert largest == max(x.nbytes for x in jax.tree_util.tree_leaves(params))
    block = 1 << 10
    args = dict(limit=100 * block, in_use=10 * block, activations=5 * block, utilization=1.0,
                bytes_per_block=block)
    without = memory.blocks_for_budget(**args)
    assert without == int(100 * 0.95) - 15
    assert memory.blocks_for_budget(**args, reserve=2 * largest) == int(
        (95 * block - 15 * block - 2 * largest) // block)
    assert memory.blocks_for_budget(**args, reserve=1000 * block) == 2   # never below two


def test_engine_pool_counts_the_reserve(monkeypatch):
    """The engine's own sizing subtracts the reserve: keeping about 16 MiB free for
    autotuning takes blocks out of the pool."""
    limit = _live_bytes() + (256 << 20)
    monkeypatch.setattr(memory, "device_memory_stats",
                        lambda: {"bytes_limit": limit, "bytes_in_use": _live_bytes()})

    def pool_and_largest_weight(reserve_weights: int) -> tuple[int, int]:
        monkeypatch.setattr(memory, "AUTOTUNE_RESERVE_WEIGHTS", reserve_weights)
        llm = LLM("tiny", max_model_len=512, compilation_cache_dir=None)
        result = (llm.llm_engine.metrics.num_blocks,
                  memory.largest_weight_bytes(llm.llm_engine.runner.params))
        llm.shutdown()
        gc.collect()
        return result

    without, largest = pool_and_largest_weight(0)
    with_reserve, _ = pool_and_largest_weight((16 << 20) // largest)
    assert 64 < with_reserve < without

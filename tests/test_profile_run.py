"""The memory profile run that sizes the KV pool executes the largest step (CPU: no stats)."""
import jax.numpy as jnp

from paxkv.model.llama import init_params
from paxkv.config import ModelConfig
from paxkv.runner import profile_activation_bytes
import jax


def test_profile_run_executes_the_largest_step():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    params = init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    got = profile_activation_bytes(cfg, params, backend="reference", block_size=8,
                                   kv_dtype=jnp.float32, max_num_seqs=4, max_num_batched_tokens=40,
                                   max_model_len=64)
    assert got == 0  # the CPU reports no memory statistics; on a GPU it is the peak delta

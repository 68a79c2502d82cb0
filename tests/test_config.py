"""The runner's settings come from one builder: derived values and checks that name the field."""
from __future__ import annotations

import dataclasses
import sys

import pytest

from paxkv.config import (PRESETS, PROFILE_NUM_BLOCKS, CacheConfig, EngineConfig, SchedulerConfig,
                          default_batch_limits, runner_config)

TINY = PRESETS["tiny-random"]   # max_position_embeddings 2048


def _engine(cache: CacheConfig | None = None, sched: SchedulerConfig | None = None,
            **kw) -> EngineConfig:
    return EngineConfig(TINY, cache or CacheConfig(), sched or SchedulerConfig(), **kw)


def test_cpu_settings_from_defaults():
    engine = _engine(CacheConfig(block_size=16), SchedulerConfig(
        max_num_seqs=24, max_num_batched_tokens=100, max_model_len=200), dtype="auto")
    rc = runner_config(engine.with_pool(50, 3), platform="cpu")
    assert (rc.dtype, rc.kv_cache_dtype, rc.attention_backend) == ("float32", "float32", "reference")
    assert not rc.fixed_shapes
    assert rc.token_buckets == (16, 32, 64, 100)
    assert rc.seq_buckets == (4, 8, 16, 24)
    assert rc.block_buckets == (4, 8, 13)        # ceil(200 / 16) blocks at most
    assert rc.row_buckets == (4, 8, 16, 32, 64, 96)
    assert rc.copy_buckets == (4, 8, 16, 32, 50)
    assert (rc.num_blocks, rc.num_host_blocks, rc.max_blocks_per_seq) == (50, 3, 13)
    hash(rc)   # a frozen, hashable value


def test_gpu_settings_fixed_shapes_and_8bit_pages():
    engine = _engine(CacheConfig(block_size=16, kv_cache_dtype="fp8"), SchedulerConfig(
        max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048), dtype="auto")
    rc = runner_config(engine.with_pool(4096), platform="gpu")
    assert (rc.dtype, rc.kv_cache_dtype, rc.attention_backend) == ("bfloat16", "fp8_e4m3", "pallas")
    assert rc.fixed_shapes and rc.block_buckets == (128,)
    assert rc.seq_buckets == (8, 16, 32, 64, 128, 256)
    assert rc.token_buckets == (256, 512, 1024, 2048, 4096, 8192)
    assert rc.row_buckets[-1] == 1024
    # tables wider than 2,048 tokens: short decode steps get the narrow width too
    wide = EngineConfig(dataclasses.replace(TINY, max_position_embeddings=8192),
                        CacheConfig(block_size=16), SchedulerConfig(
                            max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=8192),
                        dtype="auto")
    assert runner_config(wide.with_pool(4096), platform="gpu").block_buckets == (128, 512)


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 256])
def test_gpu_row_buckets_hold_a_mixed_steps_rows(max_num_seqs):
    """On fixed shapes a prefill samples `mixed_step_row_floor` rows, padded to the largest
    sequence bucket: one stream (max_num_seqs=1) pads to 8 slots, which the row buckets hold."""
    from paxkv.runner.buckets import mixed_step_row_floor, pick_bucket
    engine = _engine(CacheConfig(block_size=16), SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, max_model_len=2048), dtype="auto")
    rc = runner_config(engine.with_pool(4096), platform="gpu")
    for tokens in rc.token_buckets:
        floor = mixed_step_row_floor(tokens, rc.seq_buckets[-1])
        assert pick_bucket(max(1, floor, max_num_seqs), rc.row_buckets) >= floor


def test_explicit_choices_win_over_the_platform():
    engine = _engine(CacheConfig(kv_cache_dtype="int8"), dtype="float32",
                     attention_backend="reference").with_pool(200)
    rc = runner_config(engine, platform="gpu")
    assert (rc.dtype, rc.kv_cache_dtype, rc.attention_backend) == ("float32", "int8", "reference")


def test_unsized_pool_is_the_profile_runs():
    sched = SchedulerConfig(max_model_len=64)
    rc = runner_config(_engine(CacheConfig(swap_space=1.0), sched), platform="cpu")
    assert (rc.num_blocks, rc.num_host_blocks) == (PROFILE_NUM_BLOCKS, 0)
    assert rc.copy_buckets == (4,)


def test_runner_config_is_host_only():
    """config.py (builder included) never imports JAX: host code may import it at the top."""
    import subprocess
    code = ("import sys; import paxkv.config as c; "
            "c.runner_config(c.EngineConfig(c.PRESETS['tiny-random'], c.CacheConfig(), "
            "c.SchedulerConfig()), 'cpu'); assert 'jax' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("make, field", [
    (lambda: _engine(dtype="float16"), "dtype"),
    (lambda: _engine(attention_backend="triton"), "attention_backend"),
    (lambda: _engine(tensor_parallel_size=0), "tensor_parallel_size"),
    (lambda: _engine(num_scheduler_steps=0), "num_scheduler_steps"),
    (lambda: _engine(sched=SchedulerConfig(max_model_len=4096)), "max_model_len"),
    (lambda: _engine(CacheConfig(block_size=16), SchedulerConfig(max_model_len=64)).with_pool(4),
     "num_gpu_blocks"),            # 4 blocks of 16 plus the null block are needed
    (lambda: CacheConfig(kv_cache_dtype="fp4"), "kv_cache_dtype"),
    (lambda: CacheConfig(num_gpu_blocks=1), "num_gpu_blocks"),
    (lambda: CacheConfig(num_cpu_blocks=-1), "num_cpu_blocks"),
    (lambda: CacheConfig(watermark=1.0), "watermark"),
    (lambda: SchedulerConfig(max_model_len=64, max_num_batched_tokens=32,
                             enable_chunked_prefill=False), "max_num_batched_tokens"),
    (lambda: runner_config(_engine(), platform=""), "platform"),
])
def test_bad_settings_name_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_pool_that_holds_one_sequence_is_accepted():
    engine = _engine(CacheConfig(block_size=16), SchedulerConfig(max_model_len=64)).with_pool(5)
    assert engine.cache.num_gpu_blocks == 5
    assert dataclasses.replace(engine.cache, num_gpu_blocks=None).num_gpu_blocks is None


@pytest.mark.parametrize("platform, device_bytes, expected", [
    ("gpu", 105 * 2**30, (1024, 16384)),    # an H200 under JAX's default memory fraction
    ("gpu", 60 * 2**30, (1024, 16384)),     # an 80 GB card under JAX's default memory fraction
    ("gpu", 30 * 2**30, (256, 8192)),       # a 40 GB card
    ("gpu", None, (256, 8192)),             # no allocator figures
    ("cpu", 10**15, (256, 8192)),           # host memory never counts
])
def test_default_batch_limits_follow_the_device(platform, device_bytes, expected):
    assert default_batch_limits(None, None, platform, device_bytes) == expected


def test_default_batch_limits_keep_what_was_given():
    assert default_batch_limits(64, None, "gpu", 105 * 2**30) == (64, 16384)
    assert default_batch_limits(None, 2048, "gpu", 105 * 2**30) == (1024, 2048)
    assert default_batch_limits(8, 100, "cpu", None) == (8, 100)


def test_llm_on_cpu_takes_the_small_limits():
    """The CPU demo's defaults stay where they were (LLM resolves None before the scheduler)."""
    from paxkv import LLM
    llm = LLM("tiny", tokenizer=None)
    try:
        assert (llm.config.scheduler.max_num_seqs, llm.config.scheduler.max_num_batched_tokens) == (256, 8192)
    finally:
        llm.shutdown()


def test_server_steps_keep_vllms_token_budget():
    """`paxkv serve` fills in 8192 tokens per step when no flag gives one, on every device,
    and leaves the batch size to LLM's rule."""
    from paxkv.serve import cli
    parser, names = cli.build_parser()
    args = cli.engine_arguments(parser.parse_args(["tiny"]), names)
    assert args["max_num_batched_tokens"] == 8192 and args["max_num_seqs"] is None
    args = cli.engine_arguments(parser.parse_args(["tiny", "--max-num-batched-tokens", "512"]), names)
    assert args["max_num_batched_tokens"] == 512

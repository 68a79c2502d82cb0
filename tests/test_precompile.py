"""Precompiling the step shapes: after it, requests arriving over time (prefill chunks mixed
into running decodes, greedy and sampled) compile nothing, and their outputs equal those of
an engine that compiled on demand (the dummy steps touch only the null block)."""
from __future__ import annotations

import dataclasses
import random

import pytest

from paxkv import LLM, SamplingParams
from paxkv.config import PRESETS, runner_config
from paxkv.engine.llm_engine import LLMEngine
from paxkv.engine.step_io import SampleRow, WorkItem
from paxkv.runner import Runner
from paxkv.runner.precompile import SAMPLERS, dummy_step, reachable_step_shapes
from tests.engine_helpers import make_runner_config


def _gpu_layout(llm: LLM):
    """The engine's config on the GPU's fixed shapes (still float32 and the reference
    attention, so it runs on the CPU)."""
    return runner_config(llm.config, platform="gpu")


def _engine(llm: LLM, layout=_gpu_layout) -> LLMEngine:
    runner = Runner(llm.llm_engine.runner.params, layout(llm))
    return LLMEngine(llm.config, runner, llm.tokenizer)


def _staggered(engine: LLMEngine, seed: int) -> dict[str, list[int]]:
    """Requests join a running batch every few steps: mid-block prompt lengths, chunked
    prefills, greedy and seeded sampling with and without top-p, early stops."""
    rng = random.Random(seed)
    arrivals = sorted((rng.randrange(0, 40), i) for i in range(14))
    outputs: dict[str, list[int]] = {}
    step = 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, i = arrivals.pop(0)
            prompt = [rng.randrange(3, 4000) for _ in range(rng.randint(3, 150))]
            sampled = i % 2 == 1
            params = SamplingParams(temperature=0.8 if sampled else 0.0, seed=i if sampled else None,
                                    top_p=0.9 if i % 4 == 3 else 1.0,
                                    max_tokens=rng.randint(1, 30), ignore_eos=True, detokenize=False)
            engine.add_request(str(i), prompt, params)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
        assert step < 2000, "the workload did not finish"
    return outputs


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", dtype="float32", attention_backend="reference", max_model_len=256,
               max_num_seqs=8, max_num_batched_tokens=512, num_gpu_blocks_override=128,
               compilation_cache_dir=None)


def _two_widths(llm: LLM):
    """The GPU layout with a narrow decode table width below the full one, as an engine with
    `max_model_len` past `config.NARROW_DECODE_TOKENS` has (here 8 blocks and 16)."""
    return dataclasses.replace(_gpu_layout(llm), block_buckets=(8, 16))


@pytest.mark.parametrize("layout", [_gpu_layout, _two_widths], ids=["one_width", "two_widths"])
def test_every_reached_shape_is_listed_and_every_listed_shape_packs_to_itself(llm, layout):
    config = layout(llm)
    shapes = reachable_step_shapes(config)
    runner = Runner.__new__(Runner)
    runner._take_shapes(config)
    runner._table_rows = None

    def key(items, rows):
        batch, decode_only, st, _, _ = runner.pack_step(items, rows)
        return decode_only, batch.token_ids.shape[0], batch.block_tables.shape, st.seeds.shape[0]

    listed = {key(*dummy_step(s, config)) for s in shapes}
    assert len(listed) == len(shapes)          # one program each
    rng = random.Random(0)
    for _ in range(300):                       # random steps a run could schedule
        n = rng.randint(1, config.max_num_seqs)
        decode = rng.random() < 0.4
        if decode:
            lens = [1] * n
        else:
            lens = [rng.randint(1, 40) for _ in range(n)]
            lens[rng.randrange(n)] = rng.randint(2, 200)
            lens = lens if sum(lens) <= config.max_num_batched_tokens else [2]
        sampled = rng.randint(0, len(lens))
        # decode steps at any context (table width), prefill chunks from position 0
        starts = [rng.randint(0, 250) if decode else 0 for _ in lens]
        items = [WorkItem([0] * q, s, [0] * -(-(s + q) // config.block_size))
                 for q, s in zip(lens, starts)]
        rows = [SampleRow(i) for i in range(sampled)]
        assert key(items, rows) in listed, (lens, sampled)


@pytest.mark.slow
def test_no_compilation_after_precompile_and_outputs_unchanged(llm):
    engine = _engine(llm)
    compiled = engine.runner.precompile(use_tqdm=False)
    assert compiled == engine.runner.num_compilations == len(SAMPLERS) * len(reachable_step_shapes(engine.runner.config))
    got = _staggered(engine, seed=5)
    assert engine.runner.num_compilations == compiled, "a request waited on a compilation"
    assert engine.block_manager.num_used_blocks == 0

    reference = _engine(llm)                   # compiles on demand
    want = _staggered(reference, seed=5)
    assert reference.runner.num_compilations > 0
    assert got == want and len(got) == 14
    # The fixed shapes (mixed steps padded to a floor of sampled rows) change no output: the
    # CPU's own layout, unpadded, gives the same tokens.
    unpadded = LLMEngine(llm.config, llm.llm_engine.runner, llm.tokenizer)
    assert not unpadded.runner.fixed_shapes
    assert _staggered(unpadded, seed=5) == want


@pytest.mark.slow
def test_two_table_widths_precompile_and_change_no_output(llm):
    """Narrow tables for short decode steps, full ones for the rest: every program is
    precompiled (both widths reached by the workload) and the tokens are those of the
    one-width layout."""
    engine = _engine(llm, _two_widths)
    compiled = engine.runner.precompile(use_tqdm=False)
    assert compiled == len(SAMPLERS) * len(reachable_step_shapes(engine.runner.config))
    pack, widths = engine.runner.pack, set()

    def recording_pack(items):
        batch, decode_only = pack(items)
        widths.add((decode_only, batch.block_tables.shape[-1]))
        return batch, decode_only

    engine.runner.pack = recording_pack
    try:
        got = _staggered(engine, seed=5)
    finally:   # the wrapper holds the runner: drop the cycle so its pool goes with the test
        del engine.runner.pack
    assert engine.runner.num_compilations == compiled, "a request waited on a compilation"
    assert widths == {(True, 8), (True, 16), (False, 16)}
    assert got == _staggered(_engine(llm), seed=5)


@pytest.mark.slow
def test_precompile_needs_fixed_shapes_and_a_bool():
    config = make_runner_config(PRESETS["tiny-random"], block_size=16,
                                num_blocks=32, max_num_seqs=4, max_num_batched_tokens=64,
                                max_model_len=64)
    with pytest.raises(ValueError, match="precompile needs fixed step shapes"):
        reachable_step_shapes(config)
    with pytest.raises(ValueError, match="precompile needs the GPU"):
        LLM("tiny", precompile=True, compilation_cache_dir=None)
    with pytest.raises(TypeError, match="precompile must be a bool"):
        LLM("tiny", precompile="yes", compilation_cache_dir=None)

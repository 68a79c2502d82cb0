"""Tensor parallelism on host-platform CPU devices: TP = 2, 4, 8 equal TP = 1 token for token.

conftest.py gives this process eight CPU devices. The model is a transformers-made random
checkpoint with 8 KV heads in float32; the only difference between the runs is where the
weights and KV heads live and the order of the all-reduce sums.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from engine_helpers import assert_no_leaks
from hf_fixtures import make_hf_checkpoint
from paxkv import LLM, SamplingParams
from tp_helpers import TP_CONFIG, llm_kwargs, prompts, workload

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 host-platform devices")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "ckpt"
    make_hf_checkpoint(path, seed=7, _max_shard_size="60KB", **TP_CONFIG)
    return str(path)


_ONE_DEVICE: dict[str, dict] = {}


def one_device(checkpoint: str, name: str = "default", **overrides) -> dict:
    """The TP = 1 run of a configuration (computed once per module)."""
    if name not in _ONE_DEVICE:
        llm = LLM(checkpoint, **llm_kwargs(**overrides))
        _ONE_DEVICE[name] = workload(llm, beams=name == "default")
    return _ONE_DEVICE[name]


def _without_beams(out: dict) -> dict:
    return {k: v for k, v in out.items() if k != "beams"}


def _tokens(out: dict) -> dict:
    """The tokens of a run (a pool too small to keep every prefix caches fewer of them)."""
    return {k: v for k, v in out.items() if k not in ("beams", "cached")}


@pytest.mark.slow
@pytest.mark.parametrize("tp,steps", [(2, 1), (4, 4), (8, 1)])
def test_tensor_parallel_equals_one_device(checkpoint, tp, steps):
    """Greedy, prefix-cache hits and seeded n=3 samples (forks sharing blocks copy-on-write);
    beam search at TP = 2; at TP = 4, 4 decode steps per device call (multi-step decoding
    gives the tokens of single steps)."""
    want = one_device(checkpoint)
    llm = LLM(checkpoint, tensor_parallel_size=tp, **llm_kwargs(num_scheduler_steps=steps))
    got = workload(llm, beams=tp == 2)
    assert got == (want if tp == 2 else _without_beams(want))
    assert len({tuple(t) for t in got["greedy"]}) == len(got["greedy"])
    assert all(c > 0 for c in got["cached"][:2])          # the prefix cache served them
    pool = llm.llm_engine.runner.kv_pool                  # still split by heads after the steps
    assert pool.k[0].sharding.spec[2] == "tp" and pool.k[0].addressable_shards[0].data.shape[2] == 8 // tp
    assert_no_leaks(llm)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_speculative_decoding_under_tensor_parallelism(checkpoint, kv):
    """N-gram speculation at TP = 2 (and on an 8-bit pool): the tokens of the same run on one
    device, greedy ones equal to the run without speculation."""
    want = one_device(checkpoint, f"ngram-{kv}", speculative_config=NGRAM, kv_cache_dtype=kv)
    plain = one_device(checkpoint, f"plain-{kv}", kv_cache_dtype=kv)
    assert want["greedy"] == plain["greedy"] and want["again"] == plain["again"]
    llm = LLM(checkpoint, tensor_parallel_size=2,
              **llm_kwargs(speculative_config=NGRAM, kv_cache_dtype=kv))
    got = workload(llm, beams=False)
    assert got == want
    assert llm.llm_engine.metrics.spec_decode_num_draft_tokens > 0
    assert_no_leaks(llm)


@pytest.mark.slow
def test_draft_model_under_tensor_parallelism(checkpoint):
    """The draft-model method at TP = 2, the checkpoint drafting for itself (its own pool
    split by heads too): the tokens of the same run on one device, greedy ones equal to the
    run without speculation; n = 3 forks copy blocks in both pools."""
    draft = {"method": "draft_model", "model": checkpoint, "num_speculative_tokens": 3}
    want = one_device(checkpoint, "draft", speculative_config=draft)
    plain = one_device(checkpoint, "plain-auto", kv_cache_dtype="auto")
    assert want["greedy"] == plain["greedy"] and want["again"] == plain["again"]
    llm = LLM(checkpoint, tensor_parallel_size=2, **llm_kwargs(speculative_config=draft))
    got = workload(llm, beams=False)
    assert got == want
    assert llm.llm_engine.metrics.spec_decode_num_accepted_tokens > 0
    pool = llm.llm_engine.proposer.runner.kv_pool
    assert pool.k[0].addressable_shards[0].data.shape[2] == pool.k[0].shape[2] // 2
    assert_no_leaks(llm)


SMALL_POOL = dict(num_gpu_blocks_override=18, swap_space=0.001)


@pytest.mark.slow
def test_tensor_parallel_under_recompute_preemption(checkpoint):
    """A pool too small for the batch: preempted sequences are recomputed, on 2 devices, and
    end with the tokens of one device and a pool large enough for all."""
    llm = LLM(checkpoint, tensor_parallel_size=2, **llm_kwargs(preemption_mode="recompute", **SMALL_POOL))
    got = workload(llm, beams=False)
    assert llm.metrics.summary()["preemptions"] > 0
    assert _tokens(got) == _tokens(one_device(checkpoint))
    assert_no_leaks(llm)


@pytest.mark.slow
def test_tensor_parallel_under_swap_preemption_8bit_pool(checkpoint):
    """Preemption by swapping an int8 pool (pages and their scales) to the host and back,
    each device moving its own heads, on 4 devices: the tokens of the same run on one."""
    small = dict(preemption_mode="swap", kv_cache_dtype="int8", **SMALL_POOL)
    want = one_device(checkpoint, "swap-int8", **small)
    llm = LLM(checkpoint, tensor_parallel_size=4, **llm_kwargs(**small))
    got = workload(llm, beams=False)
    assert llm.metrics.summary()["preemptions"] > 0
    assert llm.llm_engine.runner.kv_pool.k_scale[0].sharding.spec[2] == "tp"
    assert got == want
    assert_no_leaks(llm)


@pytest.mark.slow
def test_pallas_kernels_run_per_device(checkpoint):
    """The Pallas kernels (interpret mode) under shard_map, prefill and decode, on 2 devices,
    give the tokens of the reference attention on one device."""
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm = LLM(checkpoint, tensor_parallel_size=2, attention_backend="pallas", **llm_kwargs())
    got = [o.outputs[0].token_ids for o in llm.generate(prompts()[:2], sp, use_tqdm=False)]
    assert got == [t[:3] for t in one_device(checkpoint)["greedy"][:2]]


def test_one_all_reduce_after_each_row_parallel_matmul(checkpoint):
    """The compiled TP step all-reduces the hidden state after the embedding, o_proj and
    down_proj (1 + 2 per layer) and all-gathers no weight."""
    from paxkv.model.batch import StepBatch
    from paxkv.model.forward import forward
    from paxkv.parallel import loading, sharding
    from paxkv.parallel.mesh import make_mesh
    mesh = make_mesh(4)
    params, cfg = loading.load_checkpoint(checkpoint, mesh, "float32")
    pool = sharding.init_pool(cfg, 8, 4, np.float32, mesh)
    t = 3
    batch = StepBatch(*(np.zeros(s, np.int32) for s in ((t,), (t,), (t,), (t, 2), (t,), (t + 1,), (t,))))
    hlo = jax.jit(forward, static_argnames=("cfg", "mesh")).lower(
        params, batch, pool, cfg, mesh=mesh).compile().as_text()
    ops = [line.split("=", 1)[1] for line in hlo.splitlines() if " = " in line]
    reduces = [op for op in ops if " all-reduce(" in op]
    assert len(reduces) == 1 + 2 * cfg.num_layers
    assert all(op.strip().startswith(f"f32[{t},{cfg.hidden_size}]") for op in reduces)
    weight_elems = cfg.hidden_size * cfg.intermediate_size // 4
    for op in ops:
        if " all-gather(" in op:
            shape = op.strip().split("]")[0].split("[")[1]
            assert np.prod([int(d) for d in shape.split(",") if d]) < weight_elems, op


def test_sharded_load_places_each_shard(checkpoint, monkeypatch):
    """Loading a multi-file checkpoint onto 4 devices: every parameter has its planned
    sharding, every device holds only its shard, the values are the checkpoint's, and no
    read of a split tensor takes more than one shard's part of it from the file."""
    from jax.sharding import PartitionSpec as P

    from paxkv.model.fusion import group_projections
    from paxkv.model.weights import load_checkpoint
    from paxkv.parallel import loading
    from paxkv.parallel.mesh import make_mesh
    reads = []
    read_slice = loading.read_slice

    def recording(index, name, rows, cols=None):
        out = read_slice(index, name, rows, cols)
        reads.append((name, out.size, int(np.prod(index.info(name)[1]["shape"]))))
        return out
    monkeypatch.setattr(loading, "read_slice", recording)
    mesh = make_mesh(4)
    params, cfg = loading.load_checkpoint(checkpoint, mesh, "float32")
    split = [(n, size, full) for n, size, full in reads if "norm" not in n]
    assert len(split) == 4 * (7 * cfg.num_layers + 2)   # 4 shards of q k v o gate up down, embedding, head
    assert all(size * 4 <= full for _, size, full in split), max(split, key=lambda r: r[1] / r[2])
    assert len([f for f in os.listdir(checkpoint) if f.endswith(".safetensors")]) > 1
    want = group_projections(load_checkpoint(checkpoint, "float32")[0], cfg)
    plan = {"qkv_proj": P(None, "tp", None), "gate_up_proj": P(None, "tp", None),
            "o_proj": P("tp", None), "down_proj": P("tp", None), "embed_tokens": P("tp", None),
            "lm_head": P(None, "tp")}
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    assert len(flat) == len(jax.tree.leaves(want))
    for (path, x), w in zip(flat, jax.tree.leaves(want)):
        keys = [str(getattr(p, "key", p)) for p in path]
        spec = plan.get(keys[-2], P())
        assert x.sharding.spec == spec, keys
        split = [d for d, s in enumerate(spec) if s == "tp"]
        for shard in x.addressable_shards:
            expected = tuple(n // 4 if d in split else n for d, n in enumerate(x.shape))
            assert shard.data.shape == expected, keys
        np.testing.assert_array_equal(np.asarray(x), np.asarray(w), err_msg="/".join(keys))


def test_random_params_built_sharded_equal_one_device():
    from jax.sharding import PartitionSpec as P

    from paxkv.config import get_preset
    from paxkv.model.fusion import group_projections
    from paxkv.model.weights import random_params
    from paxkv.parallel import loading
    from paxkv.parallel.mesh import make_mesh
    cfg = dataclasses.replace(get_preset("tiny-random"), num_layers=1)
    mesh = make_mesh(2)
    got = loading.random_params(cfg, mesh, jax.random.PRNGKey(3), "float32")
    want = group_projections(random_params(cfg, jax.random.PRNGKey(3), "float32"), cfg)
    assert got["layers_0"]["mlp"]["gate_up_proj"]["kernel"].sharding.spec == P(None, "tp", None)
    for x, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(w))


@pytest.mark.parametrize("tp,message", [(3, "must divide the model's num_kv_heads"),
                                        (16, "exceeds the 8 devices"),
                                        (0, "must be a positive integer")])
def test_bad_tensor_parallel_size(checkpoint, tp, message):
    with pytest.raises(ValueError, match=f"tensor_parallel_size.*{message}"):
        LLM(checkpoint, tensor_parallel_size=tp, **llm_kwargs())


@pytest.mark.slow
def test_two_processes_equal_one(checkpoint, tmp_path):
    """Two processes on localhost (gloo CPU collectives), two devices each, TP = 4 across
    them: process 0 schedules, process 1 replays its steps; two engines in turn, the second
    swapping under preemption; the tokens are one process's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(tests), tests]),
               JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    out = tmp_path / "tokens.json"
    procs = [subprocess.Popen([sys.executable, os.path.join(tests, "tp_multihost_main.py"), checkpoint,
                               f"127.0.0.1:{port}", str(rank), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in (0, 1)]
    logs = [p.communicate(timeout=600)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    got = json.loads(out.read_text())
    want = one_device(checkpoint, "default")
    assert got["greedy"] == want["greedy"] and got["sampled"] == want["sampled"]
    assert got["swapped"] == want["greedy"] and got["preemptions"] > 0


def test_distributed_arguments_are_checked_and_mapped():
    from paxkv.parallel.multihost import DistributedConfig, llm_kwargs
    with pytest.raises(ValueError, match="distributed_process_id"):
        DistributedConfig("127.0.0.1:1234", 2, 2).check()
    with pytest.raises(ValueError, match="distributed_coordinator_address"):
        DistributedConfig("localhost", 2, 0).check()
    with pytest.raises(ValueError, match="distributed_num_processes"):
        DistributedConfig("127.0.0.1:1234", 0, 0).check()
    assert llm_kwargs("10.0.0.1:1234", 2, 1, 16) == {
        "tensor_parallel_size": 16, "distributed_coordinator_address": "10.0.0.1:1234",
        "distributed_num_processes": 2, "distributed_process_id": 1}
    assert llm_kwargs() == {}


def test_capacity_plan_counts_one_device():
    """N devices: each holds 1/N of the split weights and of every token's KV."""
    from paxkv.sim.capacity import GiB, plan_capacity
    from paxkv.config import get_preset
    cfg = get_preset("llama3-70b")
    one = plan_capacity(140 * GiB, cfg, 2.0, 2.0, 16)
    four = plan_capacity(140 * GiB, cfg, 2.0, 2.0, 16, tensor_parallel_size=4)
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size * 2
    assert four.weights_bytes == pytest.approx((one.weights_bytes - norms) / 4 + norms, abs=1)
    assert four.kv_bytes_per_token == one.kv_bytes_per_token / 4
    assert four.tokens == int((140 * GiB - four.weights_bytes) // four.kv_bytes_per_token)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        plan_capacity(140 * GiB, cfg, 2.0, 2.0, 16, tensor_parallel_size=3)

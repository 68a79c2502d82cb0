"""The engine with the Pallas backend (interpret mode on CPU) equals the reference backend."""
from __future__ import annotations

import pytest

from paxkv import LLM, SamplingParams


@pytest.mark.slow
def test_pallas_backend_engine_outputs_equal_reference():
    prompts = ["It is a truth universally acknowledged", "Emma", "The morning was fine and the"]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = {}
    for backend in ("reference", "pallas"):
        llm = LLM("tiny", dtype="float32", attention_backend=backend, num_gpu_blocks_override=64,
                  max_model_len=128, max_num_seqs=4, max_num_batched_tokens=8, block_size=8)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert llm.metrics.summary()["decode_tokens"] > 0
    assert outs["pallas"] == outs["reference"]

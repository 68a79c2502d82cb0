"""Multi-step decoding (several decode steps per host round trip) changes no output."""
from __future__ import annotations

import numpy as np
import pytest

from paxkv import LLM, SamplingParams

PROMPTS = ["It is a truth universally acknowledged", "Emma Woodhouse, handsome,", "The morning",
           "Mr. Darcy", "She had", "In the drawing-room"]


@pytest.mark.slow
def test_multi_step_equals_single_step():
    rng = np.random.default_rng(0)
    params = []
    for i in range(len(PROMPTS)):
        params.append(SamplingParams(temperature=float(rng.choice([0.0, 0.8])), top_p=0.9, seed=i,
                                     max_tokens=int(rng.integers(3, 40)),
                                     ignore_eos=bool(i % 2), n=2 if i == 3 else 1))
    params[2] = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[11])
    results = {}
    for k in (1, 4, 7):
        llm = LLM("tiny", dtype="float32", num_gpu_blocks_override=96, block_size=8, max_model_len=256,
                  max_num_seqs=4, max_num_batched_tokens=32, num_scheduler_steps=k)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        results[k] = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]
        bm = llm.llm_engine.block_manager
        assert bm.num_used_blocks == 0
        bm.check_invariants()
        if k > 1:
            steps = llm.metrics.steps
            assert any(s.num_decode_tokens > s.num_seqs_scheduled for s in steps), "no multi-step ran"
    assert results[4] == results[1]
    assert results[7] == results[1]

"""One process of the two-process tensor-parallel test: `python tp_multihost_main.py
CHECKPOINT COORDINATOR RANK OUT_JSON`. Both processes run this; on process 1 the LLM
constructor serves process 0's engines and ends the process when process 0 exits. Process 0 builds
two engines in turn (the second one closes the first) and writes the tokens."""
from __future__ import annotations

import json
import sys


def main(checkpoint: str, coordinator: str, rank: int, out: str) -> None:
    from paxkv import LLM, SamplingParams
    from tp_helpers import MAX_TOKENS, llm_kwargs, prompts
    distributed = dict(distributed_coordinator_address=coordinator, distributed_num_processes=2,
                       distributed_process_id=rank)
    llm = LLM(checkpoint, tensor_parallel_size=4, **distributed, **llm_kwargs())
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts(), greedy, use_tqdm=False)
    llm = LLM(checkpoint, tensor_parallel_size=4, **distributed,
              **llm_kwargs(preemption_mode="swap", num_gpu_blocks_override=18, swap_space=0.001))
    sampled = llm.generate(prompts()[1], SamplingParams(n=3, max_tokens=8, temperature=0.9,
                                                        seed=5, ignore_eos=True), use_tqdm=False)
    swapped = llm.generate(prompts(), greedy, use_tqdm=False)
    with open(out, "w") as f:
        json.dump({"greedy": [o.outputs[0].token_ids for o in first],
                   "sampled": [c.token_ids for c in sampled[0].outputs],
                   "swapped": [o.outputs[0].token_ids for o in swapped],
                   "preemptions": llm.metrics.summary()["preemptions"]}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])

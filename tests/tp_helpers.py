"""The tensor-parallel tests' model and workload, shared by the tests and the two-process run.

An 8-KV-head checkpoint (16 query heads: GQA), small enough that eight CPU devices compile
and run it in seconds. Prompt lengths end mid-block (block size 4).
"""
from __future__ import annotations

from typing import Any

TP_CONFIG = dict(num_attention_heads=16, num_key_value_heads=8, head_dim=16, hidden_size=64,
                 intermediate_size=128)
BLOCK_SIZE = 4
PROMPT_LENS = (5, 19, 33, 7)
MAX_TOKENS = 8


def prompts(offset: int = 0) -> list[list[int]]:
    """Fixed prompts (ids 3..383), the first two sharing their first 16 tokens."""
    out = []
    for i, n in enumerate(PROMPT_LENS):
        start = 3 if i < 2 else 40 * i + offset
        out.append([(start + 7 * j) % 380 + 3 for j in range(n)])
    return out


def llm_kwargs(**overrides: Any) -> dict[str, Any]:
    # No persistent compilation cache: LLM keeps it off for sharded CPU programs, and this
    # keeps the one-device reference of the comparison off it as well (see compile_cache).
    kw = dict(dtype="float32", tokenizer=None, block_size=BLOCK_SIZE, num_gpu_blocks_override=64,
              max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
              compilation_cache_dir=None)
    kw.update(overrides)
    return kw


def workload(llm: Any, beams: bool = True) -> dict[str, Any]:
    """Greedy prompts, then the same again (prefix-cache hits), n=3 seeded samples (forks
    sharing the prompt's blocks copy-on-write) and a beam search: every output token."""
    from paxkv import BeamSearchParams, SamplingParams
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts(), greedy, use_tqdm=False)
    again = llm.generate(prompts(), greedy, use_tqdm=False)
    sampled = llm.generate(prompts()[1], SamplingParams(n=3, max_tokens=8, temperature=0.9, seed=5,
                                                        ignore_eos=True), use_tqdm=False)
    out = {"greedy": [o.outputs[0].token_ids for o in first],
           "again": [o.outputs[0].token_ids for o in again],
           "cached": [o.num_cached_tokens for o in again],
           "sampled": [c.token_ids for c in sampled[0].outputs]}
    if beams:
        beam = llm.beam_search([prompts()[0], prompts()[3]],
                               BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
        out["beams"] = [[s.tokens for s in b.sequences] for b in beam]
    return out

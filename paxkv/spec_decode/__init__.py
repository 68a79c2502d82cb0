"""Speculative decoding: propose a few tokens cheaply, verify them with one forward of the
target model, keep the longest prefix the target agrees with, exactly in distribution.

- `config.py`: `speculative_config`, vLLM's keys, checked (host).
- `ngram.py`: the "ngram" proposer, prompt lookup over the sequence's own tokens (host).
- `proposers.py`: the proposers behind one interface: n-gram, a draft model (its own runner
  and pool), EAGLE (per-sequence windows of the target's features) (host).
- `eagle.py`: the EAGLE-1 head, its loss, its offline drafting function and its file
  (device); `eagle_drafter.py`: the engine's batched drafting with it (device).
- `rejection.py`: the verify step's sampler: rejection sampling (Leviathan et al., 2023;
  Chen et al., 2023) over the target's processed distribution, so the emitted tokens follow
  it exactly; greedy rows keep the drafts that equal the target's argmax (device, pure JAX).

The engine runs them (`LLMEngine._propose`, `_dispatch_verify`, `_apply_verify`; the step
program `runner._verify_fn`): docs/speculative_decoding.md.
"""

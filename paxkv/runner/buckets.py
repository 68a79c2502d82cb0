"""Shape buckets: every jitted step sees one of a few padded sizes, so steady state compiles
nothing. The buckets themselves are derived with the runner's settings (`config.runner_config`)."""
from __future__ import annotations

from typing import Sequence

# On fixed shapes a prefill or mixed step samples at least this many rows (fewer when its
# token bucket or the sequence bucket is smaller), so that a token bucket is one program rather
# than one per row bucket: the Llama-3-8B server's 98 step programs become 26, and a burst of
# requests, whose first steps prefill any number of prompts, finds them compiled. Padding rows
# costs little there: the LM head already runs on every sequence slot of such a step.
MIXED_STEP_MIN_ROWS = 256


def mixed_step_row_floor(num_tokens: int, max_seqs: int) -> int:
    """The fewest rows a prefill or mixed step of `num_tokens` (a token bucket) samples when
    its sequences are padded to `max_seqs` (fixed shapes)."""
    return min(num_tokens, max_seqs, MIXED_STEP_MIN_ROWS)


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")

"""Shape buckets: every jitted step sees one of a few padded sizes, so steady state compiles
nothing. The buckets themselves are derived with the runner's settings (`config.runner_config`)."""
from __future__ import annotations

from typing import Sequence


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")

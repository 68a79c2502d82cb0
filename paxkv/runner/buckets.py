"""Shape buckets: every jitted step sees one of a few padded sizes, so steady state compiles nothing."""
from __future__ import annotations

from typing import Sequence


def pow2_buckets(lo: int, hi: int) -> list[int]:
    """Powers of two from lo up to (and including) hi, hi itself as the last bucket."""
    out, b = [], max(1, lo)
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return out


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")

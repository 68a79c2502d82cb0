"""The "ngram" proposer (prompt lookup decoding): when the sequence's last n tokens occurred
before, propose the tokens that followed them then. It costs no model and pays where the
output repeats its context (code edits, extraction, quoting). Host-only (numpy).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, n_min: int = 1,
                  n_max: int = 4) -> list[int]:
    """Up to `k` draft tokens for the sequence `tokens` (prompt and output so far).

    Tries suffix lengths n from `n_max` down to `n_min`: the first n whose last n tokens
    occur earlier in `tokens` wins, and its most recent earlier occurrence gives the draft,
    the (up to) k tokens that followed it. No match: no draft (an ordinary step).
    """
    ids = np.asarray(tokens, dtype=np.int64)
    length = ids.shape[0]
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = ids[length - n:]
        # windows starting at 0 .. length - n - 1: every occurrence but the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(ids[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start:start + k].tolist()
    return []

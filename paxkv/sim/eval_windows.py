"""Held-out evaluation windows for a token stream: the tiny model's perplexity protocol.

Training reports it (scripts/train_tiny.py, results/tiny_model.md) and the KV-quantization
study measures against it (experiments/kv_quant_accuracy.py); both cut the stream the same
way so their perplexities compare.
"""
from __future__ import annotations

import numpy as np


def eval_windows(stream: np.ndarray, bos: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping windows: each is `bos` + `seq_len` stream tokens; every stream token is
    predicted exactly once. Returns (windows `[N, seq_len + 1]`, target mask `[N, seq_len]`)."""
    n = -(-stream.size // seq_len)
    padded = np.zeros(n * seq_len, np.int32)
    padded[:stream.size] = stream
    mask = np.zeros(n * seq_len, np.float32)
    mask[:stream.size] = 1.0
    windows = np.concatenate([np.full((n, 1), bos, np.int32), padded.reshape(n, seq_len)], axis=1)
    return windows, mask.reshape(n, seq_len)

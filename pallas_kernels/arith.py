"""Integer arithmetic the kernels and the engine's host code share (plain Python: host code
imports it without JAX)."""
from __future__ import annotations


def cdiv(a, b):
    """Ceiling division of non-negative `a` by positive `b`: Python ints, numpy or traced
    JAX integers alike."""
    return (a + b - 1) // b

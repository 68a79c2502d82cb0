"""Which parametrized cases run in the quick subset (`pytest -m "not slow"`).

The quick subset keeps the first cases of a list (the ones that cover the idea) and marks the
other shapes `slow`; the full suite runs them all.
"""
import pytest


def first_quick(cases: list, n: int = 1) -> list:
    """The first `n` cases as they are, the rest marked slow. A tuple is one case of several
    arguments (as in a multi-name `parametrize`); give single values that are sequences as lists."""
    def slow(case):
        values = case if isinstance(case, tuple) else (case,)
        return pytest.param(*values, marks=pytest.mark.slow)
    return list(cases[:n]) + [slow(c) for c in cases[n:]]

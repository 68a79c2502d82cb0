"""Field checks that need nothing but the value: each names the field it refuses.

Wrong types raise TypeError, wrong values ValueError; nothing is coerced silently (a float
seed or a float token id is refused, not truncated, and `True` is not the integer 1).
`SamplingParams` runs them at construction; the engine's `RequestValidator`
(`engine/validation.py`) adds the checks that need the engine. Host-only: no JAX.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, Mapping


def type_name(value: Any) -> str:
    return type(value).__name__


def is_int(value: Any) -> bool:
    """A Python or numpy integer, and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: Any, *, low: int | None = None, high: int | None = None,
              optional: bool = False) -> int | None:
    """`value` as an int in [low, high]; bools, floats and strings are refused."""
    if value is None and optional:
        return None
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type_name(value)} {value!r}")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value


def check_float(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False, optional: bool = False) -> float | None:
    """`value` as a finite float in the given range (NaN and inf are refused)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type_name(value)} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type_name(value)} {value!r}")
    return value


def check_int_list(name: str, value: Any, *, optional: bool = True, non_empty: bool = False,
                   low: int | None = 0) -> list[int] | None:
    """A list (or tuple, or array) of ints, each >= `low`."""
    if value is None and optional:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list of ints, got {type_name(value)}")
    out = []
    for i, v in enumerate(value):
        out.append(check_int(f"{name}[{i}]", v, low=low))
    if non_empty and not out:
        raise ValueError(f"{name} must not be empty")
    return out


def check_str_list(name: str, value: Any, *, allow_single: bool = True) -> list[str]:
    """None -> []; a string -> [it] (when `allow_single`); a list of non-empty strings."""
    if value is None:
        return []
    if isinstance(value, str) and allow_single:
        value = [value]
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list of strings, got {type_name(value)}")
    out = list(value)
    for i, s in enumerate(out):
        if not isinstance(s, str):
            raise TypeError(f"{name}[{i}] must be a string, got {type_name(s)}")
        if not s:
            raise ValueError(f"{name}[{i}] must be a non-empty string")
    return out


def check_token_ids_in_vocab(name: str, ids: Iterable[int], vocab_size: int) -> None:
    for t in ids:
        if not 0 <= t < vocab_size:
            raise ValueError(f"{name} holds token id {t}, outside the vocabulary [0, {vocab_size})")

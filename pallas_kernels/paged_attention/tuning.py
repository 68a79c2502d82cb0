"""Which decode / prefill kernel runs a shape when `backend="auto"`: measured winners, kept as
data.

Each row says: for pages of these dtypes, at batch and context (tokens per sequence, the
block table's width) within these ranges, this backend was measured faster than the other
at the default tuning (results/kernels.md, results/kv_quant.md). A shape no row covers runs
the Triton kernel: it handles every page dtype and layout, and it is the one the tests have
run the longest. Rows are tried in order; the first match wins.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

BACKENDS = ("triton", "mosaic", "auto")


@dataclasses.dataclass(frozen=True)
class Winner:
    """`backend` wins for `page_dtypes` at batch in [min_batch, max_batch] and context in
    [min_context, max_context] (inclusive)."""
    backend: str
    page_dtypes: tuple[str, ...]
    min_batch: int = 1
    max_batch: int = 1 << 30
    min_context: int = 1
    max_context: int = 1 << 30

    def matches(self, page_dtype: str, batch: int, context: int) -> bool:
        return (page_dtype in self.page_dtypes and self.min_batch <= batch <= self.max_batch
                and self.min_context <= context <= self.max_context)


# Measured on an NVIDIA H200 (results/kernels.md, "Decode backends"): the Mosaic GPU kernel
# took 1.02-1.34x the Triton kernel's time at every bf16 shape measured (batch 32-256,
# context 1024-2048), and it has no 8-bit path, so no shape picks it yet.
DECODE_WINNERS: tuple[Winner, ...] = ()


# Dot operand dtype of the Triton decode kernel for 8-bit pages under a bf16 / fp16 query.
# fp8 codes convert to float16 in one instruction per pair on Hopper (to bfloat16 only through
# float32): measured 0.95-1.04x the bf16-page time against 1.24-1.30x with bf16 dots
# (results/kv_quant.md, "Decode backends"). int8 stays on bf16: float16 was 3-10% slower at
# batch <= 64 and 3% faster above.
DOT_DTYPES = {"float8_e4m3fn": "float16", "float8_e5m2": "float16"}


def default_dot_dtype(page_dtype, q_dtype) -> str | None:
    """The dot dtype for these pages and query (None: the query's own dtype)."""
    if jnp.dtype(q_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return None                          # float32 queries keep exact float32 products
    return DOT_DTYPES.get(jnp.dtype(page_dtype).name)


# The ragged prefill kernels (`ragged_paged_attention`), rows as above with batch = sequences
# and context = the block table's width in tokens. Measured on an NVIDIA H200 (results/kernels.md,
# "Prefill: the Mosaic GPU kernel"): on 8 x 2048 causal prompts the Mosaic GPU kernel took
# 1.60x the Triton kernel's time at its default tuning (2.03x cuDNN dense, Triton 1.27x), so no
# shape picks it.
PREFILL_WINNERS: tuple[Winner, ...] = ()


def decode_backend(page_dtype, batch: int, context: int,
                   table: tuple[Winner, ...] = DECODE_WINNERS) -> str:
    """The backend `auto` picks for decode over pages of `page_dtype`."""
    name = jnp.dtype(page_dtype).name
    for row in table:
        if row.matches(name, batch, context):
            return row.backend
    return "triton"


def prefill_backend(page_dtype, num_seqs: int, context: int,
                    table: tuple[Winner, ...] = PREFILL_WINNERS) -> str:
    """The backend `auto` picks for a ragged prefill batch over pages of `page_dtype`."""
    return decode_backend(page_dtype, num_seqs, context, table)


def resolve_backend(backend: str, interpret: bool, measured: Callable[[], str],
                    why_not_mosaic: Callable[[], str]) -> str:
    """"triton" or "mosaic" for a kernel call: "auto" takes the `measured` winner (Triton in
    interpret mode, and where the Mosaic GPU kernel cannot take the inputs); an explicit
    "mosaic" it cannot take is a ValueError giving `why_not_mosaic()`'s reason. Both are
    called only when needed, and each at most once."""
    if backend == "auto":
        if interpret or measured() != "mosaic":
            return "triton"
        return "triton" if why_not_mosaic() else "mosaic"
    if backend == "mosaic":
        why = why_not_mosaic()
        if why:
            raise ValueError(f"backend='mosaic': {why}")
    return backend

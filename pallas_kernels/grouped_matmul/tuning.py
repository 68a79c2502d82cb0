"""Which grouped matmul runs a MoE projection: measured winners, kept as data.

`jax.lax.ragged_dot` reads every expert's weights whatever the routing chose; the Pallas
kernel reads only the experts that own rows, but its tiles are plain Triton dots. Each row
below says: for this many sorted rows (tokens x experts per token), this tile shape of the
Pallas kernel was measured faster than `ragged_dot` (scripts/bench_moe.py, results/moe.md).
Rows no entry covers run `ragged_dot`. The first match wins.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A tile shape and pipeline of the Pallas kernel (`grouped_matmul`'s keyword arguments)."""
    block_m: int = 16
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Winner:
    """`tiles` beat ragged_dot for `min_rows <= rows <= max_rows` (inclusive)."""
    tiles: Tiles
    min_rows: int = 1
    max_rows: int = 1 << 30


# Filled from measurements on the GPU (none yet: every shape runs ragged_dot).
WINNERS: tuple[Winner, ...] = ()


def pick(rows: int, winners: tuple[Winner, ...] = WINNERS) -> Tiles | None:
    """The measured winner's tiles for `rows` sorted rows, or None (ragged_dot)."""
    for w in winners:
        if w.min_rows <= rows <= w.max_rows:
            return w.tiles
    return None


# What scripts/bench_moe.py sweeps: small tiles that stream the weights at few rows per
# expert, larger ones for the compute-bound end.
CANDIDATES: tuple[Tiles, ...] = (
    Tiles(16, 64, 128, 4, 4), Tiles(16, 128, 64, 4, 4), Tiles(16, 128, 128, 4, 3),
    Tiles(16, 64, 256, 4, 3), Tiles(32, 128, 64, 4, 4), Tiles(64, 128, 64, 4, 4),
    Tiles(64, 128, 64, 8, 3), Tiles(128, 128, 64, 8, 3), Tiles(128, 128, 32, 4, 4),
    Tiles(128, 256, 64, 8, 3), Tiles(64, 256, 64, 8, 4),
)

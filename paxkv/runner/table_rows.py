"""The padded block-table array of a step, rewritten only where a table changed.

A sequence's block table grows by one block every `block_size` tokens, so between two decode
steps of a steady batch almost every row is the same as before. Writing 256 Python lists of
~40 ids into numpy each step cost more than the rest of the runner's packing together
(`results/host_profile.md`); comparing each list with the one a row was last filled from
is a pointer walk in C, and only the rows that differ are written again (a grown table: only
its new ids).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class TableRows:
    """One shape's block-table array and, per row, the ids it holds (as a list copy)."""

    def __init__(self, num_rows: int, width: int) -> None:
        self.array = np.zeros((num_rows, width), np.int32)
        self.rows: list[list[int]] = [[] for _ in range(num_rows)]

    def fill(self, tables: Sequence[Sequence[int]]) -> np.ndarray:
        """The `[num_rows, width]` array of `tables`, zero-padded; a new array each call."""
        array, rows = self.array, self.rows
        for i, table in enumerate(tables):
            if rows[i] != table:       # a copy: the block manager grows its lists in place
                self._write(i, table)
        for i in range(len(tables), len(rows)):
            if rows[i]:
                self._write(i, ())
        return array.copy()

    def _write(self, i: int, table: Sequence[int]) -> None:
        old, n = self.rows[i], len(table)
        m = len(old)
        if m < n and table[:m] == old:    # it grew (the common change): write the new ids only
            self.array[i, m:n] = table[m:]
            old.extend(table[m:])
            return
        self.array[i, :n] = table
        self.array[i, n:m] = 0
        self.rows[i] = list(table)

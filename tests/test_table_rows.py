"""The runner's block-table array, rewritten only where a table changed (runner/table_rows.py)."""
import numpy as np

from paxkv.runner.table_rows import TableRows


def _naive(tables, num_rows, width):
    out = np.zeros((num_rows, width), np.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


def test_fill_matches_a_fresh_array_as_tables_grow_shrink_change_in_place_and_leave():
    rng = np.random.default_rng(0)
    num_rows, width = 8, 6
    rows = TableRows(num_rows, width)
    tables = [list(rng.integers(1, 100, size=rng.integers(0, width + 1))) for _ in range(num_rows)]
    for _ in range(300):
        for t in tables:                 # mutate the lists in place, as the block manager does
            op = rng.integers(0, 5)
            if op == 0 and len(t) < width:
                t.append(int(rng.integers(1, 100)))
            elif op == 1 and t:
                t[int(rng.integers(0, len(t)))] = int(rng.integers(1, 100))   # copy-on-write
            elif op == 2:
                t.clear()                                                     # freed
        used = tables[:rng.integers(0, num_rows + 1)]                         # batch shrinks
        got = rows.fill(used)
        np.testing.assert_array_equal(got, _naive(used, num_rows, width))


def test_fill_returns_an_array_the_next_fill_does_not_change():
    rows = TableRows(2, 3)
    table = [5, 6]
    first = rows.fill([table])
    table.append(7)
    second = rows.fill([table])
    np.testing.assert_array_equal(first, [[5, 6, 0], [0, 0, 0]])
    np.testing.assert_array_equal(second, [[5, 6, 7], [0, 0, 0]])

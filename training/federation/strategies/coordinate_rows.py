"""Each coordinate's N values laid side by side, and the order statistics of such rows: what the coordinate-wise
robust rules (``strategies.robust``: median, trimmed mean) do with a block of coordinates read from N deltas."""

from __future__ import annotations

import math

import numpy as np
import torch

# Tiles of a transposition: at most 20 deltas (split evenly) by 1,024 coordinates, read and written while both
# stay in the CPU's cache. One strided copy of a whole block took three times as long at N = 1,000, and a third
# of median's time at 100 x 1M; tiles of 20 rows took 15% less time than tiles of 100 at N = 100 and N = 1,000
# (bench/README.md, "aggregation.py").
TILE_ROWS, TILE_COLUMNS = 20, 1024


def transpose_into(out: torch.Tensor, values: torch.Tensor) -> None:
    """``out[:] = values.T`` (``values`` [N, C], ``out`` [C, N]), tile by tile; the same values."""
    n, c = values.shape
    tall = math.ceil(n / math.ceil(n / TILE_ROWS)) if n else 1  # rows per tile, the tiles as even as can be
    for row in range(0, n, tall):
        for column in range(0, c, TILE_COLUMNS):
            out[column : column + TILE_COLUMNS, row : row + tall].copy_(
                values[row : row + tall, column : column + TILE_COLUMNS].T
            )


# Bytes of one part of a block laid side by side (``side_by_side``): small enough to stay in the CPU's cache
# between its transposition and its sort, where a whole block laid side by side went out to memory and was read
# back for the sort (median at 100 x 1M: 1.6 s to 0.8 s; bench/README.md, "aggregation.py").
SIDE_BY_SIDE_BYTES = 2 << 20


def side_by_side(n: int) -> int:
    """Coordinates of N deltas laid side by side and reduced at a time (at least 64)."""
    return max(64, SIDE_BY_SIDE_BYTES // (4 * max(1, n)))


# numpy sorts a row of float32 values for about 1 ns a value up to 512 values a row and for 4 to 5 ns a value
# from 513 on (its vectorized sort takes a short row in one sorting network; 1.14 at 512, 4.3 at 513, 5.4 at 1,000
# on a 2-core AMD EPYC host, the same with numpy 2.2 to 2.4, ``partition`` no faster). A longer row is sorted as
# two halves and the order statistics a rule needs are read across them (``SortedHalves``): 1.7 ns a value at
# N = 1,000 for the median, 3.1 for the trimmed mean (bench/README.md as of 9a8d7eb, "Measured: the rows sorted
# in halves").
SORTED_RUN = 512


class SortedHalves:
    """Each row of ``rows`` (float32 [m, N], finite values) sorted in place as two halves: ``first``, its first
    ceil(N / 2) values, and ``second``, the rest; the row's order statistics are read across the two."""

    def __init__(self, rows: np.ndarray):
        self.n = rows.shape[1]
        self.a = (self.n + 1) // 2
        self.first, self.second = rows[:, : self.a], rows[:, self.a :]
        self.first.sort(axis=1)
        self.second.sort(axis=1)
        self.index = np.arange(rows.shape[0])

    def split(self, k: int) -> np.ndarray:
        """Per row, the least i such that ``first[:i]`` and ``second[:k - i]`` together are k smallest values of
        the row (0 <= k <= N): a binary search, every row at once. Never less for a larger k."""
        lo = np.full(len(self.index), max(0, k - (self.n - self.a)), dtype=np.intp)
        hi = np.full(len(self.index), min(k, self.a), dtype=np.intp)
        while (searching := lo < hi).any():
            mid = (lo + hi) >> 1
            # Where lo <= mid < hi, first[mid] and second[k - mid - 1] are values of the row (clipped elsewhere):
            # taking mid from first is enough when second's last taken value is no larger than first's next.
            enough = (
                self.second[self.index, np.maximum(k - mid - 1, 0)]
                <= self.first[self.index, np.minimum(mid, self.a - 1)]
            )
            hi = np.where(searching & enough, mid, hi)
            lo = np.where(searching & ~enough, mid + 1, lo)
        return lo

    def around(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Per row, its k-th and (k + 1)-th smallest values (1 <= k < N): a sorted row's values at k - 1 and k."""
        taken = self.split(k)
        lower, upper = [], []
        for part, count in ((self.first, taken), (self.second, k - taken)):
            width = part.shape[1]
            lower.append(np.where(count > 0, part[self.index, np.maximum(count - 1, 0)], -np.inf))
            upper.append(np.where(count < width, part[self.index, np.minimum(count, width - 1)], np.inf))
        return np.maximum(*lower).astype(np.float32), np.minimum(*upper).astype(np.float32)

    def middle_sum(self, cut: int) -> np.ndarray:
        """Per row, the float64 sum of its values but its ``cut`` smallest and ``cut`` largest (2 cut < N). Each
        half's kept values are a run of it; the columns no run can leave out (``cut`` in from either end) are
        summed whole, the ends by a mask, so a huge value cut away never enters the sum."""
        low, high = self.split(cut), self.split(self.n - cut)
        total = np.zeros(len(self.index), dtype=np.float64)
        for part, start, stop in ((self.first, low, high), (self.second, cut - low, self.n - cut - high)):
            width = part.shape[1]
            inner = min(cut, width)  # the columns [inner, outer) are kept in every row
            outer = max(inner, width - cut)
            total += part[:, inner:outer].sum(axis=1, dtype=np.float64)
            for first, last in ((0, inner), (outer, width)):
                columns = np.arange(first, last)
                kept = (columns >= start[:, None]) & (columns < stop[:, None])
                total += np.where(kept, part[:, first:last], np.float32(0)).sum(axis=1, dtype=np.float64)
        return total


def sorted_in_halves(rows: np.ndarray) -> SortedHalves | None:
    """``rows`` sorted as two halves (``SortedHalves``) when a row holds more than SORTED_RUN values, else None
    (and ``rows`` untouched): the caller sorts whole rows."""
    return SortedHalves(rows) if rows.shape[1] > SORTED_RUN else None

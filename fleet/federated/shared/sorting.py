"""Sorting every coordinate of a few devices' tensors at once, with a comparator network.

A trimmed mean sorts, per coordinate, the values the ``n`` senders of a tensor sent: millions of
columns of 8-32 values each. ``np.sort(axis=0)`` sorts each column on its own, a strided gather and a
small sort per column. A sorting network does the same as a fixed list of compare-exchanges of whole
rows, each one ``np.minimum``/``np.maximum`` over every column at once (vectorized, and free of the GIL).

Design notes:

* *Batcher's odd-even merge sort* (Knuth, TAOCP vol. 3, 5.3.4) sorts ``2^m`` rows with
  ``(m^2 - m + 4) 2^(m-2) - 1`` comparators: 63 for 16 rows. Other row counts take the network of the
  next power of two *pruned*: think of the missing rows as ``+inf``, the highest rows; a comparator
  that touches one never moves anything, so it is left out (12 rows: 42 comparators, not 63).
* *Two vector operations per comparator.* The smaller values go to a spare row and the row list is
  re-pointed, instead of being copied back: a third of the work saved.
* *Only the ends, for a trimmed mean* (:func:`trimmed_means`). The ``cut`` smallest of two sorted
  halves ``A`` and ``B`` are ``min(A[i], B[cut-1-i])`` for ``i < cut`` (the half-cleaner of the bitonic
  sequence ``A[:cut]``, reversed ``B[:cut]``); the ``max`` of the same pairs are middle values. So sorting
  two halves (38 comparators for 16 rows) and ``2 cut`` more operations give the middle, where a full
  sort takes 63 comparators. The middle's values are summed as they are, never as a total less the
  ends, so a huge value at one end cannot swamp the others in rounding.
* *Chunks.* The rows are swept in column blocks that fit in cache (:data:`CHUNK`), each copied into a
  small buffer: many passes over a block in cache rather than over the whole tensor in memory, and
  no ``n x size`` stack of a large tensor in memory at all.
* *Exact.* Compare-exchange only moves values, so the sorted rows are the values ``np.sort`` gives, and
  the middle is the same set of values (NaN aside: a reply holding one is rejected before it is
  aggregated).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

CHUNK = 1 << 15  # columns per block: 16 rows of float32 are 2 MB, within this machine's cache


@lru_cache(maxsize=16)
def merge_network(size: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort for ``size`` rows (a power of two): ``(i, j)`` pairs, ``i < j``,
    after which row ``i`` holds the smaller value of each column."""
    if size & (size - 1):
        raise ValueError(f"merge_network: {size} is not a power of two")
    pairs = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(pairs)


@lru_cache(maxsize=64)
def network_for(rows: int) -> tuple[tuple[int, int], ...]:
    """A sorting network for any number of rows: Batcher's for the next power of two, less the
    comparators that touch a row beyond ``rows`` (a ``+inf`` that never moves): 42 for 12 rows."""
    size = 1 << max(0, (rows - 1).bit_length())
    return tuple((i, j) for i, j in merge_network(size) if j < rows)


def sort_rows(rows: list[np.ndarray], spare: np.ndarray) -> np.ndarray:
    """Sort the equal-length ``rows`` per column in place of the list (ascending): the list is
    re-pointed, not the data copied back. ``spare``: a free row of the same shape; returns the one
    left free."""
    for i, j in network_for(len(rows)):
        low, high = rows[i], rows[j]
        np.minimum(low, high, out=spare)
        np.maximum(low, high, out=high)
        rows[i], spare = spare, low
    return spare


def _blocks(values: list[np.ndarray]):
    """Per column block: (its slice, its rows copied into a buffer, a spare row), the buffer reused."""
    flat = [v.reshape(-1) for v in values]
    size = flat[0].size
    buffer = np.empty((len(flat) + 1, min(CHUNK, size)), dtype=flat[0].dtype)
    for start in range(0, size, CHUNK):
        block = slice(start, min(start + CHUNK, size))
        width = block.stop - block.start
        rows = [buffer[i, :width] for i in range(len(flat) + 1)]
        for row, value in zip(rows, flat):
            np.copyto(row, value[block])
        yield block, rows[:-1], rows[-1]


def trimmed_means(values: list[np.ndarray], cut: int) -> np.ndarray:
    """Per coordinate, the float64 mean of ``values`` less their ``cut`` smallest and ``cut`` largest
    (``cut >= 1``, ``2 cut < n``), flat: the same values as the middle rows of ``np.sort(axis=0)``.
    Two sorted halves give the ends when each half is at least ``2 cut`` rows (a trim up to a quarter);
    a larger cut sorts every row."""
    n = len(values)
    out = np.empty(values[0].size, dtype=np.float64)
    for block, rows, spare in _blocks(values):
        total = np.zeros(block.stop - block.start, dtype=np.float64)
        for row in _middle(rows, spare, cut):
            np.add(total, row, out=total)
        out[block] = total / (n - 2 * cut)
    return out


def _middle(rows: list[np.ndarray], spare: np.ndarray, cut: int) -> list[np.ndarray]:
    """The rows whose values are, column by column, the middle ``n - 2 cut`` of ``rows`` (reordered)."""
    n, half = len(rows), (len(rows) + 1) // 2
    if 2 * cut > n - half:  # a half too short to hold both its ends apart: sort it all
        sort_rows(rows, spare)
        return rows[cut : n - cut]
    a, b = rows[:half], rows[half:]
    sort_rows(b, sort_rows(a, spare))
    for i in range(cut):  # the bottom pairs' larger and the top pairs' smaller values are middle ones
        np.maximum(a[i], b[cut - 1 - i], out=a[i])
        np.minimum(a[half - cut + i], b[len(b) - 1 - i], out=b[len(b) - 1 - i])
    return [*a[: half - cut], *b[cut:]]

"""Sorting every coordinate of a few devices' tensors at once, with a comparator network.

A trimmed mean sorts, per coordinate, the values the ``n`` senders of a tensor sent: millions of
columns of 8-32 values each. ``np.sort(axis=0)`` sorts each column on its own, a strided gather and a
small sort per column. A sorting network does the same as a fixed list of compare-exchanges of whole
rows, each one ``np.minimum``/``np.maximum`` over every column at once (vectorized, and free of the GIL).

Design notes:

* *Batcher's odd-even merge sort* (Knuth, TAOCP vol. 3, 5.3.4) sorts ``2^m`` rows with
  ``(m^2 - m + 4) 2^(m-2) - 1`` comparators: 63 for 16 rows. Fewer rows are padded to the next power of
  two with ``+inf``, which sorts last and is never read back.
* *Chunks.* The rows are swept in column blocks that fit in cache (:data:`CHUNK`): 63 passes over a block
  in cache rather than over the whole tensor in memory. On this machine a 16 x 2.4M float32 stack took
  0.09 s against 0.30 s for ``np.sort(axis=0)``.
* *Exact.* Compare-exchange only moves values, so the sorted rows are the values ``np.sort`` gives (NaN
  aside: a reply holding one is rejected before it is aggregated).
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


def sorted_rows(values: list[np.ndarray]) -> np.ndarray:
    """``(n, size)``: ``values`` (n flat or same-shape float arrays) sorted per coordinate, ascending; the
    same as ``np.sort(np.stack(values).reshape(n, -1), axis=0)``."""
    n = len(values)
    rows = 1 << max(0, (n - 1).bit_length())
    stack = np.empty((rows, values[0].size), dtype=values[0].dtype)
    for i, value in enumerate(values):
        stack[i] = value.reshape(-1)
    stack[n:] = np.inf
    network = merge_network(rows)
    scratch = np.empty(min(CHUNK, stack.shape[1]), dtype=stack.dtype)
    for start in range(0, stack.shape[1], CHUNK):
        block = stack[:, start : start + CHUNK]
        low = scratch[: block.shape[1]]
        for i, j in network:
            np.minimum(block[i], block[j], out=low)
            np.maximum(block[i], block[j], out=block[j])
            block[i] = low
    return stack[:n]

"""Exact tensor selection: the most importance whose backward time fits a budget.

Tensors are indexed input side first. Training the set S costs
``sum(t_dy[j] for j > kmin(S)) + sum(t_dw[k] for k in S)`` where ``kmin`` is
the input-most selected tensor: everything after it must pass the error
gradient back (``t_dy``, charged to each layer's first tensor), nothing before
it is touched, and kmin's own layer needs no input gradient.

For a fixed kmin the ``t_dy`` part is a constant, and choosing the other
tensors (all after kmin) is a 0/1 knapsack on ``t_dw``. Sweeping kmin from the
output side toward the input extends one knapsack table by one item per step,
so every kmin is answered in O(N * Q) overall (Q time bins). Costs are rounded
*up* to bins and the budget *down*, so a returned selection never exceeds the
budget; the optimum is exact up to that rounding (at most one bin per
selected tensor).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

DEFAULT_BINS = 2000


def selection_cost(selected: Sequence[bool], t_dw: Sequence[float], t_dy: Sequence[float]) -> float:
    """Backward cost of a selection, by the timing model in the module docstring."""
    chosen = [k for k, s in enumerate(selected) if s]
    if not chosen:
        return 0.0
    kmin = chosen[0]
    return float(sum(t_dy[kmin + 1 :]) + sum(t_dw[k] for k in chosen))


def select_tensors(
    importance: Sequence[float],
    t_dw: Sequence[float],
    t_dy: Sequence[float],
    budget: float,
    *,
    bins: int = DEFAULT_BINS,
) -> list[bool]:
    """Return a mask maximizing total importance with ``selection_cost <= budget``.

    Tensors with importance <= 0 are never selected; the mask is all False when
    nothing fits.
    """
    n = len(importance)
    if len(t_dw) != n or len(t_dy) != n:
        raise ValueError(f"importance, t_dw and t_dy must have equal lengths, got {n}, {len(t_dw)}, {len(t_dy)}")
    imp = np.asarray(importance, dtype=np.float64)
    dw = np.asarray(t_dw, dtype=np.float64)
    dy = np.asarray(t_dy, dtype=np.float64)
    if n == 0 or not math.isfinite(budget) or budget <= 0:
        return [False] * n
    if (dw < 0).any() or (dy < 0).any():
        raise ValueError("t_dw and t_dy must be non-negative")

    width = budget / bins
    # Rounding costs up and the budget down keeps every answer feasible.
    dw_bins = np.ceil(dw / width).astype(np.int64)
    q = bins
    # suffix_dy[k] = sum(t_dy[j] for j > k), exact in real time.
    suffix_dy = np.concatenate([np.cumsum(dy[::-1])[::-1][1:], [0.0]])

    best = np.zeros(q + 1)  # best[c]: max importance of tensors after kmin within c bins
    take = np.zeros((n, q + 1), dtype=bool)  # take[k, c]: item k used in best table at capacity c
    best_value, best_kmin, best_cap = 0.0, -1, 0
    for k in range(n - 1, -1, -1):
        if imp[k] <= 0:
            continue
        w = int(dw_bins[k])
        remaining = budget - suffix_dy[k] - dw[k]  # kmin itself is charged exactly
        if remaining >= 0:
            cap = min(int(math.floor(remaining / width)), q)
            if imp[k] + best[cap] > best_value:
                best_value, best_kmin, best_cap = imp[k] + best[cap], k, cap
        if w <= q:  # k joins the knapsack over tensors after a later kmin
            candidate = np.full(q + 1, -np.inf)
            candidate[w:] = best[: q + 1 - w] + imp[k]
            take[k] = candidate > best
            best = np.where(take[k], candidate, best)

    mask = [False] * n
    if best_kmin < 0:
        return mask
    mask[best_kmin] = True
    cap = best_cap
    # Walk the table back: items after kmin, from input side outward, mirror how they were added.
    for k in range(best_kmin + 1, n):
        if take[k, cap]:
            mask[k] = True
            cap -= int(dw_bins[k])
    return mask

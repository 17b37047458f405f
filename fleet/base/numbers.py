"""What counts as a number in a file or a reply fleet reads: one predicate for every reader.

YAML, JSON and pickles hand over Python's own numbers, so ``True`` is an int and ``10**400`` is an int no float
holds (``math.isfinite`` raises OverflowError on it). Each reader asked "is this a finite number" in its own
words; they ask here.
"""

from __future__ import annotations

import math


def is_real(value: object) -> bool:
    """An int or float (not a bool, a string or null) that a float holds, finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False

"""Deterministic splits of one dataset across a fleet of devices.

Every scheme returns disjoint index arrays (each sorted ascending) that together
cover every sample exactly once, so no data is silently dropped or duplicated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fleet.base.errors import DataError

SCHEMES: tuple[str, ...] = ("iid", "dirichlet", "shards")
DIRICHLET_MAX_TRIES = 100


def _as_labels(labels: np.ndarray | Sequence[int]) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise DataError(
            f"labels: expected a 1-D sequence of integer class labels, got shape {arr.shape} dtype {arr.dtype}"
        )
    if arr.size and arr.min() < 0:
        raise DataError(f"labels: found negative label {int(arr.min())}; labels must be 0..num_classes-1")
    return arr.astype(np.int64, copy=False)


def _iid(n: int, num_partitions: int, rng: np.random.Generator) -> list[np.ndarray]:
    return list(np.array_split(rng.permutation(n), num_partitions))


def _dirichlet(
    labels: np.ndarray, num_partitions: int, alpha: float, min_size: int, rng: np.random.Generator
) -> list[np.ndarray]:
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    smallest = 0
    for _ in range(DIRICHLET_MAX_TRIES):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
        for idx in by_class:
            idx = rng.permutation(idx)
            proportions = rng.dirichlet(np.full(num_partitions, alpha))
            cuts = np.floor(np.cumsum(proportions)[:-1] * len(idx)).astype(np.int64)
            for p, chunk in enumerate(np.split(idx, cuts)):
                parts[p].append(chunk)
        result = [np.concatenate(chunks) for chunks in parts]
        smallest = min(len(r) for r in result)
        if smallest >= min_size:
            return result
    raise DataError(
        f"alpha: dirichlet split with alpha={alpha} left a partition with {smallest} < min_partition_size={min_size} "
        f"samples in {DIRICHLET_MAX_TRIES} tries; raise alpha, lower num_partitions or lower min_partition_size"
    )


def _shards(labels: np.ndarray, num_partitions: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """FedAvg's label-sorted shards, but cut per class so every partition sees exactly k distinct classes.

    Each class is dealt to floor/ceil(P*k/C) partitions (the largest remaining quotas are
    served first, which always stays feasible) and its samples are split evenly among them.
    Nothing is dropped: there is no remainder shard.
    """
    classes = np.unique(labels)
    slots = num_partitions * k
    quota = np.full(len(classes), slots // len(classes), dtype=np.int64)
    quota[rng.permutation(len(classes))[: slots % len(classes)]] += 1
    counts = np.array([np.count_nonzero(labels == c) for c in classes])
    short = np.flatnonzero(counts < quota)
    if short.size:
        c = short[0]
        raise DataError(
            f"classes_per_partition: class {int(classes[c])} has {int(counts[c])} samples but must feed "
            f"{int(quota[c])} "
            f"partitions; lower num_partitions or classes_per_partition"
        )
    remaining = quota.copy()
    owners: list[list[int]] = [[] for _ in classes]
    for p in rng.permutation(num_partitions):
        tie_break = rng.random(len(classes))
        chosen = np.lexsort((tie_break, -remaining))[:k]  # largest remaining quotas, random among equals
        remaining[chosen] -= 1
        for c in chosen:
            owners[c].append(int(p))
    parts: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
    for c, label in enumerate(classes):
        idx = rng.permutation(np.flatnonzero(labels == label))
        for p, chunk in zip(owners[c], np.array_split(idx, len(owners[c]))):
            parts[p].append(chunk)
    return [np.concatenate(chunks) for chunks in parts]


def partition_indices(
    labels: np.ndarray | Sequence[int],
    num_partitions: int,
    scheme: str,
    *,
    alpha: float = 0.5,
    classes_per_partition: int = 2,
    seed: int = 0,
    min_partition_size: int = 1,
) -> list[np.ndarray]:
    """Split sample indices across devices; the same arguments always give the same split.

    iid: shuffled near-equal split.  dirichlet: per class, shares ~ Dirichlet(alpha)
    (small alpha = skewed label mixes), resampled until each part has at least
    ``min_partition_size`` samples.  shards: exactly ``classes_per_partition`` classes per part.
    """
    y = _as_labels(labels)
    n = len(y)
    if scheme not in SCHEMES:
        raise DataError(f"scheme: unknown partition scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, (int, np.integer)) or num_partitions < 1:
        raise DataError(f"num_partitions: got {num_partitions!r}; use a positive integer")
    if num_partitions > n:
        raise DataError(f"num_partitions: {num_partitions} partitions exceed the {n} samples; use at most {n}")
    if (
        isinstance(min_partition_size, bool)
        or not isinstance(min_partition_size, (int, np.integer))
        or min_partition_size < 0
    ):
        raise DataError(f"min_partition_size: got {min_partition_size!r}; use an integer >= 0")
    if num_partitions * min_partition_size > n:
        raise DataError(
            f"min_partition_size: {num_partitions} partitions of at least {min_partition_size} need "
            f"{num_partitions * min_partition_size} samples but there are {n}; lower it or num_partitions"
        )
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        parts = _iid(n, int(num_partitions), rng)
    elif scheme == "dirichlet":
        if not isinstance(alpha, (int, float, np.floating, np.integer)) or not math.isfinite(alpha) or alpha <= 0:
            raise DataError(f"alpha: got {alpha!r}; use a finite number > 0 (0.1 = very skewed, 100 = nearly iid)")
        parts = _dirichlet(y, int(num_partitions), float(alpha), int(min_partition_size), rng)
    else:
        num_classes = len(np.unique(y))
        k = classes_per_partition
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= num_classes:
            raise DataError(
                f"classes_per_partition: got {k!r}; use an integer in 1..{num_classes} (classes present in the labels)"
            )
        if num_partitions * k < num_classes:
            raise DataError(
                f"classes_per_partition: {num_partitions} partitions x {k} classes cannot cover all "
                f"{num_classes} classes; "
                f"raise num_partitions or classes_per_partition, or drop classes with data.classes"
            )
        parts = _shards(y, int(num_partitions), int(k), rng)
    parts = [np.sort(p).astype(np.int64) for p in parts]
    small = min(len(p) for p in parts)
    if small < min_partition_size:
        raise DataError(
            f"min_partition_size: the {scheme} split leaves a partition with {small} < {min_partition_size} samples; "
            f"lower min_partition_size or num_partitions"
        )
    return parts


def split_train_test(indices: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Hold out part of a device's data; with >= 2 samples and a positive fraction, both parts are non-empty."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if not isinstance(test_fraction, (int, float, np.floating)) or not 0.0 <= test_fraction < 1.0:
        raise DataError(f"test_fraction: got {test_fraction!r}; use a number in [0, 1)")
    n = len(idx)
    n_test = int(round(n * test_fraction))
    if test_fraction > 0 and n >= 2:
        n_test = min(max(n_test, 1), n - 1)
    shuffled = np.random.default_rng(seed).permutation(idx)
    return np.sort(shuffled[n_test:]), np.sort(shuffled[:n_test])

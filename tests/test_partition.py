"""Partitioners: coverage, determinism, skew and errors."""

from __future__ import annotations

import numpy as np
import pytest

from fleet.base.errors import DataError
from fleet.data.partition import SCHEMES, partition_indices, split_train_test

LABELS = np.repeat(np.arange(10), 100)[np.random.default_rng(0).permutation(1000)]


def _assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    joined = np.concatenate(parts)
    assert len(joined) == n and np.array_equal(np.sort(joined), np.arange(n))
    assert all(p.dtype == np.int64 and np.array_equal(p, np.sort(p)) for p in parts)


def _mean_entropy(parts: list[np.ndarray], labels: np.ndarray) -> float:
    out = []
    for p in parts:
        freq = np.bincount(labels[p], minlength=10) / len(p)
        freq = freq[freq > 0]
        out.append(float(-(freq * np.log(freq)).sum()))
    return float(np.mean(out))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_disjoint_cover_and_deterministic(scheme: str) -> None:
    parts = partition_indices(LABELS, 7, scheme, seed=3)
    assert len(parts) == 7 and all(len(p) >= 1 for p in parts)
    _assert_exact_cover(parts, len(LABELS))
    again = partition_indices(LABELS.tolist(), 7, scheme, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = partition_indices(LABELS, 7, scheme, seed=4)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


def test_iid_sizes_are_equal_and_label_mix_matches() -> None:
    parts = partition_indices(LABELS, 4, "iid")
    assert [len(p) for p in parts] == [250] * 4
    assert _mean_entropy(parts, LABELS) > 0.95 * np.log(10)
    assert [len(p) for p in partition_indices(LABELS, 3, "iid")] == [334, 333, 333]


def test_dirichlet_small_alpha_is_more_skewed() -> None:
    skewed = partition_indices(LABELS, 10, "dirichlet", alpha=0.1, seed=1)
    even = partition_indices(LABELS, 10, "dirichlet", alpha=100.0, seed=1)
    h_skewed, h_even = _mean_entropy(skewed, LABELS), _mean_entropy(even, LABELS)
    assert h_even > 0.95 * np.log(10)
    assert h_skewed < 0.6 * h_even


def test_dirichlet_respects_min_partition_size() -> None:
    parts = partition_indices(LABELS, 20, "dirichlet", alpha=0.3, min_partition_size=20, seed=2)
    assert min(len(p) for p in parts) >= 20
    _assert_exact_cover(parts, len(LABELS))


def test_dirichlet_gives_up_with_a_clear_error() -> None:
    with pytest.raises(DataError, match=r"alpha: dirichlet split with alpha=0.01 .* min_partition_size=90"):
        partition_indices(LABELS, 10, "dirichlet", alpha=0.01, min_partition_size=90)


@pytest.mark.parametrize("num_partitions,k", [(5, 2), (10, 2), (7, 3), (20, 1), (3, 10), (13, 4)])
def test_shards_give_exactly_k_classes(num_partitions: int, k: int) -> None:
    parts = partition_indices(LABELS, num_partitions, "shards", classes_per_partition=k, seed=9)
    _assert_exact_cover(parts, len(LABELS))
    assert [len(np.unique(LABELS[p])) for p in parts] == [k] * num_partitions
    # every class is spread over floor/ceil(P*k/C) partitions, so shards are balanced
    owners = [sum(c in set(LABELS[p].tolist()) for p in parts) for c in range(10)]
    assert set(owners) <= {num_partitions * k // 10, -(-num_partitions * k // 10)}


def test_shards_pairs_vary_between_partitions() -> None:
    parts = partition_indices(LABELS, 50, "shards", classes_per_partition=2, seed=0)
    pairs = {tuple(np.unique(LABELS[p]).tolist()) for p in parts}
    assert len(pairs) > 10  # not the same few pairs repeated


def test_min_partition_size_checked_for_every_scheme() -> None:
    with pytest.raises(DataError, match="min_partition_size: 10 partitions of at least 200"):
        partition_indices(LABELS, 10, "iid", min_partition_size=200)
    with pytest.raises(DataError, match="min_partition_size: the shards split leaves a partition with 50 < 51"):
        partition_indices(LABELS, 15, "shards", classes_per_partition=1, min_partition_size=51)


@pytest.mark.parametrize(
    "args,kwargs,field",
    [
        ((2000, "iid"), {}, "num_partitions: 2000 partitions exceed the 1000 samples"),
        ((0, "iid"), {}, "num_partitions: got 0"),
        ((5, "dirichlet"), {"alpha": 0.0}, "alpha: got 0.0"),
        ((5, "dirichlet"), {"alpha": float("nan")}, "alpha: got nan"),
        ((5, "shards"), {"classes_per_partition": 11}, r"classes_per_partition: got 11; use an integer in 1\.\.10"),
        (
            (2, "shards"),
            {"classes_per_partition": 2},
            "classes_per_partition: 2 partitions x 2 classes cannot cover all 10",
        ),
        (
            (5, "pathological"),
            {},
            "scheme: unknown partition scheme 'pathological'; choose one of iid, dirichlet, shards",
        ),
        ((5, "iid"), {"min_partition_size": -1}, "min_partition_size: got -1"),
    ],
)
def test_bad_arguments_name_the_field(args: tuple, kwargs: dict, field: str) -> None:
    with pytest.raises(DataError, match=field) as info:
        partition_indices(LABELS, *args, **kwargs)
    assert "\n" not in str(info.value)


def test_bad_labels() -> None:
    with pytest.raises(DataError, match="labels: expected a 1-D"):
        partition_indices(np.zeros((4, 2), dtype=int), 2, "iid")
    with pytest.raises(DataError, match="labels: found negative label -1"):
        partition_indices([0, 1, -1], 2, "iid")


def test_shards_with_too_few_samples_per_class() -> None:
    labels = np.array([0, 0, 0, 0, 0, 0, 1])
    with pytest.raises(DataError, match="classes_per_partition: class 1 has 1 samples but must feed 3"):
        partition_indices(labels, 3, "shards", classes_per_partition=2)


def test_split_train_test() -> None:
    idx = np.arange(100, 140)
    train, test = split_train_test(idx, 0.25, seed=1)
    assert len(test) == 10 and len(train) == 30
    assert np.array_equal(np.sort(np.concatenate([train, test])), idx)
    again = split_train_test(idx, 0.25, seed=1)
    assert np.array_equal(train, again[0]) and np.array_equal(test, again[1])
    assert not np.array_equal(test, split_train_test(idx, 0.25, seed=2)[1])
    # tiny partitions still get a non-empty test part, and keep a training sample
    assert [len(p) for p in split_train_test(np.array([5, 9]), 0.1, seed=0)] == [1, 1]
    assert [len(p) for p in split_train_test(np.array([5, 9, 11]), 0.9, seed=0)] == [1, 2]
    assert [len(p) for p in split_train_test(np.array([5]), 0.5, seed=0)] == [1, 0]
    assert [len(p) for p in split_train_test(idx, 0.0, seed=0)] == [40, 0]
    with pytest.raises(DataError, match=r"test_fraction: got 1.0; use a number in \[0, 1\)"):
        split_train_test(idx, 1.0, seed=0)

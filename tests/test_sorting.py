"""The comparator network sorts every coordinate exactly as np.sort does."""

from __future__ import annotations

import numpy as np
import pytest

from fleet.federated.on_server.robust import trimmed_mean
from fleet.federated.shared.sorting import CHUNK, merge_network, network_for, sort_rows, trimmed_means


@pytest.mark.parametrize("size, comparators", [(1, 0), (2, 1), (4, 5), (8, 19), (16, 63), (32, 191)])
def test_batchers_network_has_its_published_size(size, comparators):
    assert len(merge_network(size)) == comparators  # (m^2 - m + 4) 2^(m-2) - 1 for size 2^m


def test_a_size_that_is_not_a_power_of_two_is_refused():
    with pytest.raises(ValueError, match="not a power of two"):
        merge_network(12)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 16, 17])
def test_sort_rows_matches_np_sort_with_ties(n):
    rng = np.random.default_rng(n)
    values = [rng.integers(-3, 4, size=3 * 1000).astype(np.float32) for _ in range(n)]  # many ties
    values[0][:5] = [np.inf, -np.inf, 1e30, -1e30, 0.0]
    expected = np.sort(np.stack(values), axis=0)
    rows = [v.copy() for v in values]
    spare = sort_rows(rows, np.empty_like(values[0]))
    assert np.array_equal(np.stack(rows), expected)
    assert all(spare is not row for row in rows)  # the row left free is none of the sorted ones


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_trimmed_mean_is_the_sorted_middles_mean(dtype):
    rng = np.random.default_rng(0)
    values = [rng.standard_normal((4, 5)).astype(dtype) for _ in range(10)]
    middle = np.sort(np.stack(values), axis=0)[2:8].astype(np.float64)
    got = trimmed_mean(values, 2)
    assert got.dtype == np.float64 and got.shape == (4, 5)
    assert np.allclose(got, middle.mean(axis=0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows, comparators", [(3, 3), (12, 42), (16, 63), (17, 85)])
def test_a_pruned_network_drops_the_comparators_of_missing_rows(rows, comparators):
    assert len(network_for(rows)) == comparators and all(j < rows for _, j in network_for(rows))


@pytest.mark.parametrize("n", [3, 4, 5, 8, 9, 12, 13, 16, 17, 32])
def test_trimmed_means_are_the_sorted_middles_mean_for_every_cut(n):
    """Both paths: the two sorted halves' ends (a cut up to a quarter) and a full sort (larger cuts).
    Integer values sum exactly in float64 in any order, so the means must be equal, not close."""
    rng = np.random.default_rng(n)
    shape = (2, CHUNK // 2 + 5)  # two chunks, the last one short
    values = [rng.integers(-4, 5, size=shape).astype(np.float32) for _ in range(n)]  # many ties
    values[n - 1][0, :4] = [1e30, -1e30, 3e38, -3e38]  # huge ends, trimmed away, swamp nothing
    ordered = np.sort(np.stack(values).reshape(n, -1), axis=0).astype(np.float64)
    for cut in range(1, (n - 1) // 2 + 1):
        expected = ordered[cut : n - cut].mean(axis=0)
        assert np.array_equal(trimmed_means(values, cut), expected), cut

"""FoolsGold's weights (fleet/federated/on_server/similarity.py): sybils that share a goal over rounds lose their
weight, honest devices that differ keep theirs."""

from __future__ import annotations

import numpy as np
import pytest

from fleet.federated.on_server import similarity


def test_foolsgold_weights_from_known_cosines():
    """The bench's first round (head tensors): six honest devices and two label flippers."""
    cs = np.array(
        [
            [1.00, 0.24, 0.03, -0.25, -0.26, 0.42, 0.34, 0.13],
            [0.24, 1.00, 0.34, -0.24, 0.17, 0.40, 0.16, -0.08],
            [0.03, 0.34, 1.00, -0.06, 0.32, 0.15, 0.10, 0.02],
            [-0.25, -0.24, -0.06, 1.00, -0.07, -0.13, -0.03, -0.02],
            [-0.26, 0.17, 0.32, -0.07, 1.00, 0.04, -0.00, 0.00],
            [0.42, 0.40, 0.15, -0.13, 0.04, 1.00, 0.41, 0.27],
            [0.34, 0.16, 0.10, -0.03, -0.00, 0.41, 1.00, 0.54],
            [0.13, -0.08, 0.02, -0.02, 0.00, 0.27, 0.54, 1.00],
        ]
    )
    np.fill_diagonal(cs, -np.inf)
    w = similarity.foolsgold(cs)
    assert w[6] == pytest.approx(0.36, abs=0.01) and w[7] == pytest.approx(0.36, abs=0.01)  # the flippers
    assert w[:6].min() > 0.8 and w[1:5].min() == 1.0
    assert similarity.foolsgold(np.full((2, 2), -np.inf)).tolist() == [1.0, 1.0]  # nobody to compare with


def test_sybils_that_send_alike_updates_over_rounds_lose_their_weight():
    rng = np.random.default_rng(0)
    current = {"head": np.zeros(50, np.float32), "conv": np.zeros(9000, np.float32)}
    goal = rng.normal(size=50)
    history: similarity.History = {}
    for _ in range(4):
        updates = {f"h{i}": {"head": rng.normal(size=50).astype(np.float32)} for i in range(6)}
        for s in ("s0", "s1"):
            updates[s] = {"head": (goal + 0.3 * rng.normal(size=50)).astype(np.float32)}
        updates["h0"]["conv"] = rng.normal(size=9000).astype(np.float32)  # one device alone: not compared on it
        weights = similarity.similarity_weights(history, updates, current)
    assert weights["s0"] == 0.0 and weights["s1"] == 0.0
    assert min(weights[f"h{i}"] for i in range(6)) == 1.0
    assert set(history["h0"]) == {"head"} and history["h0"]["head"].shape == (50,)


def test_a_device_sending_other_tensors_cannot_empty_the_compared_set():
    current = {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}
    updates = {f"d{i}": {"a": np.ones(4, np.float32) * (i + 1)} for i in range(4)}
    updates["odd"] = {"b": np.ones(4, np.float32)}
    assert similarity.remember({}, updates, current) == ["a"]

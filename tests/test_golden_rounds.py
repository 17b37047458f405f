"""The redesigns keep behaviour: seeded tiny fleets decide exactly what they decided when recorded.

tests/golden_rounds.py runs fleet (a personal head, fine-tuning before evaluation), naive under a
tight deadline and Ditto through ``fleet simulate``, and compares every round's accuracy, bytes,
deadline, clock and per-device selection with tests/data/golden-rounds.json, recorded before the
round moved into the Flower-free coordinator.
"""

from __future__ import annotations

import json

from tests.golden_rounds import GOLDEN, RUNS, differences, run_all


def test_seeded_fleets_make_the_recorded_rounds():
    expected = json.loads(GOLDEN.read_text())
    assert set(expected) == set(RUNS)
    diffs = differences(expected, run_all())
    assert not diffs, "\n".join(diffs[:20])


def test_the_comparison_notices_a_changed_selection():
    expected = json.loads(GOLDEN.read_text())
    changed = json.loads(GOLDEN.read_text())
    device = next(iter(changed["naive-tight"][1]["devices"].values()))
    device["selected"] += 1
    changed["ditto"][0]["global_accuracy"] += 1e-3
    diffs = differences(expected, changed)
    assert len(diffs) == 2 and any("selected" in d for d in diffs) and any("global_accuracy" in d for d in diffs)

"""The redesigns keep behaviour: seeded tiny fleets decide exactly what they decided when recorded.

tests/golden_rounds.py runs fleet (a personal head, fine-tuning before evaluation), naive under a
tight deadline and Ditto through ``fleet simulate``, and compares every round's accuracy, bytes,
deadline, clock and per-device selection with tests/data/golden-rounds-<CPU capability>.json, recorded
before the round moved into the Flower-free coordinator (one recording per instruction set torch runs in).
"""

from __future__ import annotations

import json
import platform

import pytest

from tests.golden_rounds import CAPABILITY, DATA, NUMERIC, RUNS, differences, environment_note, golden_path, run_all

LOCKED = platform.machine() == "x86_64"  # requirements.lock pins torch for x86_64; aarch64 takes its own pair


def recording() -> dict:
    """This CPU capability's recording; a skip naming how to make one where there is none."""
    path = golden_path()
    if not path.is_file():
        pytest.skip(
            f"no recording for this CPU's capability ({path.name}); make one: python tests/golden_rounds.py --write"
        )
    return json.loads(path.read_text())


def test_seeded_fleets_make_the_recorded_rounds():
    recorded = recording()
    note = environment_note(recorded["environment"])
    if note and not LOCKED:
        pytest.skip(f"floats differ by build off x86_64: {note}")
    expected = recorded["runs"]
    assert set(expected) == set(RUNS)
    diffs = differences(expected, run_all())
    assert not diffs, "\n".join(([note] if note else []) + diffs[:20])


@pytest.mark.skipif(not LOCKED, reason="requirements.lock pins torch for x86_64 only")
def test_the_recording_names_the_locked_numeric_libraries():
    """The recording was made under requirements.lock's torch and numpy, and this suite runs under them."""
    recorded = recording()["environment"]
    assert set(recorded) == {*NUMERIC, CAPABILITY}
    lock = dict(
        line.split(";")[0].strip().split("==")
        for line in (DATA.parents[1] / "requirements.lock").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert recorded["numpy"] == lock["numpy"] and recorded["torch"].split("+")[0] == lock["torch"]
    assert environment_note(recorded) is None, environment_note(recorded)
    assert "running under" in environment_note({**recorded, "numpy": "0.0"})


def test_the_comparison_notices_a_changed_selection():
    path = next(DATA.glob("golden-rounds-*.json"))  # any recording: the comparison is what is tested
    expected, changed = json.loads(path.read_text())["runs"], json.loads(path.read_text())["runs"]
    device = next(iter(changed["naive-tight"][1]["devices"].values()))
    device["selected"] += 1
    changed["ditto"][0]["global_accuracy"] += 1e-3
    diffs = differences(expected, changed)
    assert len(diffs) == 2 and any("selected" in d for d in diffs) and any("global_accuracy" in d for d in diffs)


def test_each_recording_names_the_capability_it_was_made_on():
    paths = sorted(DATA.glob("golden-rounds-*.json"))
    assert [p.name for p in paths] == ["golden-rounds-AVX2.json", "golden-rounds-AVX512.json"]
    for path in paths:
        assert path.name == golden_path(json.loads(path.read_text())["environment"][CAPABILITY]).name

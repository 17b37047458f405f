"""The redesigns keep behaviour: seeded tiny fleets decide exactly what they decided when recorded.

tests/golden_rounds.py runs fleet (a personal head, fine-tuning before evaluation), naive under a
tight deadline and Ditto through ``fleet simulate``, and compares every round's accuracy, bytes,
deadline, clock and per-device selection with tests/data/golden-rounds-<CPU capability>.json, recorded
before the round moved into the Flower-free coordinator (one recording per instruction set torch runs in).
"""

from __future__ import annotations

import copy
import json
import platform

import pytest

from tests.golden_rounds import (
    CAPABILITY,
    DATA,
    NUMERIC,
    RUNS,
    compare,
    cpu_vendor,
    differences,
    environment_note,
    golden_path,
    recordings,
    run_all,
)

LOCKED = platform.machine() == "x86_64"  # requirements.lock pins torch for x86_64; aarch64 takes its own pair


def recorded_here() -> dict:
    """The recordings of this CPU's capability; a skip naming how to make one where there is none."""
    found = recordings()
    if not found:
        pytest.skip(
            f"no recording for this CPU's capability ({golden_path().name}); make one: "
            "python tests/golden_rounds.py --write"
        )
    return found


def test_seeded_fleets_make_the_recorded_rounds():
    """The run equals one of its capability's recordings exactly (each CPU's kernels sum in their own order)."""
    found = recorded_here()
    assert all(set(rec["runs"]) == set(RUNS) for rec in found.values())
    closest, diffs = compare(found, run_all())
    note = environment_note(found[closest]["environment"])
    if diffs and note and not LOCKED:
        pytest.skip(f"floats differ by build off x86_64: {note}")
    assert not diffs, "\n".join(
        [f"equals none of {[p.name for p in found]} (this CPU: {cpu_vendor()}); {closest.name} differs:"]
        + ([note] if note else [])
        + diffs[:20]
    )


@pytest.mark.skipif(not LOCKED, reason="requirements.lock pins torch for x86_64 only")
def test_the_recording_names_the_locked_numeric_libraries():
    """The recording was made under requirements.lock's torch and numpy, and this suite runs under them."""
    for recorded in (rec["environment"] for rec in recorded_here().values()):
        check_locked(recorded)


def check_locked(recorded: dict[str, str]) -> None:
    assert set(recorded) - {"cpu"} == {*NUMERIC, CAPABILITY}
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


def test_each_recording_names_the_capability_and_the_cpu_it_was_made_on():
    paths = sorted(DATA.glob("golden-rounds-*.json"))
    assert [p.name for p in paths] == [
        "golden-rounds-AVX2.json",  # made before recordings named their CPU
        "golden-rounds-AVX512-AuthenticAMD.json",
        "golden-rounds-AVX512-GenuineIntel.json",
    ]
    for path in paths:
        made = json.loads(path.read_text())["environment"]
        assert path in recordings(made[CAPABILITY])
        if "cpu" in made:
            assert path == golden_path(made[CAPABILITY], made["cpu"])


def test_a_run_equal_to_any_recording_of_its_capability_passes_and_one_equal_to_none_fails():
    found = recordings("AVX512")
    assert len(found) == 2
    for path, rec in found.items():
        assert compare(found, rec["runs"]) == (path, [])
    changed = copy.deepcopy(next(iter(found.values()))["runs"])
    changed["ditto"][0]["global_accuracy"] += 1e-3
    closest, diffs = compare(found, changed)
    assert closest == next(iter(found)), closest  # the recording it was changed from
    assert len(diffs) == 1 and diffs[0].startswith(".ditto[0].global_accuracy: "), diffs

"""Device classes: shares, speeds, uplinks and availability of a simulated fleet, and their bad input."""

from __future__ import annotations

import math
import re

import pytest

from fleet.base.errors import ConfigError
from fleet.federated.on_device.device import tier_of
from fleet.federated.on_server.coordinator import Coordinator
from fleet.federated.on_server.state import ServerState
from fleet.federated.shared.class_config import load_trace
from fleet.federated.shared.classes import (
    FleetClasses,
    bandwidth_of,
    class_counts,
    class_of,
    online,
)
from fleet.federated.shared.config import load_fleet_config
from fleet.federated.shared.names import simulated_names
from fleet.federated.shared.records import Member, TrainReply

EXAMPLE = "simulations/classes.yaml"


def fleet(classes: list[dict], num_devices: int = 20, **fed) -> object:
    return load_fleet_config(None, {"devices.num_devices": num_devices, "devices.device_classes": classes, **fed})


def test_shares_become_exact_counts_spread_over_the_fleet():
    assert class_counts([0.5, 0.3, 0.2], 16) == [8, 5, 3] and class_counts([1 / 3] * 3, 8) == [3, 3, 2]
    cfg = load_fleet_config(EXAMPLE)
    names = [class_of(cfg, i).name for i in range(16)]
    assert names.count("pi4-like") == 8 and names.count("pi5-like") == 5 and names.count("jetson-like") == 3
    assert names[:8] != ["pi4-like"] * 8  # seeded spread, not blocks
    assert names == [class_of(load_fleet_config(EXAMPLE), i).name for i in range(16)]  # the same everywhere
    assert class_of(load_fleet_config(None), 0) is None  # no classes: tiers in turn, as before


def test_a_class_sets_tier_bandwidth_and_availability():
    cfg = fleet(
        [
            {"name": "slow", "share": 0.5, "tier": 8, "bandwidth_mbps": 20, "availability": 0.5},
            {"name": "fast", "share": 0.5, "tier": 2, "bandwidth_mbps": 100, "bandwidth_sigma": 0.5},
        ]
    )
    slow = [i for i in range(20) if class_of(cfg, i).name == "slow"]
    fast = [i for i in range(20) if class_of(cfg, i).name == "fast"]
    assert {tier_of(cfg, i, {}) for i in slow} == {8.0} and {tier_of(cfg, i, {}) for i in fast} == {2.0}
    assert {bandwidth_of(cfg, i) for i in slow} == {20e6 / 8}  # no spread: every device at the median
    spread = [bandwidth_of(cfg, i) * 8 / 1e6 for i in fast]
    assert len(set(spread)) == len(fast) and 30 < math.exp(sum(map(math.log, spread)) / len(spread)) < 300
    always = [online(cfg, i, r, 0.0) for i in fast for r in range(1, 21)]
    assert all(always)
    halves = [online(cfg, i, r, 0.0) for i in slow for r in range(1, 41)]
    assert 0.35 < sum(halves) / len(halves) < 0.65  # availability 0.5, seeded per device and round
    view = FleetClasses(cfg, simulated_names(cfg))
    first_slow = f"device-{slow[0]}"
    assert view.class_name(first_slow) == "slow" and view.bandwidth(first_slow) == 20e6 / 8
    assert view.class_name("pi-in-the-field") is None and view.online("pi-in-the-field", 3, 0.0)  # deployment


def test_a_class_start_and_downlink_go_on_the_simulated_clock():
    cfg = fleet(
        [
            {"name": "pi", "share": 0.5, "bandwidth_mbps": 8, "downlink_mbps": 16, "start_s": 30},
            {"name": "lab", "share": 0.5, "bandwidth_mbps": 8},
        ],
        num_devices=2,
    )
    view = FleetClasses(cfg, simulated_names(cfg))
    pi, lab = sorted(view.partitions, key=lambda n: view.class_name(n) != "pi")
    assert view.fixed_s(pi, 4_000_000) == pytest.approx(30 + 2.0)  # 4 MB down at 16 Mbit/s: 2 s
    assert view.fixed_s(lab, 4_000_000) == 0.0 and view.fixed_s("pi-in-the-field", 4_000_000) == 0.0
    reply = TrainReply(0, pi, 10, 1.0, 3, 5, 0.5, 0.5, 4.0, 4.0, 8.0, 1_000_000, 2)
    assert reply.round_time_s(1e6, view.fixed_s(pi, 4_000_000)) == pytest.approx(32 + 4 + 1)
    assert reply.round_time_s(1e6) == pytest.approx(5.0)  # the older model: compute and upload
    for field_name, bad in (("downlink_mbps", 0), ("start_s", -1)):
        with pytest.raises(ConfigError, match=f"{field_name}"):
            fleet([{"name": "pi", "share": 1.0, field_name: bad}], num_devices=2)


def test_a_trace_sets_who_is_online_by_the_simulated_clock(tmp_path):
    trace = tmp_path / "trace.yaml"
    trace.write_text("period_s: 100\ndevices:\n  - [[0, 50]]\n  - [[50, 100]]\n")
    cfg = fleet([{"name": "traced", "share": 1.0, "trace": str(trace)}], num_devices=2)
    assert [online(cfg, 0, 1, t) for t in (0, 49.9, 50, 120)] == [True, True, False, True]
    assert [online(cfg, 1, 1, t) for t in (0, 49.9, 50, 199)] == [False, False, True, True]
    assert load_trace(str(trace)).period_s == 100
    assert [load_trace(str(trace)).wait_s(0, t) for t in (10, 60, 150)] == [0, 40, 50]


def test_when_every_device_is_off_its_trace_the_simulated_clock_waits_for_the_first_back(tmp_path):
    """A night every device shares: the clock moves on to the morning, where a clock standing still
    would have left every later round with nobody online."""
    trace = tmp_path / "night.yaml"
    trace.write_text("period_s: 100\ndevices:\n  - [[0, 40]]\n  - [[10, 40], [70, 80]]\n")
    cfg = fleet([{"name": "traced", "share": 1.0, "trace": str(trace)}], num_devices=2)
    view = FleetClasses(cfg, simulated_names(cfg))
    assert view.wait_s(["device-0", "device-1"], 50.0) == 20.0 and view.wait_s(["device-0"], 50.0) == 50.0
    assert view.wait_s(["device-1"], 20.0) == 0.0 and view.wait_s(["pi-in-the-field"], 50.0) == 0.0
    coord = Coordinator(cfg, ServerState(), {})
    coord.state.roster = {"1": Member("device-0", 1.0, 1.0), "2": Member("device-1", 1.0, 1.0)}
    coord.classes, coord.state.sim_time_s = view, 50.0
    assert coord.online(1, ["1", "2"]) == ["2"] and coord.state.sim_time_s == 70.0


@pytest.mark.parametrize(
    "text, message",
    [
        ("period_s: .inf\ndevices: [[[0, 1]]]\n", "period_s inf is not allowed"),
        ("period_s: 10\ndevices: [[]]\n", "no device is ever online"),
    ],
)
def test_a_trace_that_would_stop_the_clock_is_refused(tmp_path, text, message):
    trace = tmp_path / "bad.yaml"
    trace.write_text(text)
    with pytest.raises(ConfigError, match=message):
        fleet([{"name": "traced", "share": 1.0, "trace": str(trace)}], num_devices=2)


def test_a_missing_trace_file_is_named_as_a_trace():
    with pytest.raises(ConfigError, match=r"device_classes trace /nope/night.yaml: no such file; give a trace YAML"):
        fleet([{"name": "traced", "share": 1.0, "trace": "/nope/night.yaml"}], num_devices=2)


def test_a_class_gives_a_trace_or_an_availability_not_both(tmp_path):
    trace = tmp_path / "trace.yaml"
    trace.write_text("period_s: 100\ndevices:\n  - [[0, 50]]\n")
    with pytest.raises(ConfigError, match=r"\(traced\): trace and availability 0.5 both say when"):
        fleet([{"name": "traced", "share": 1.0, "trace": str(trace), "availability": 0.5}], num_devices=2)


@pytest.mark.parametrize(
    "classes, error",
    [
        (
            [{"name": "a", "share": 0.5}, {"name": "b", "share": 0.4}],
            "devices.device_classes: the shares sum to 0.9 (a 0.5, b 0.4); make them sum to 1",
        ),
        (
            [{"name": "a", "share": 1.0, "profile": "/nonexistent/pi4.yaml"}],
            "devices.device_classes (a): profile /nonexistent/pi4.yaml is not a file; measure one",
        ),
        (
            [{"name": "a", "share": 0.5, "availability": 0}, {"name": "b", "share": 0.5, "availability": 0}],
            "every class has availability 0, so no device is ever online",
        ),
        ([{"name": "a", "share": 1.0, "availability": 1.5}], "device_classes[0] (a).availability: 1.5 is not allowed"),
        ([{"name": "a", "share": 1.0, "speed": 3}], "devices.device_classes[0].speed: unknown field"),
        ([{"name": "a", "share": 0.5}, {"name": "a", "share": 0.5}], "class names repeat (a, a)"),
    ],
)
def test_bad_classes_are_one_line_errors(classes, error):
    with pytest.raises(ConfigError) as exc:
        fleet(classes)
    assert error in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize(
    "text, error",
    [
        ("period_s: 0\ndevices: [[[0, 1]]]\n", "period_s 0 is not allowed"),
        ("period_s: 10\ndevices: [[[5, 20]]]\n", "devices[0] has an interval outside"),
        ("period_s: 10\ndevices: [[]]\n", "no device is ever online"),
        ("period_s: 10\ndevices: [[[0, 'x']]]\n", "devices[0] must be a list of [start, end] pairs"),
    ],
)
def test_bad_traces_are_one_line_errors(tmp_path, text, error):
    trace = tmp_path / "t.yaml"
    trace.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(error)):
        fleet([{"name": "a", "share": 1.0, "trace": str(trace)}])

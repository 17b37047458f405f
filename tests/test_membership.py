"""Open membership: admission by name, restarts, benching, seeded sampling, bounded start."""

from __future__ import annotations

import dataclasses

import pytest

from fleet.base.errors import ConfigError, FleetError
from fleet.federated.launch.prepare import simulated_fleet
from fleet.federated.on_device.device import partition_of, state_dir_of, tier_of
from fleet.federated.on_server import membership as m
from fleet.federated.on_server.mailbox import Mailbox
from fleet.federated.on_server.server_loop import wait_for_devices
from fleet.federated.shared.config import fleet_config_from_dict
from fleet.federated.shared.names import device_name_of
from fleet.federated.shared.records import Member


def test_a_second_device_claiming_a_live_name_is_refused_in_one_line():
    roster: m.Roster = {}
    assert m.admit(roster, "11", "pi-a", 2.0, connected={"11", "12"}) is None
    reason = m.admit(roster, "12", "pi-a", 3.0, connected={"11", "12"})
    assert reason is not None and "\n" not in reason
    assert "'pi-a' is already used by node 11" in reason and "device-name" in reason
    assert roster == {"11": m.member("pi-a", 2.0)}  # nothing merged
    assert roster["11"] == Member("pi-a", 2.0, 2.0, missed=0)


@pytest.mark.parametrize("old_connected, old_missed", [(False, 0), (True, 1)])
def test_a_restarted_device_takes_its_name_to_its_new_node(old_connected, old_missed):
    """A SuperNode restarted gets a new node id; its old node is gone, or still 'online' until its
    heartbeat expires but missing rounds."""
    roster = {"11": dataclasses.replace(m.member("pi-a", 2.0), missed=old_missed)}
    connected = {"11", "13"} if old_connected else {"13"}
    assert m.admit(roster, "13", "pi-a", 2.5, connected) is None
    assert roster == {"13": m.member("pi-a", 2.5)}


def test_missed_rounds_bench_a_device_until_it_answers_a_query():
    roster = {"1": m.member("a", 1.0), "2": m.member("b", 1.0), "3": m.member("c", 1.0)}
    here = {"1", "2", "3"}
    assert m.record_attendance(roster, ["1", "2", "3"], answered=["1", "3"]) == ["b"]
    assert m.eligible(roster, here, max_missed=2) == ["1", "2", "3"]  # one miss: still sampled
    assert m.record_attendance(roster, ["1", "2"], answered=["1"]) == ["b"]
    assert m.eligible(roster, here, max_missed=2) == ["1", "3"]
    assert m.benched(roster, here, max_missed=2) == ["2"]
    assert m.eligible(roster, {"1"}, max_missed=2) == ["1"]  # disconnected devices are not eligible
    assert m.admit(roster, "2", "b", 1.0, here) is None  # it answered a query: back in
    assert m.eligible(roster, here, max_missed=2) == ["1", "2", "3"]
    m.record_attendance(roster, ["3"], answered=["3"])
    assert roster["3"].missed == 0


def test_sampling_is_seeded_by_round_and_covers_all_by_default():
    nodes = [str(i) for i in range(20)]
    assert m.sample(nodes, None, seed=0, server_round=1) == nodes
    assert m.sample(nodes, 25, seed=0, server_round=1) == nodes
    a = m.sample(nodes, 5, seed=0, server_round=3)
    assert len(a) == 5 == len(set(a)) and set(a) <= set(nodes)
    assert a == m.sample(nodes, 5, seed=0, server_round=3)  # the same round samples the same devices
    assert a != m.sample(nodes, 5, seed=0, server_round=4)
    assert a != m.sample(nodes, 5, seed=1, server_round=3)
    counts = {n: 0 for n in nodes}
    for r in range(200):
        for n in m.sample(nodes, 5, seed=0, server_round=r):
            counts[n] += 1
    assert min(counts.values()) > 25 and max(counts.values()) < 75  # about 50 each: uniform


class _Link:
    """Only what wait_for_devices reads: the connected node ids."""

    def __init__(self, nodes: list[int]) -> None:
        self.ids = nodes

    def nodes(self) -> set[str]:
        return {str(n) for n in self.ids}


def test_the_server_starts_at_min_devices_and_gives_up_after_timeout():
    cfg = fleet_config_from_dict(
        {"devices": {"num_devices": 5}, "membership": {"min_devices": 2}, "federation": {"timeout_s": 1.0}}
    )
    assert wait_for_devices(Mailbox(_Link([1, 2])), cfg) == {"1", "2"}
    with pytest.raises(FleetError, match="only 1 of 2 devices connected within 1s"):
        wait_for_devices(Mailbox(_Link([1])), cfg)


def test_device_identity_from_node_config():
    cfg = fleet_config_from_dict({"devices": {"num_devices": 4, "tiers": [1, 3]}})
    own = {"data-root": "/data/pi", "device-name": "pi-kitchen"}
    assert partition_of(cfg, own) is None and tier_of(cfg, None, own) == 1.0  # a real device: its own profile
    assert device_name_of(cfg, own, None) == "pi-kitchen"
    assert state_dir_of(cfg, "pi-kitchen", {}).parts[-2:] == ("devices", "pi-kitchen")
    assert device_name_of(cfg, {"partition-id": 3}, 3) == "device-3" and tier_of(cfg, 3, {}) == 3.0
    for bad, match in (
        ({"device-name": "../etc"}, "node config device-name: '../etc' cannot name a device"),
        ({"device-name": "a b"}, "cannot name a device"),
    ):
        with pytest.raises(ConfigError, match=match):
            device_name_of(cfg, {**own, **bad}, None)
    with pytest.raises(ConfigError, match="neither data-root nor partition-id"):
        partition_of(cfg, {})
    for bad in ("x", "inf", 1.5, 4, -1):
        with pytest.raises(ConfigError, match=f"partition-id: {bad!r} is outside 0..3"):
            partition_of(cfg, {"partition-id": bad})


@pytest.mark.parametrize("section, field", [("federation", "devices_per_round"), ("membership", "min_devices")])
def test_sampling_more_devices_than_the_simulated_fleet_is_one_line(section, field):
    cfg = fleet_config_from_dict({"devices": {"num_devices": 4}, section: {field: 5}})
    with pytest.raises(ConfigError, match=f"{section}.{field}: 5 is more than the 4 simulated devices that take part"):
        simulated_fleet(cfg, log=lambda s: None)
    ok = fleet_config_from_dict({"devices": {"num_devices": 4}, section: {field: 4}})
    assert simulated_fleet(ok, log=lambda s: None).devices.num_devices == 4


def test_a_run_whose_rounds_trained_nobody_says_so(tmp_path):
    """The summary lists the rounds in which no training reply was accepted (`fleet simulate` turns
    them into one error line and exit 2 instead of a 'global accuracy 0.00%' success)."""
    from fleet.federated.on_server.tracking import Tracker
    from fleet.federated.shared.round_record import RoundRecord

    tracker = Tracker(tmp_path, resume_round=None)
    trained = {"device": "device-0", "speedup": 1.0, "tier": 1.0, "trained_fraction": 1.0, "rho": 1.0}
    trained["bytes_uploaded"] = 8
    rejection = {"round": 1, "node_id": 5, "device": "device-0", "reason": "metric 'loss' must be finite, got nan"}
    for r, devices, rejections in ((1, [], [rejection]), (2, [trained], [])):
        line = {"round": r, "sim_time_s": r, "global_accuracy": 0.1, "personal_accuracy": 0.1}
        tracker.add(RoundRecord.from_json({**line, "rejections": rejections, "devices": devices}))
    summary = tracker.summary("x", "fleet")
    assert summary.rounds_without_training == [1] and summary.first_rejection == rejection["reason"]


def test_a_round_evaluates_every_eval_every_rounds_and_always_last():
    from fleet.federated.on_server.coordinator import evaluates
    from fleet.federated.shared.config import load_fleet_config

    cfg = load_fleet_config(None, {"federation.rounds": 10, "evaluation.every": 4})
    assert [r for r in range(1, 11) if evaluates(cfg, r, 0.0)] == [4, 8, 10]
    timed = load_fleet_config(None, {"federation.rounds": 10, "evaluation.every": 4, "federation.time_budget_s": 30})
    assert not evaluates(timed, 5, 29.9) and evaluates(timed, 5, 30.0)  # the round that reaches the horizon is last

"""The emulated-device testbed: real SuperNodes in cgroups and network namespaces, in real time.

The fast tests check what needs no root: fault syntax, the testbed section's checks, addresses, the
cgroup paths. The slow one runs a 3-device testbed as root (CI runs as root; elsewhere it is skipped,
saying why): two rounds of FedAvg, then two of fleet with one device killed, and asserts in measured
numbers that each limit took effect and that nothing is left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from fleet.base.errors import ConfigError
from fleet.engine.device_profile import DeviceProfile
from fleet.federated.config import fleet_config_from_dict, load_fleet_config
from fleet.testbed import cgroup, network
from fleet.testbed.run import Fault, class_round_times, run_testbed

ROOT = Path(__file__).resolve().parent.parent


def test_faults_parse_and_bad_ones_are_one_line():
    assert Fault.parse("kill", "pi4-0@3") == Fault("kill", "pi4-0", 3)
    assert Fault.parse("freeze", "pi5-1@2:30") == Fault("freeze", "pi5-1", 2, 30.0)
    for kind, text in (("kill", "pi4-0"), ("kill", "@3"), ("join", "pi4-0@0"), ("freeze", "a@2"), ("kill", "a@x")):
        with pytest.raises(ConfigError, match=f"--{kind} {text}: write it as"):
            Fault.parse(kind, text)


def test_the_testbed_section_is_checked_on_load():
    ok = fleet_config_from_dict({"testbed": {"classes": [{"name": "pi4", "count": 3, "cpu": 0.2}]}})
    assert ok.testbed.num_devices == 3 and ok.testbed.classes[0].threads() == 1
    bad = (
        ({"name": "Pi4"}, "testbed.classes[0].name: 'Pi4' is not allowed"),
        ({"cpu": 0}, "testbed.classes[0].cpu: 0.0 is not allowed"),
        ({"cpu": 64.0, "count": 64}, "testbed.classes: the devices ask for 4096 cores"),
        ({"memory_mb": 300}, "testbed.classes (device): memory_mb 300 leaves nothing above testbed.runtime_mb 1200"),
    )
    for fields, message in bad:
        with pytest.raises(ConfigError) as info:
            fleet_config_from_dict({"testbed": {"classes": [fields]}})
        assert str(info.value).startswith(message) and "<class" not in str(info.value)
    assert load_fleet_config(ROOT / "simulations/testbed.yaml").testbed.num_devices == 6


def test_each_device_has_its_own_link_addresses():
    assert network.addresses(0) == ("10.213.0.1", "10.213.0.2")
    assert network.addresses(64) == ("10.213.1.1", "10.213.1.2")
    with pytest.raises(Exception, match="at most 16384 devices"):
        network.addresses(network.MAX_DEVICES)


def test_a_device_cgroup_is_made_below_our_own(tmp_path):
    own = "4:memory:/sandbox/abc\n1:cpu:/\n6:freezer:/\n0::/\n"
    assert cgroup.own_path("memory", own) == "sandbox/abc" and cgroup.own_path("cpu", own) == ""
    assert cgroup.own_path("", own) == ""
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    (tmp_path / "memory").mkdir()
    assert cgroup.version(tmp_path) == 1
    with pytest.raises(Exception, match="needs a cgroup CPU and memory controller"):
        cgroup.version(tmp_path / "none")


def test_class_round_times_take_each_class_slowest_device():
    rec = {"devices": [{"device": "a-0", "wall_s": 3.0}, {"device": "a-1", "wall_s": 5.0}, {"device": "b-0"}]}
    assert class_round_times(rec, {"a-0": "a", "a-1": "a", "b-0": "b"}) == {"a": 5.0}


# --- the real thing, as root -------------------------------------------------------------------
SLOW_CPU = 0.25
UPLINK_MBPS = 8.0  # the slow device's uplink: its ~45 MB upload takes 45 s, far above anything else in its round


def leftovers() -> list[str]:
    found = [n for n in network.namespaces() if n.startswith(network.PREFIX)]
    found += [str(p) for p in cgroup.stale()]
    procs = subprocess.run(["pgrep", "-f", "flower-super(link|node)"], capture_output=True, text=True).stdout.split()
    return found + [f"pid {p}" for p in procs]


def tiny_testbed(tmp_path: Path, strategy: str) -> Path:
    cfg = yaml.safe_load((ROOT / "simulations/fleet-tiny.yaml").read_text())
    cfg["name"] = f"tb-{strategy}"
    cfg["output_dir"] = str(tmp_path / "runs")
    cfg["federation"].update(strategy=strategy, rounds=2, timeout_s=600)
    cfg["membership"] = {"grace_s": 120}
    cfg["testbed"] = {
        "classes": [
            {"name": "slow", "count": 1, "cpu": SLOW_CPU, "uplink_mbps": UPLINK_MBPS, "downlink_mbps": 100},
            {"name": "free", "count": 2, "uplink_mbps": 1000, "downlink_mbps": 1000},
        ],
        "timeout_s": 1200,
    }
    path = tmp_path / f"tb-{strategy}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_three_device_testbed_runs_fedavg_and_fleet_within_real_limits(tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("the testbed needs root (cgroups and network namespaces); run the slow tests as root")
    fedavg = run_testbed(load_fleet_config(tiny_testbed(tmp_path, "fedavg")), [], log=print)
    assert fedavg["rounds"] == 2
    run = tmp_path / "runs" / "tb-fedavg"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the CPU limit: the device profiled itself under a quarter of a core
    steps = {
        d: DeviceProfile.load(run / "devices" / d / "device-profile.yaml").full_step_time for d in ("slow-0", "free-0")
    }
    assert steps["slow-0"] >= 3 * steps["free-0"], steps
    # the uplink: every upload of B bytes at R Mbit/s took at least 0.9 B/R
    for rec in records:
        slow = next(d for d in rec["devices"] if d["device"] == "slow-0")
        assert slow["wall_s"] >= 0.9 * slow["bytes_uploaded"] * 8 / (UPLINK_MBPS * 1e6), slow
    # fleet, with a healthy device killed as round 2 starts: that round costs at most its bound
    kill = [Fault("kill", "free-1", 2)]
    fleet = run_testbed(load_fleet_config(tiny_testbed(tmp_path, "fleet")), kill, log=print)
    assert fleet["rounds"] == 2
    fleet_records = [json.loads(line) for line in (tmp_path / "runs/tb-fleet/metrics.jsonl").read_text().splitlines()]
    assert fleet_records[1]["missed"] == ["free-1"]
    assert fleet_records[1]["round_wall_s"] <= fleet_records[1]["wall_bound_s"] + 120  # evaluation: grace_s more
    out = capsys.readouterr().out
    assert "round   1/2" in out and "testbed: round 2: kill free-1" in out
    assert not leftovers(), leftovers()

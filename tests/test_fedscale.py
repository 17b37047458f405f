"""FedScale device traces as a device class: read as plain data only, and each device following its client."""

from __future__ import annotations

import json
import pickle
import statistics

import pytest

from fleet.base.errors import ConfigError
from fleet.federated.classes import FleetClasses, bandwidth_of, online
from fleet.federated.config import load_fleet_config
from fleet.federated.device import tier_of
from fleet.federated.fedscale import load_clients

CAPACITY = {  # FedScale's client_device_capacity: ms per sample, kbps; ids are ints in its pickles
    1: {"computation": 100.0, "communication": 8000.0},
    2: {"computation": 200.0, "communication": 4000.0},
    3: {"computation": 400.0, "communication": 800.0},
    9: {"computation": 50.0, "communication": 100.0},  # no behaviour: never drawn
}
BEHAVIOUR = {  # client_behave_trace: online from active[i] to inactive[i], repeating every finish_time
    1: {"active": [0], "inactive": [100], "finish_time": 100, "duration": 100},
    2: {"active": [10, 60], "inactive": [40, 90], "finish_time": 100, "duration": 60},
    3: {"active": [50], "inactive": [100], "finish_time": 200, "duration": 50},
}


def write(tmp_path, suffix: str) -> tuple[str, str]:
    cap, beh = tmp_path / f"capacity{suffix}", tmp_path / f"behaviour{suffix}"
    if suffix == ".json":
        cap.write_text(json.dumps({str(k): v for k, v in CAPACITY.items()}))
        beh.write_text(json.dumps({str(k): v for k, v in BEHAVIOUR.items()}))
    else:
        cap.write_bytes(pickle.dumps(CAPACITY))
        beh.write_bytes(pickle.dumps(BEHAVIOUR))
    return str(cap), str(beh)


def fleet(cap: str, beh: str, num_devices: int = 12):
    cls = {"name": "phone", "share": 1.0, "fedscale_capacity": cap, "fedscale_behaviour": beh}
    return load_fleet_config(None, {"devices.num_devices": num_devices, "devices.device_classes": [cls]})


def test_a_pickle_and_its_json_give_the_same_clients(tmp_path):
    from_pickle = load_clients(*write(tmp_path, ".pkl")).clients
    from_json = load_clients(*write(tmp_path, ".json")).clients
    assert from_pickle == from_json
    assert [c.client_id for c in from_pickle] == ["1", "2", "3"]  # client 9 has no behaviour
    two = from_pickle[1]
    assert two.intervals == ((10.0, 40.0), (60.0, 90.0)) and two.period_s == 100
    assert two.online(15) and not two.online(45) and two.online(165) and two.wait_s(45) == pytest.approx(15)


def test_each_device_takes_its_clients_speed_uplink_and_online_intervals(tmp_path):
    cfg = fleet(*write(tmp_path, ".pkl"))
    cls = cfg.devices.device_classes[0]
    median = statistics.median(c["computation"] for k, c in CAPACITY.items() if k in BEHAVIOUR)
    seen = set()
    for pid in range(cfg.devices.num_devices):
        client = cls.fedscale.client(cfg.train.seed, pid)
        seen.add(client.client_id)
        assert tier_of(cfg, pid, {}) == pytest.approx(client.ms_per_sample / median)
        assert bandwidth_of(cfg, pid) == pytest.approx(client.kbps * 1000 / 8)
        for t in (0.0, 15.0, 45.0, 55.0, 120.0, 170.0):
            assert online(cfg, pid, 1, t) == client.online(t)  # availability follows the trace on the sim clock
    assert seen == {"1", "2", "3"}  # twelve devices draw from every client
    classes = FleetClasses(cfg, {f"d{pid}": pid for pid in range(cfg.devices.num_devices)})
    offline = [f"d{pid}" for pid in range(12) if not classes.online(f"d{pid}", 1, 45.0)]
    assert offline and classes.wait_s(offline, 45.0) > 0  # all offline: the clock moves on to the first back


def test_a_pickle_that_names_a_callable_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    _, beh = write(tmp_path, ".pkl")
    cap = tmp_path / "evil.pkl"
    cap.write_bytes(pickle.dumps({1: Payload()}))
    with pytest.raises(ConfigError, match=r"fedscale_capacity: .* is refused: it names io.open, and only"):
        fleet(str(cap), beh)
    assert not marker.exists()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"fedscale_behaviour": None}, "fedscale_capacity needs fedscale_behaviour too; give both files"),
        ({"availability": 0.5}, "its FedScale trace says when its devices are online; drop availability"),
        ({"fedscale_capacity": "/nope.pkl"}, "fedscale_capacity: /nope.pkl is not a file"),
    ],
)
def test_bad_fedscale_classes_are_one_line(tmp_path, change, message):
    cap, beh = write(tmp_path, ".pkl")
    cls = {"name": "phone", "share": 1.0, "fedscale_capacity": cap, "fedscale_behaviour": beh, **change}
    with pytest.raises(ConfigError, match=message):
        load_fleet_config(None, {"devices.num_devices": 4, "devices.device_classes": [cls]})


def test_files_that_share_no_usable_client_are_one_line(tmp_path):
    cap, beh = tmp_path / "c.json", tmp_path / "b.json"
    cap.write_text(json.dumps({"1": {"computation": 0, "communication": 5}}))
    beh.write_text(json.dumps({"1": BEHAVIOUR[1], "2": BEHAVIOUR[2]}))
    with pytest.raises(ConfigError, match=r"share no client with a positive computation"):
        fleet(str(cap), str(beh))
    beh.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"holds no mapping of client ids"):
        fleet(str(cap), str(beh))

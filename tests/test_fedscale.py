"""FedScale device traces as a device class: read as plain data only, and each device following its client."""

from __future__ import annotations

import json
import pickle
import random
import re
import statistics

import pytest
import yaml

from fleet.base.errors import ConfigError
from fleet.federated.on_device.device import tier_of
from fleet.federated.shared.classes import FleetClasses, bandwidth_of, online
from fleet.federated.shared.config import load_fleet_config
from fleet.federated.shared.fedscale import load_clients
from tests.test_fleet_simulation import ROOT, read_metrics, run_fleet

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


def trace_online(behaviour: dict, t: float) -> bool:
    """Online at simulated time ``t`` by FedScale's reading of a client's intervals (computed here, apart)."""
    phase = t % behaviour["finish_time"]
    return any(a <= phase < b for a, b in zip(behaviour["active"], behaviour["inactive"]))


@pytest.mark.slow
def test_a_fedscale_trace_drives_a_thousand_device_simulation(tmp_path):
    """1,000 devices, 4 rounds, 16 a round, from a FedScale-format trace written here: nobody offline is
    sampled, and each round's online count is the trace's at the simulated time the round sampled."""
    rng = random.Random(0)
    capacity, behaviour = {}, {}
    for cid in range(1, 1201):
        capacity[cid] = {"computation": rng.uniform(50, 400), "communication": rng.uniform(2000, 50000)}
        start, end = rng.uniform(0, 20), rng.uniform(3, 10)  # online for 3-10 s of every 20, wrapping round
        end += start
        spans = [(start, end)] if end <= 20 else [(0.0, end - 20), (start, 20.0)]
        behaviour[cid] = {"active": [a for a, _ in spans], "inactive": [b for _, b in spans], "finish_time": 20}
    (tmp_path / "cap.pkl").write_bytes(pickle.dumps(capacity))
    (tmp_path / "beh.pkl").write_bytes(pickle.dumps(behaviour))
    cfg = yaml.safe_load((ROOT / "simulations/scale.yaml").read_text())
    cfg["hardware"]["profile"] = str(ROOT / cfg["hardware"]["profile"])
    cfg["start"]["epochs"] = 1
    cfg["federation"].update({"rounds": 4, "devices_per_round": 16})
    cfg["devices"]["num_devices"] = 1000
    cls = {"name": "phone", "share": 1.0, "fedscale_capacity": str(tmp_path / "cap.pkl")}
    cfg["devices"]["device_classes"] = [{**cls, "fedscale_behaviour": str(tmp_path / "beh.pkl")}]
    cfg["output_dir"] = str(tmp_path / "runs")
    (tmp_path / "trace.yaml").write_text(yaml.safe_dump(cfg))
    res = run_fleet(["simulate", str(tmp_path / "trace.yaml")], timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:]
    records = read_metrics(tmp_path / "runs" / "scale")
    loaded = load_fleet_config(str(tmp_path / "trace.yaml"))
    draw = loaded.devices.device_classes[0].fedscale
    client = {f"device-{pid}": int(draw.client(loaded.train.seed, pid).client_id) for pid in range(1000)}
    assert len(records) == 4
    for rec in records:
        up = {name for name, cid in client.items() if trace_online(behaviour[cid], rec["sampled_at_s"])}
        assert rec["online"] == len(up) and set(rec["offline"]) == set(client) - up
        assert len(rec["sampled"]) == 16 and set(rec["sampled"]) <= up  # nobody offline is sampled
    assert len({r["online"] for r in records}) > 1  # the count moves with the trace, round by round


def _huge_bytes_pickle() -> bytes:
    """14 bytes: protocol 4, BINBYTES8 declaring a 1 TiB object, and nothing after it."""
    return b"\x80\x04" + b"\x8e" + (2**40).to_bytes(8, "little") + b"."


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("cap.pkl", _huge_bytes_pickle(), "declares 1,099,511,627,776 bytes at offset 2, where 1 remain"),
        ("cap.json", b"[" * 100_000 + b"]" * 100_000, "nested too deeply to read"),
        ("cap.pkl", pickle.dumps({1: {"computation": 10**400}}), "an integer of 167 bytes, wider than any float"),
        ("cap.json", b'{"1": {"computation": 1' + b"0" * 400 + b"}}", "an integer of 401 digits, wider than any"),
        ("cap.pkl", pickle.dumps({10**5000: {}}), "an integer of 2,077 bytes"),  # str() of the id raised
        ("cap.pkl", b"\x80\x04}" + b")" + b"\x85" * 1_000_000 + b"Ns.", "nested more than 64 levels deep"),
    ],
    ids=["1-TiB-pickle", "deep-json", "400-digit-pickle", "400-digit-json", "5000-digit-id", "deep-tuple-id"],
)
def test_a_hostile_capacity_file_is_one_line_not_a_crash(tmp_path, name, content, message):
    """The 1 TiB was asked of the allocator before anything was read; 1,000,000 nested tuples as a client id
    were hashed by C recursion, which killed the process with a segmentation fault."""
    (tmp_path / name).write_bytes(content)
    _, beh = write(tmp_path, ".pkl")
    with pytest.raises(ConfigError, match=f"fedscale_capacity: {re.escape(str(tmp_path / name))} .*{message}") as err:
        load_clients(str(tmp_path / name), beh)
    assert "\n" not in str(err.value)


def test_a_400_digit_time_in_a_behaviour_file_is_refused_naming_it(tmp_path):
    """No measurement is wider than a float; the file is refused in one line, not its client dropped silently."""
    cap, _ = write(tmp_path, ".pkl")
    behaviour = {**BEHAVIOUR, 2: {"active": [10**400], "inactive": [40], "finish_time": 100}}
    (tmp_path / "beh.pkl").write_bytes(pickle.dumps(behaviour))
    with pytest.raises(ConfigError, match=r"fedscale_behaviour: .*beh.pkl is refused: it holds an integer of 167"):
        load_clients(cap, str(tmp_path / "beh.pkl"))


def test_a_real_sized_trace_reads_back_whole(tmp_path):
    """20,000 clients (FedScale's files hold about 100,000): the walk before the load refuses none of them."""
    rng = random.Random(0)
    capacity = {
        i: {"computation": rng.uniform(5, 500), "communication": rng.uniform(100, 10**5)} for i in range(20_000)
    }
    behaviour = {i: {"active": [0], "inactive": [rng.randint(1, 99)], "finish_time": 100} for i in range(20_000)}
    (tmp_path / "cap.pkl").write_bytes(pickle.dumps(capacity))
    (tmp_path / "beh.pkl").write_bytes(pickle.dumps(behaviour))
    table = load_clients(str(tmp_path / "cap.pkl"), str(tmp_path / "beh.pkl"))
    assert len(table.clients) == 20_000
    assert table.median_ms == statistics.median(c["computation"] for c in capacity.values())

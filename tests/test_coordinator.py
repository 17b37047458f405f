"""The Coordinator drives a fleet's rounds without Flower: synthetic replies of a real model's tensors.

Five devices (and a sixth that claims a taken name) through three rounds: admission and refusal, the
deadline, a reply with a bad tensor, a device that misses, a late reply for a closed round, one pulling
against the others, an evaluation, the clocks and the metrics.jsonl record, with the numbers they must
give. The same scenario runs in a fresh interpreter to show that none of it imports flwr.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fleet.federated.on_server.coordinator import Coordinator
from fleet.federated.on_server.server_run import initial_arrays
from fleet.federated.on_server.state import ServerState, load_checkpoint, save_checkpoint
from fleet.federated.shared.config import FleetConfig, load_fleet_config
from fleet.federated.shared.records import EVALUATE, QUERY, TRAIN, Member, Reply

ROOT = Path(__file__).resolve().parent.parent
NODES = ["101", "102", "103", "104", "105"]  # device-0 .. device-4
FULL_TIMES = [2.0, 4.0, 4.0, 8.0, 8.0]
PREDICTED = {"101": 1.0, "102": 1.5, "103": 2.0, "104": 3.0, "105": 2.5}
TRAINED = ("fc.weight", "fc.bias")  # what every device trains: the head
BANDWIDTH = 12.5e6  # devices.bandwidth_bytes_per_s (its default): one uplink for the fleet


def config() -> FleetConfig:
    """Five devices, three rounds; uploads in float32 (whatever the default), so the averages below are exact
    (float16's are tested in tests/test_transfer.py)."""
    sets = {"devices.num_devices": 5, "federation.rounds": 3, "federation.transfer": "float32"}
    return load_fleet_config(ROOT / "simulations/fleet-tiny.yaml", sets)


def query(node: str, name: str, full_time_s: float) -> Reply:
    metrics = {"tier": 1.0, "full-time-s": full_time_s, "min-rho": 0.2, "num-examples": 48}
    return Reply(int(node), QUERY, 1, name=name, metrics=metrics)


def train_reply(node: str, server_round: int, start: dict[str, np.ndarray], step: float, **changes) -> Reply:
    """What device ``node`` sends after training the head: ``start`` moved by ``step`` everywhere."""
    arrays = {n: (start[n] + np.float32(step)).astype(np.float32) for n in TRAINED}
    metrics = {
        "partition-id": NODES.index(node),
        "num-examples": 40,
        "tier": 1.0,
        "selected": len(TRAINED),
        "num-tensors": 62,
        "trained-fraction": 0.01,
        "rho": 0.4,
        "predicted-time-s": PREDICTED[node],
        "measured-time-s": 0.1,
        "full-time-s": FULL_TIMES[NODES.index(node)],
        "speedup": FULL_TIMES[NODES.index(node)] / PREDICTED[node],
        "bytes-uploaded": 1,  # what the device says: the server counts for itself
        "loss": 0.9,
        "steps": 2,
        **changes,
    }
    return Reply(int(node), TRAIN, server_round, name=f"device-{NODES.index(node)}", metrics=metrics, arrays=arrays)


def evaluate_reply(node: str, server_round: int, acc: float, personal: float, samples: int) -> Reply:
    metrics = {"num-examples": samples, "global-accuracy": acc, "personal-accuracy": personal}
    return Reply(int(node), EVALUATE, server_round, metrics=metrics)


def round_one(coord: Coordinator, connected: set[str]) -> tuple[dict, dict[str, np.ndarray], float]:
    """Admission, a bad tensor, a device that misses, an evaluation; (record, arrays sent, deadline)."""
    started = coord.open_round(connected)
    assert coord.queries(connected, asked=set()) == sorted(connected)  # nobody is a member yet
    answers = [query(n, f"device-{i}", t) for i, (n, t) in enumerate(zip(NODES, FULL_TIMES))]
    coord.take(1, QUERY, [*answers, query("106", "device-0", 1.0)], connected)  # 106 claims a taken name
    plan = coord.plan_round(1, coord.eligible(connected), connected)
    sent = coord.arrays
    bad = train_reply("103", 1, sent, 0.5)
    bad.arrays["fc.bias"][0] = np.nan
    replies = [
        train_reply("101", 1, sent, 0.1),
        train_reply("102", 1, sent, 0.3),
        bad,
        train_reply("104", 1, sent, 0.2),
    ]
    coord.close_train(plan, coord.take(1, TRAIN, replies, connected))  # device-4 (105) never answers
    assert coord.evaluates(1) and coord.evaluation_nodes(1) == ["101", "102", "103", "104"]
    failed = Reply(103, EVALUATE, 1, error="ValueError: no test split")
    scored = [evaluate_reply("101", 1, 0.5, 0.6, 10), evaluate_reply("102", 1, 0.7, 0.8, 30), failed]
    coord.close_evaluate(1, coord.take(1, EVALUATE, scored, connected))
    return coord.close_round(plan, started).to_json(), sent, plan.deadline_s


def round_two(coord: Coordinator, connected: set[str]) -> tuple[dict, dict[str, np.ndarray], dict]:
    """A late reply of round 1, one device pulling against the others, one missing, nobody evaluated."""
    started = coord.open_round(connected)
    plan = coord.plan_round(2, coord.eligible(connected), connected)
    sent = coord.arrays
    late = train_reply("105", 1, sent, 0.2)  # round 1's train reply, after its phase closed
    steps = {"101": 0.1, "102": 0.3, "103": 0.2, "105": -1.0}  # 105: five times back; 104 misses
    replies = [late, *[train_reply(n, 2, sent, s) for n, s in steps.items()]]
    coord.close_train(plan, coord.take(2, TRAIN, replies, connected))
    assert coord.evaluates(2)
    coord.close_evaluate(2, coord.take(2, EVALUATE, [], connected))  # nobody answered in time
    return coord.close_round(plan, started).to_json(), sent, plan.order.to_config()


def round_three(coord: Coordinator, connected: set[str]) -> dict:
    """device-3 misses again: benched after max_missed (2) rounds in a row, it is asked who it is."""
    started = coord.open_round(connected)
    plan = coord.plan_round(3, coord.eligible(connected), connected)
    replies = [train_reply(n, 3, coord.arrays, 0.1) for n in NODES if n != "104"]
    coord.close_train(plan, coord.take(3, TRAIN, replies, connected))
    coord.close_evaluate(3, [])
    return coord.close_round(plan, started).to_json()


def run_rounds() -> dict:
    cfg = config()
    coord = Coordinator(cfg, ServerState(run_tag="golden"), initial_arrays(cfg))
    connected = {*NODES, "106"}
    rec1, sent1, deadline1 = round_one(coord, connected)
    after1 = coord.arrays
    rec2, sent2, order2 = round_two(coord, connected)
    after2, suspects2 = coord.arrays, dict(coord.state.suspects)
    rec3 = round_three(coord, connected)
    return {
        "coord": coord,
        "records": [rec1, rec2, rec3],
        "sent": [sent1, sent2],
        "after": [after1, after2],
        "deadline1": deadline1,
        "order2": order2,
        "queries": coord.queries(connected, asked=set()),
        "suspects": [suspects2, coord.state.suspects],
    }


@pytest.fixture(scope="module")
def fleet() -> dict:
    return run_rounds()


def test_admission_deadline_and_a_rejected_tensor(fleet):
    coord, rec1 = fleet["coord"], fleet["records"][0]
    full_bytes = sum(a.nbytes for a in fleet["sent"][0].values() if a.dtype.kind == "f")  # no personal tensor
    assert coord.full_bytes == full_bytes
    assert fleet["deadline1"] == 2.0 + full_bytes / BANDWIDTH  # the fastest full round: training and upload
    assert rec1["deadline_s"] == fleet["deadline1"] and rec1["train_bound_s"] == fleet["deadline1"] + 30.0
    assert rec1["joined"] == [f"device-{i}" for i in range(5)] and rec1["connected"] == 6
    (refused,) = rec1["refused"]
    assert refused["node_id"] == 106 and "'device-0' is already used by node 101" in refused["reason"]
    assert rec1["sampled"] == [f"device-{i}" for i in range(5)] and rec1["missed"] == ["device-4"]
    assert [(r["device"], r["round"]) for r in rec1["rejections"]] == [("device-2", 1)]
    assert "tensor 'fc.bias' holds non-finite values" in rec1["rejections"][0]["reason"]


def test_the_average_and_the_clock(fleet):
    sent, after = fleet["sent"][0], fleet["after"][0]
    for name in TRAINED:  # trimmed mean of three senders: nothing to trim, their plain mean
        expected = np.mean([sent[name] + np.float32(s) for s in (0.1, 0.3, 0.2)], axis=0, dtype=np.float64)
        np.testing.assert_allclose(after[name], expected.astype(np.float32), rtol=0, atol=1e-6)
    untouched = [n for n in sent if n not in TRAINED]
    assert all(after[n] is sent[n] for n in untouched)  # trained by nobody: kept as it was
    rec1 = fleet["records"][0]
    uploaded = sum(sent[n].nbytes for n in TRAINED)  # counted by the server, not the device's 1 byte
    assert rec1["bytes_uploaded"] == 3 * uploaded
    assert rec1["round_time_s"] == pytest.approx(
        max(PREDICTED[n] for n in ("101", "102", "104")) + uploaded / BANDWIDTH
    )
    assert rec1["sim_time_s"] == rec1["round_time_s"]
    assert rec1["tensors_trained_by_nobody"] == 62 - 2
    assert json.loads(json.dumps(rec1)) == rec1  # metrics.jsonl takes it as it is


def test_the_evaluation_and_the_device_rows(fleet):
    rec1 = fleet["records"][0]
    assert rec1["global_accuracy"] == pytest.approx((0.5 * 10 + 0.7 * 30) / 40)
    assert rec1["personal_accuracy"] == pytest.approx((0.6 * 10 + 0.8 * 30) / 40)
    rows = {d["device"]: d for d in rec1["devices"]}
    assert sorted(rows) == ["device-0", "device-1", "device-3"]  # device-2 rejected and not scored, device-4 absent
    d0, d3 = rows["device-0"], rows["device-3"]
    assert (d0["train_examples"], d0["test_examples"], d0["global_accuracy"]) == (40, 10, 0.5)
    assert d0["speedup"] == 2.0 / 1.0 and d0["node_id"] == 101 and d0["partition_id"] == 0
    uploaded = d0["bytes_uploaded"]
    full_bytes = fleet["coord"].full_bytes
    expected = (2.0 + full_bytes / BANDWIDTH) / (1.0 + uploaded / BANDWIDTH)
    assert d0["round_speedup"] == pytest.approx(expected)
    # trained, not scored this round: its sample weight, no test split
    assert "test_examples" not in d3 and d3["train_examples"] == 40 and d3["speedup"] == 8.0 / 3.0
    for key in ("num_examples", "num-examples", "bytes-uploaded"):
        assert key not in d0  # one spelling in metrics.jsonl: the field's


def test_a_late_reply_is_dropped_and_one_pointing_back_is_rejected(fleet, caplog):
    with caplog.at_level(logging.WARNING, logger="fleet.server"):
        again = run_rounds()
    text = caplog.text
    assert "round 2: dropped a late train reply from device-4 (its phase of round 1 had closed)" in text
    assert "round 1: device device-4 missed the round (no reply within its bound of" in text
    assert "round 1: refused device device-0 (node 106): device name 'device-0' is already used" in text
    assert "round 1: evaluation from device device-2 (node 103) failed: ValueError: no test split" in text
    rec2 = again["records"][1]
    assert [r["device"] for r in rec2["rejections"]] == ["device-4"]
    assert "points against the global model's last step (cosine -1.00" in rec2["rejections"][0]["reason"]
    assert again["suspects"] == [{"device-4": 2}, {}]  # a suspect after round 2; an ordinary update: trusted again
    sent, after = again["sent"][1], again["after"][1]
    for name in TRAINED:  # the three kept: nothing to trim, their mean
        expected = np.mean([sent[name] + np.float32(s) for s in (0.1, 0.3, 0.2)], axis=0, dtype=np.float64)
        np.testing.assert_allclose(after[name], expected.astype(np.float32), rtol=0, atol=1e-6)
    assert rec2["missed"] == ["device-3"] and rec2["global_accuracy"] is None
    assert [d["device"] for d in rec2["devices"]] == ["device-0", "device-1", "device-2"]


def test_the_second_round_carries_the_signal_and_the_clock_goes_on(fleet):
    rec1, rec2, rec3 = fleet["records"]
    order = fleet["order2"]
    assert order["server-round"] == 2 and order["strategy"] == "fleet" and order["run-tag"] == "golden"
    signal = dict(zip(order["gi-names"], order["gi-values"]))
    assert set(signal) == set(fleet["coord"].names.params) and signal["conv1.weight"] == 0.0
    lr = fleet["coord"].cfg.train.lr
    moved = fleet["after"][0]["fc.bias"].astype(np.float64) - fleet["sent"][0]["fc.bias"]
    assert signal["fc.bias"] == pytest.approx(float(np.sum(moved**2)) / lr)
    assert rec2["sim_time_s"] == pytest.approx(rec1["sim_time_s"] + rec2["round_time_s"])
    assert rec3["sim_time_s"] == pytest.approx(rec2["sim_time_s"] + rec3["round_time_s"])
    assert rec3["missed"] == ["device-3"] and rec3["global_accuracy"] is None
    assert fleet["queries"] == ["104", "106"]  # benched device-3, and the refused node: asked again


def test_the_roster_is_typed_and_survives_a_checkpoint_old_or_new(fleet, tmp_path):
    coord = fleet["coord"]
    assert coord.state.roster["104"] == Member("device-3", 8.0, 8.0, missed=2)
    save_checkpoint(tmp_path, {"w": np.zeros(2, np.float32)}, coord.state)
    _, loaded = load_checkpoint(tmp_path)
    assert loaded.roster == coord.state.roster and loaded.suspects == coord.state.suspects
    import torch

    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    ckpt["meta"]["roster"] = {"7": {"name": "pi", "full_time_s": 3.0, "missed": 1}}  # saved before profile_s
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    assert load_checkpoint(tmp_path)[1].roster == {"7": Member("pi", 3.0, 3.0, missed=1)}


def test_what_a_device_round_trip_costs_widens_its_wait_bound(tmp_path):
    """A device's ClientApp start and model transfers are seconds no compute deadline sees: learned from
    the server's own timing of its replies (late ones too), they widen the bounds of rounds it is in."""
    cfg = config()
    coord = Coordinator(cfg, ServerState(run_tag="overhead"), initial_arrays(cfg))
    connected = set(NODES)
    answers = [query(n, f"device-{i}", t) for i, (n, t) in enumerate(zip(NODES, FULL_TIMES))]
    answers[0].wall_s = 20.0  # device-0's first answer took 20 s: its start and profiling
    coord.take(1, QUERY, answers, connected)
    assert coord.state.roster["101"].overhead_s == 20.0 and coord.state.roster["102"].overhead_s is None
    plan = coord.plan_round(1, coord.eligible(connected), connected)
    assert plan.train_bound_s == pytest.approx(plan.deadline_s + 20.0 + 30.0) and plan.eval_bound_s == 50.0
    late = train_reply("101", 1, coord.arrays, 0.1, **{"measured-time-s": 3.0})
    late.wall_s = 80.0  # arrived after round 1 had closed: dropped, but it says how long device-0 needs
    coord.take(2, TRAIN, [late], connected)
    assert coord.state.roster["101"].overhead_s == 77.0
    liar = train_reply("102", 2, coord.arrays, 0.1, **{"measured-time-s": 1e9})  # cannot shrink the server's clock
    liar.wall_s = 10.0
    coord.take(2, TRAIN, [liar], connected)
    assert coord.state.roster["102"].overhead_s == 0.0
    quick = evaluate_reply("101", 2, 0.5, 0.5, 10)
    quick.wall_s = 5.0  # one quick trip lowers it slowly: a bound too tight drops a healthy device
    coord.take(2, EVALUATE, [quick], connected)
    assert coord.state.roster["101"].overhead_s == pytest.approx(0.8 * 77.0)
    plan = coord.plan_round(2, ["101", "102"], connected)
    assert plan.train_bound_s == pytest.approx(plan.deadline_s + 0.8 * 77.0 + 30.0)
    save_checkpoint(tmp_path, {"w": np.zeros(2, np.float32)}, coord.state)
    assert load_checkpoint(tmp_path)[1].roster["101"].overhead_s == pytest.approx(0.8 * 77.0)
    coord.take(3, QUERY, [query("101", "device-0", 2.0)], connected)  # benched and back: still known
    assert coord.state.roster["101"].overhead_s == pytest.approx(0.8 * 77.0)


def test_the_coordinator_needs_no_flower():
    code = (
        "import sys\n"
        "from tests.test_coordinator import run_rounds\n"
        "run_rounds()\n"
        "flower = sorted(m for m in sys.modules if m.split('.')[0] in ('flwr', 'server', 'client'))\n"
        "assert not flower, flower\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

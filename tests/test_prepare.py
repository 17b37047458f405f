"""A device's message prepared before its bytes are in: the same round as made in line, for that device only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fleet.engine.experiment import make_model
from fleet.federated.on_device import tasks
from fleet.federated.on_device.device import MEASURED_PROFILE
from fleet.federated.shared import keys
from fleet.federated.shared.config import load_fleet_config
from fleet.federated.shared.packing import read_only_tensors
from fleet.federated.shared.records import TrainOrder
from fleet.federated.shared.transfer import encode


@pytest.fixture
def wire():
    return wire_of(None)


def wire_of(device: tasks.Device | None) -> dict:
    """The global model of a tiny fleet as a device reads it from a message: float16 views."""
    cfg = load_fleet_config("simulations/fleet-tiny.yaml") if device is None else device.cfg
    arrays = {k: v.numpy() for k, v in make_model(cfg.model, 0).state_dict().items()}
    return {k: np.frombuffer(v.tobytes(), v.dtype).reshape(v.shape) for k, v in encode(arrays, "float16").items()}


def device_in(folder, partition_id: int = 0) -> tasks.Device:
    cfg = load_fleet_config("simulations/fleet-tiny.yaml", {"output_dir": str(folder)})
    return tasks.Device.from_configs(cfg, {"partition-id": partition_id})


def order(server_round: int, run_tag: str = "t") -> dict:
    return TrainOrder(server_round=server_round, strategy="fleet", deadline_s=0.0, run_tag=run_tag).to_config()


def refuse(*_, **__):
    raise AssertionError("a prepared message made this again")


def train_twice(device: tasks.Device, wire, monkeypatch=None) -> list[tasks.RoundResult]:
    """The device's join and first two rounds (the second reads the state the first wrote); with ``monkeypatch``, each
    prepared ahead, and then neither its data, its state nor its setup made again."""
    tasks.query(device)  # its join: the profile measured, as a deployed device's first message does
    results = []
    for server_round in (1, 2):
        if monkeypatch is None:
            results.append(tasks.train(device, read_only_tensors(wire), order(server_round)))
            continue
        tasks.prepare(device)
        with monkeypatch.context() as m:
            for owner, name in ((tasks.Device, "data"), (tasks, "load_state"), (tasks, "device_setup")):
                m.setattr(owner, name, refuse)
            results.append(tasks.train(device, read_only_tensors(wire), order(server_round)))
    return results


def test_a_prepared_round_is_the_round_made_in_line(wire, tmp_path, monkeypatch):
    in_line = train_twice(device_in(tmp_path / "in-line"), wire)
    prepared = train_twice(device_in(tmp_path / "prepared"), wire, monkeypatch)
    for a, b in zip(in_line, prepared, strict=True):
        assert a.arrays.keys() == b.arrays.keys()
        assert all(torch.equal(a.arrays[k], b.arrays[k]) for k in a.arrays)
        assert a.metrics[keys.LOSS] == b.metrics[keys.LOSS]
    assert prepared[1].state.rounds_trained == 2  # the second round's state came from the first's, prepared ahead


def test_a_prepared_message_is_taken_only_by_its_device_and_only_once(tmp_path):
    device, other = device_in(tmp_path), device_in(tmp_path, partition_id=1)
    tasks.prepare(device)
    assert tasks.take_prepared(other) is None and tasks.take_prepared(device) is None  # the other's look drops it
    tasks.prepare(device)
    assert tasks.take_prepared(device) is not None and tasks.take_prepared(device) is None


def test_a_prepared_model_holds_exactly_the_messages_weights_and_owns_them(wire, tmp_path):
    ready_made = tasks.Prepared.made(device_in(tmp_path))
    weights = read_only_tensors(wire)
    model = ready_made.holding(weights)
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == (torch.float32 if tensor.is_floating_point() else torch.int64)
        assert torch.equal(tensor, weights[name].to(tensor.dtype))
        assert not np.shares_memory(tensor.numpy(), wire[name])
    with pytest.raises(RuntimeError, match="Missing key"):
        ready_made.holding({k: v for k, v in weights.items() if k != "fc.weight"})


def test_a_prepared_state_of_another_run_is_not_this_runs(wire, tmp_path):
    device = device_in(tmp_path)
    tasks.train(device, read_only_tensors(wire), order(1, run_tag="old"))
    ready_made = tasks.Prepared.made(device)
    assert ready_made.state_of("old").rounds_trained == 1
    fresh = ready_made.state_of("new")
    assert fresh.run_tag == "new" and fresh.rounds_trained == 0


def test_a_device_that_must_still_measure_its_profile_measures_it_on_the_messages_weights(tmp_path, monkeypatch):
    """A profile is measured by timing real steps, and a model prepared ahead holds no values yet (a zeroed
    ResNet-18 steps 7-10% faster than a trained one): a device with no profile yet leaves its setup to the
    message, which makes it once the weights are in."""
    device = device_in(tmp_path)
    seen = []
    monkeypatch.setattr(tasks, "device_setup", lambda d, model: seen.append(model.fc.weight.abs().sum().item()))
    tasks.prepare(device)
    assert seen == []  # nothing known yet: nothing measured ahead
    ready_made = tasks.take_prepared(device)
    ready_made.holding(read_only_tensors(wire_of(device)))
    ready_made.setup  # noqa: B018
    assert seen and seen[0] > 0  # measured on the message's weights
    (device.profile_dir / MEASURED_PROFILE).parent.mkdir(parents=True, exist_ok=True)
    (device.profile_dir / MEASURED_PROFILE).write_text("kept")
    tasks.prepare(device)
    assert seen[1:] == [0.0]  # a profile to read: read ahead, on the prepared model

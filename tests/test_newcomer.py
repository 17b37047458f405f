"""A device that never took part personalizes from the global model: accuracy against device time."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fleet.engine.experiment import make_model
from fleet.engine.models import model_meta
from fleet.federated.launch.newcomer import personalize_newcomer
from fleet.federated.shared.config import load_fleet_config
from tests.conftest import proportional_profile

TINY = "simulations/fleet-tiny.yaml"


def tiny_start(tmp_path):
    """fleet-tiny with a rotation shift, a fresh model's weights and a profile of it: a new device's start."""
    cfg = load_fleet_config(TINY, {"output_dir": str(tmp_path), "devices.shift.rotation_deg": 45})
    model = make_model(cfg.model, 0)
    m = cfg.model
    meta = model_meta(m.name, m.num_classes, m.in_channels, m.small_input)
    profile = proportional_profile(model, cfg.train.batch_size, cfg.data.input_size, meta=meta)
    return cfg, {k: v.clone() for k, v in model.state_dict().items()}, profile


def test_each_method_records_accuracy_against_the_device_time_it_spent(tmp_path):
    cfg, weights, profile = tiny_start(tmp_path)
    curves = personalize_newcomer(cfg, weights, partition_id=3, profile=profile, epochs=2)
    assert set(curves) == {"full", "tl", "bn_bias", "elastic"}
    starts = {c[0]["accuracy"] for c in curves.values()}
    assert len(starts) == 1  # every method starts from the same global model
    for curve in curves.values():
        times = [p["device_time_s"] for p in curve]
        assert len(curve) == 3 and times[0] == 0 and times == sorted(times) and times[-1] > 0
        assert all(0 <= p["accuracy"] <= 1 and 0 <= p["distribution_accuracy"] <= 1 for p in curve)
    tier = cfg.devices.tiers[3 % len(cfg.devices.tiers)]
    epoch_full = curves["full"][1]["device_time_s"]
    assert epoch_full == pytest.approx(tier * profile.full_step_time * 3)  # 48 samples: 3 batches of 16
    # A training probe every epoch (fleet-tiny's interval 1): its batch costs two full steps instead of one
    # elastic step; the epoch's other two batches are elastic.
    probes = 2 * 2 * tier * profile.full_step_time
    elastic = curves["elastic"][-1]["device_time_s"]
    assert curves["tl"][-1]["device_time_s"] < elastic - probes < 0.75 * 2 * 2 / 3 * epoch_full  # rho 0.5, its floor


def test_batch_orders_average_each_methods_curve_and_the_first_order_is_the_single_one(tmp_path, monkeypatch):
    """Two batch orders: each method trains twice from the same start, shuffled by two seeds; its curve is the mean
    of the two, the first is what one order gives, and the second differs from it (else the mean hides nothing)."""
    import fleet.federated.launch.newcomer as newcomer
    from fleet.base.errors import ConfigError

    cfg, weights, profile = tiny_start(tmp_path)
    run = dict(partition_id=3, profile=profile, epochs=2, methods=("full",), lr=0.05)
    first = personalize_newcomer(cfg, weights, **run)["full"]
    seen, curve = [], newcomer.curve

    def recorded(trainer, *args):
        seen.append((trainer.config.seed, curve(trainer, *args)))
        return seen[-1][1]

    monkeypatch.setattr(newcomer, "curve", recorded)
    both = personalize_newcomer(cfg, weights, **run, orders=2)["full"]
    assert [s for s, _ in seen] == [cfg.train.seed, cfg.train.seed + newcomer.ORDER_SEED_STEP]
    assert seen[0][1] == first and [p["accuracy"] for p in seen[1][1]] != [p["accuracy"] for p in first]
    for got, a, b in zip(both, first, seen[1][1], strict=True):
        assert got == pytest.approx({k: (a[k] + b[k]) / 2 for k in a})
    with pytest.raises(ConfigError, match="^orders: 0 is not allowed"):
        personalize_newcomer(cfg, weights, **run, orders=0)


def test_a_mean_curve_keeps_the_shared_keys_and_the_shortest_length():
    from fleet.federated.launch.newcomer import mean_curve

    a = [{"accuracy": 0.2, "device_time_s": 0.0, "distribution_accuracy": 0.1}, {"accuracy": 0.6, "device_time_s": 2.0}]
    b = [{"accuracy": 0.4, "device_time_s": 0.0}, {"accuracy": 0.8, "device_time_s": 4.0}, {"accuracy": 1.0}]
    assert mean_curve([a, b]) == [
        {"accuracy": pytest.approx(0.3), "device_time_s": 0.0},
        {"accuracy": pytest.approx(0.7), "device_time_s": 3.0},
    ]


def test_newcomers_leave_some_devices_to_take_part_and_the_sample_counts_only_those():
    from fleet.base.errors import ConfigError
    from fleet.federated.launch.prepare import simulated_fleet

    with pytest.raises(ConfigError, match="^devices.newcomers: 4 leaves none of the 4 devices"):
        load_fleet_config(TINY, {"devices.newcomers": 4})
    cfg = load_fleet_config(TINY, {"devices.newcomers": 2, "federation.devices_per_round": 3})
    assert cfg.devices.taking_part == 2
    with pytest.raises(ConfigError, match="^federation.devices_per_round: 3 is more than the 2 simulated devices"):
        simulated_fleet(cfg, log=lambda s: None)


def test_a_profile_of_another_model_is_refused_before_any_training(tmp_path):
    from fleet.base.errors import FleetError

    cfg = load_fleet_config(TINY, {"output_dir": str(tmp_path)})
    model = make_model(cfg.model, 0)
    other = make_model(dataclasses.replace(cfg.model, num_classes=5), 0)  # another head
    profile = proportional_profile(other, cfg.train.batch_size, cfg.data.input_size)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(FleetError, match="does not match the model: fc.weight has shape"):
        personalize_newcomer(cfg, weights, partition_id=3, profile=profile, epochs=1)


class ConstantModel(torch.nn.Module):
    """Always answers ``label``."""

    def __init__(self, label: int, classes: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.label, self.classes = label, classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.full((len(x),), self.label), self.classes).float() + 0 * self.w


def test_the_distribution_accuracy_weights_each_class_by_the_devices_share_of_it():
    from fleet.data.datasets import ArrayDataset
    from fleet.federated.launch.newcomer import distribution_accuracy

    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2])  # unequal counts: a plain accuracy would be 0.3 for class 0
    test = ArrayDataset(torch.zeros(10, 1, 4, 4, dtype=torch.uint8), labels, 4, (0.5,), (0.5,), "t")
    mix = torch.tensor([0.7, 0.2, 0.1, 0.0], dtype=torch.float64)
    assert distribution_accuracy(ConstantModel(0, 4), test, mix, None) == pytest.approx(0.7)
    assert distribution_accuracy(ConstantModel(2, 4), test, mix, None) == pytest.approx(0.1)
    # A class the test split lacks counts as wrong, however much of the mix it holds
    assert distribution_accuracy(ConstantModel(3, 4), test, torch.tensor([0, 0, 0, 1.0]), None) == 0


def test_the_distribution_test_is_the_whole_test_split_in_the_devices_domain_and_its_label_mix(tmp_path):
    from fleet.federated.launch.newcomer import distribution_test
    from fleet.federated.shared.split import device_data

    cfg = load_fleet_config(TINY, {"output_dir": str(tmp_path), "devices.shift.rotation_deg": 45})
    data = device_data(cfg, 3)
    test, mix = distribution_test(cfg, 3, data)
    assert len(test) > len(data.test) and "domain" in test.name
    own = torch.bincount(torch.cat([data.train.labels, data.test.labels]), minlength=cfg.model.num_classes)
    assert mix.sum().item() == pytest.approx(1.0) and torch.equal(mix > 0, own > 0)

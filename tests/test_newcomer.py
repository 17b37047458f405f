"""A device that never took part personalizes from the global model: accuracy against device time."""

from __future__ import annotations

import dataclasses

import pytest

from fleet.engine.experiment import make_model
from fleet.engine.models import model_meta
from fleet.federated.config import load_fleet_config
from fleet.federated.newcomer import personalize_newcomer
from tests.conftest import proportional_profile

TINY = "simulations/fleet-tiny.yaml"


def test_each_method_records_accuracy_against_the_device_time_it_spent(tmp_path):
    cfg = load_fleet_config(TINY, {"output_dir": str(tmp_path), "devices.shift.rotation_deg": 45})
    model = make_model(cfg.model, 0)
    m = cfg.model
    meta = model_meta(m.name, m.num_classes, m.in_channels, m.small_input)
    profile = proportional_profile(model, cfg.train.batch_size, cfg.data.input_size, meta=meta)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    curves = personalize_newcomer(cfg, weights, partition_id=3, profile=profile, epochs=2)
    assert set(curves) == {"full", "tl", "bn_bias", "elastic"}
    starts = {c[0]["accuracy"] for c in curves.values()}
    assert len(starts) == 1  # every method starts from the same global model
    for curve in curves.values():
        times = [p["device_time_s"] for p in curve]
        assert len(curve) == 3 and times[0] == 0 and times == sorted(times) and times[-1] > 0
        assert all(0 <= p["accuracy"] <= 1 for p in curve)
    tier = cfg.devices.tiers[3 % len(cfg.devices.tiers)]
    epoch_full = curves["full"][1]["device_time_s"]
    assert epoch_full == pytest.approx(tier * profile.full_step_time * 3)  # 48 samples: 3 batches of 16
    # A training probe every epoch (fleet-tiny's interval 1): its batch costs two full steps instead of one
    # elastic step; the epoch's other two batches are elastic.
    probes = 2 * 2 * tier * profile.full_step_time
    elastic = curves["elastic"][-1]["device_time_s"]
    assert curves["tl"][-1]["device_time_s"] < elastic - probes < 0.75 * 2 * 2 / 3 * epoch_full  # rho 0.5, its floor


def test_newcomers_leave_some_devices_to_take_part_and_the_sample_counts_only_those():
    from fleet.base.errors import ConfigError
    from fleet.federated.prepare import simulated_fleet

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

"""A device's local round: rho from its own profile, window, blending, what it uploads; config errors."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch

from fleet.base.errors import BudgetError, ConfigError, FleetError
from fleet.engine.experiment import make_model
from fleet.engine.models import model_meta
from fleet.engine.policies import blend_importance, fitted_window_mask, select_in_window, window_mask, window_position
from fleet.federated.on_device import tasks
from fleet.federated.on_device.device import device_memory, memory_budget_of
from fleet.federated.on_device.round import DeviceRound, RoundResult, drop_stale_momentum, rho_floor, step_budget
from fleet.federated.on_server.aggregate import round_deadline
from fleet.federated.shared import keys
from fleet.federated.shared.config import fleet_config_from_dict, load_fleet_config
from fleet.federated.shared.records import TrainOrder
from fleet.federated.shared.split import device_data, fleet_indices
from fleet.federated.shared.transfer import wire_bytes
from tests.conftest import proportional_profile

TINY = "simulations/fleet-tiny.yaml"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    cfg = load_fleet_config(TINY, {"output_dir": str(tmp_path_factory.mktemp("runs"))})
    model = make_model(cfg.model, 0)
    m = cfg.model
    meta = model_meta(m.name, m.num_classes, m.in_channels, m.small_input)
    # Size-proportional timings, not measured ones: the selections these tests assert on are then
    # the same on every machine, however loaded.
    profile = proportional_profile(model, cfg.train.batch_size, cfg.data.input_size, meta=meta)
    return cfg, profile


def train_round(cfg, model, profile, data, plan, memory=None) -> RoundResult:
    """Device 1's training round from no earlier state."""
    return DeviceRound(cfg, model, profile, data, 1, memory=memory).train(plan)


def test_step_budget_follows_deadline_and_profile_with_floor(setup):
    cfg, profile = setup
    steps = cfg.federation.local_steps
    slow = profile.scaled(2.0)
    full = steps * profile.full_step_time  # half of what the slow device needs: rho 0.5
    assert step_budget(cfg, slow, full, steps) + slow.forward_time == pytest.approx(0.5 * slow.full_step_time)
    slowest = profile.scaled(100.0)
    floor = rho_floor(cfg, slowest)
    assert floor == pytest.approx(profile.min_rho + cfg.elastic.min_rho_margin)
    budget = step_budget(cfg, slowest, full, steps)  # clamped to the floor
    assert budget + slowest.forward_time == pytest.approx(floor * slowest.full_step_time)


def test_window_slides_to_input_and_rolls_back():
    names = [f"t{i}" for i in range(8)] + ["fc.weight"]
    head = {"fc.weight"}
    wins = [window_mask(names, head, 4, 2, r) for r in range(1, 6)]
    # 9 tensors in 4 blocks (3,2,2,2); 3 window positions; head always in
    assert all(w[-1] for w in wins)
    assert [i for i, m in enumerate(wins[0]) if m] == [5, 6, 7, 8]  # output side first
    assert [i for i, m in enumerate(wins[2]) if m] == [0, 1, 2, 3, 4, 8]  # reached the input side
    assert wins[3] == wins[0]  # rolled back


def test_pingpong_window_walks_back_instead_of_jumping():
    assert [window_position(r, 4) for r in range(1, 10)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert [window_position(r, 4, "pingpong") for r in range(1, 10)] == [0, 1, 2, 3, 2, 1, 0, 1, 2]
    assert [window_position(r, 1, "pingpong") for r in range(1, 4)] == [0, 0, 0]
    names = [f"t{i}" for i in range(8)] + ["fc.weight"]
    assert window_mask(names, {"fc.weight"}, 4, 2, 4, "pingpong") == window_mask(names, {"fc.weight"}, 4, 2, 2)


def test_fitted_window_widens_while_it_fits_and_keeps_its_front():
    names = [f"t{i}" for i in range(8)] + ["fc.weight"]
    head = {"fc.weight"}
    # round 3: the scheduled window is blocks 0-1 (tensors 0-4); a budget of 7 tensors widens it by one block
    fits = lambda m: sum(m) <= 8  # noqa: E731  (7 tensors plus the head)
    got = fitted_window_mask(names, head, 4, 2, 3, fits)
    assert [i for i, m in enumerate(got) if m] == [0, 1, 2, 3, 4, 5, 6, 8]
    # the scheduled window exactly: its first block fits but no more
    tight = lambda m: sum(m) <= 4  # noqa: E731  (block 0 is tensors 0-2, plus the head)
    assert fitted_window_mask(names, head, 4, 2, 3, tight) == window_mask(names, head, 4, 2, 3)
    # a device that cannot train even one block whole at the input side slides toward the output
    assert fitted_window_mask(names, head, 4, 2, 3, lambda m: False) == window_mask(names, head, 4, 1, 1)
    shallow = lambda m: not any(m[:5]) and sum(m) <= 3  # noqa: E731  (blocks 0-1 are too deep to reach)
    got = fitted_window_mask(names, head, 4, 2, 3, shallow)
    assert [i for i, m in enumerate(got) if m] == [5, 6, 7, 8]
    # round 1 (output side) widens toward the input once the output end is reached
    got = fitted_window_mask(names, head, 4, 2, 1, fits)
    assert [i for i, m in enumerate(got) if m] == [3, 4, 5, 6, 7, 8]


def test_window_cover_then_most_important_elsewhere():
    ranked = [0.9, -0.2, 0.1, 0.5, 1.0]
    window = [False, True, True, False, False]
    dw, dy = [1.0] * 5, [0.0] * 5
    # only: the DP stays inside the window, and a tensor of negative importance is not worth training
    assert select_in_window(ranked, window, dw, dy, 3.1, "only") == [False, False, True, False, False]
    # cover: the whole window (it fits), then the most important tensor elsewhere with what is left
    assert select_in_window(ranked, window, dw, dy, 3.1, "cover") == [False, True, True, False, True]
    assert select_in_window(ranked, window, dw, dy, 4.1, "cover") == [True, True, True, False, True]
    # a window that does not fit: as many of its tensors as fit, even against one more important big one ...
    big, wide = [1.0, 1.0, 3.0, 1.0, 1.0], [False, True, True, True, False]
    assert select_in_window([0.0, 0.1, 0.9, 0.1, 0.0], wide, big, dy, 3.05, "cover") == [
        False,
        True,
        False,
        True,
        False,
    ]
    assert select_in_window([0.0, 0.1, 0.9, 0.1, 0.0], wide, big, dy, 3.05, "only") == [
        False,
        False,
        True,
        False,
        False,
    ]
    # ... with importance breaking ties between equally many
    assert select_in_window([0.0, 0.1, 0.5, 0.3, 0.0], wide, dw, dy, 2.05, "cover") == [False, False, True, True, False]
    # nothing outside the window of no use is picked
    assert select_in_window([-1.0, 1.0], [False, True], [1.0, 1.0], [0.0, 0.0], 5.0) == [False, True]


def test_stale_momentum_is_dropped_for_tensors_that_sat_out():
    """Regression: momentum of a tensor that was not trained last round used to survive and kick
    it (about 7 steps' worth, in a stale direction) when the sliding window brought it back."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([a, b], lr=0.1, momentum=0.9)
    (a.sum() + b.sum()).backward()
    opt.step()
    assert set(opt.state) == {a, b}
    drop_stale_momentum(opt, ["a", "b"], [a, b], ["a"])
    assert a in opt.state and b not in opt.state
    drop_stale_momentum(opt, ["a", "b"], [a, b], None)  # no record: nothing dropped
    assert a in opt.state


def test_momentum_saved_in_float16_halves_the_file_and_restores_within_float16s_precision(tmp_path):
    from fleet.base.atomic import load_torch, save_torch
    from fleet.federated.on_device.device import stored_optimizer

    a, b = torch.nn.Parameter(torch.ones(65536)), torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([a, b], lr=0.1, momentum=0.9)
    a.grad, b.grad = torch.linspace(-3.0, 3.0, 65536), torch.tensor([1e6, 1.0, 2.0, 3.0])  # b: beyond float16
    opt.step()
    full, half = tmp_path / "full.pt", tmp_path / "half.pt"
    save_torch(full, opt.state_dict())
    save_torch(half, stored_optimizer(opt.state_dict(), "float16"))
    assert half.stat().st_size < 0.55 * full.stat().st_size
    assert stored_optimizer(opt.state_dict(), "float32")["state"][0]["momentum_buffer"].dtype == torch.float32
    restored = torch.optim.SGD([a, b], lr=0.1, momentum=0.9)
    restored.load_state_dict(load_torch(half))
    buf, exact = restored.state[a]["momentum_buffer"], opt.state[a]["momentum_buffer"]
    assert buf.dtype == torch.float32
    assert torch.allclose(buf, exact, rtol=1e-3, atol=1e-7) and not torch.equal(buf, exact)
    assert torch.equal(restored.state[b]["momentum_buffer"], opt.state[b]["momentum_buffer"])  # kept float32


def test_blend_mixes_normalized_signals():
    out = blend_importance([1.0, 0.0], ["a", "b"], {"a": 0.0, "b": 50.0}, beta=0.6)
    assert out == pytest.approx([0.6, 0.4])


def test_a_round_uploads_only_trained_tensors(setup):
    cfg, profile = setup
    cfg = dataclasses.replace(
        cfg, federation=dataclasses.replace(cfg.federation, deadline_includes_upload=False, local_steps=10)
    )
    slow = profile.scaled(2.0)
    model = make_model(cfg.model, 0)
    data = device_data(cfg, 1)
    deadline = cfg.federation.local_steps * profile.full_step_time
    plan = TrainOrder(server_round=1, strategy="fleet", deadline_s=deadline)
    res = train_round(cfg, model, slow, data.train, plan)
    m = res.metrics
    params = {n for n, _ in model.named_parameters()}
    trained = [n for n in res.arrays if n in params]
    assert 0 < m["selected"] < m["num-tensors"] and len(trained) == m["selected"]
    assert m["bytes-uploaded"] == sum(wire_bytes(a, cfg.federation.transfer) for a in res.arrays.values())
    # the importance probe (about two full steps) is paid out of the deadline, not on top of it
    assert m["predicted-time-s"] <= deadline + 1e-9
    assert m["rho"] < 0.5
    assert m["full-time-s"] == pytest.approx(cfg.federation.local_steps * slow.full_step_time)
    assert len(res.state.importance) == m["num-tensors"]
    # compact state: no shared tensor (the next global model brings them back), momentum of the trained ones only
    assert res.state.personal == {} and res.personalized.keys() == model.state_dict().keys()
    assert len(res.state.optimizer["state"]) == m["selected"]
    # FedAvg trains and uploads every tensor: its order carries no deadline (aggregate.round_deadline decides so)
    fedavg = dataclasses.replace(plan, strategy="fedavg", deadline_s=round_deadline("fedavg", None, 1.0, {"n": 1.0}))
    full = train_round(cfg, make_model(cfg.model, 0), slow, data.train, fedavg)
    assert full.metrics["selected"] == full.metrics["num-tensors"] and full.metrics["rho"] == 1.0


def test_window_cover_spends_the_budget_the_window_leaves(setup):
    """A slow device whose window sits at the input side trains that window and, with ``cover``,
    adds the most important tensors elsewhere with the rest of its budget; ``only`` idles it."""
    cfg, profile = setup
    cfg = dataclasses.replace(
        cfg, federation=dataclasses.replace(cfg.federation, deadline_includes_upload=False, local_steps=10)
    )
    slow = profile.scaled(2.0)
    deadline = 0.7 * cfg.federation.local_steps * slow.full_step_time
    data = device_data(cfg, 1).train
    plan = TrainOrder(server_round=3, strategy="fleet", deadline_s=deadline)  # the window's input-side position

    def trained(mode: str) -> tuple[set[str], dict]:
        c = dataclasses.replace(cfg, elastic=dataclasses.replace(cfg.elastic, window=True, window_mode=mode))
        res = train_round(c, make_model(cfg.model, 0), slow, data, plan)
        return set(res.state.trained), res.metrics

    only, m_only = trained("only")
    cover, m_cover = trained("cover")
    assert only and only < cover  # the same window, plus tensors outside it
    assert m_only["predicted-time-s"] < m_cover["predicted-time-s"] <= deadline + 1e-9


def test_probe_round_meets_the_deadline(setup):
    """Regression: a device that re-probes importance used to add the probe (two full steps) on top
    of its budget, so slow devices overran the round deadline on every probe round."""
    cfg, profile = setup
    cfg = dataclasses.replace(
        cfg, federation=dataclasses.replace(cfg.federation, deadline_includes_upload=False, local_steps=10)
    )
    slow = profile.scaled(2.0)
    deadline = 0.8 * cfg.federation.local_steps * slow.full_step_time
    plan = TrainOrder(server_round=1, strategy="naive", deadline_s=deadline)
    m = train_round(cfg, make_model(cfg.model, 0), slow, device_data(cfg, 1).train, plan).metrics
    assert m["predicted-time-s"] <= deadline + 1e-9
    assert m["predicted-time-s"] >= 2.0 * slow.full_step_time  # the probe was charged


def test_deadline_with_upload_covers_compute_and_upload(setup):
    """With ``deadline_includes_upload`` the device's compute plus its own upload fits the deadline,
    and a device fast enough to train and upload everything trains fully."""
    cfg, profile = setup
    fed = cfg.federation
    model = make_model(cfg.model, 0)
    floats = [v for v in model.state_dict().values() if v.is_floating_point()]
    total_bytes = sum(wire_bytes(v, fed.transfer) for v in floats)  # as they cross (federation.transfer)
    deadline = fed.local_steps * profile.full_step_time + total_bytes / cfg.devices.bandwidth_bytes_per_s
    data = device_data(cfg, 1).train
    fast = train_round(cfg, model, profile, data, TrainOrder(1, "fleet", deadline)).metrics
    assert fast["selected"] == fast["num-tensors"] and fast["rho"] == 1.0
    assert fast["predicted-time-s"] + fast["bytes-uploaded"] / cfg.devices.bandwidth_bytes_per_s == pytest.approx(
        deadline
    )
    slow = profile.scaled(2.0)
    m = train_round(cfg, make_model(cfg.model, 0), slow, data, TrainOrder(1, "fleet", deadline)).metrics
    assert 0 < m["selected"] < m["num-tensors"]
    assert m["predicted-time-s"] + m["bytes-uploaded"] / cfg.devices.bandwidth_bytes_per_s <= deadline + 1e-9


def test_memory_budget_comes_from_node_config_then_profile_then_config(setup):
    cfg, profile = setup
    c = dataclasses.replace(cfg, devices=dataclasses.replace(cfg.devices, memory_budgets_mb=[0.0, 40.0]))
    assert memory_budget_of(cfg, 1, {}, profile) is None
    assert memory_budget_of(c, 0, {}, profile) is None  # 0: unlimited
    assert memory_budget_of(c, 1, {}, profile) == 40.0
    own = dataclasses.replace(profile, memory_budget_mb=25.0)
    assert memory_budget_of(c, 1, {}, own) == 25.0
    assert memory_budget_of(c, 1, {"memory-budget-mb": "12.5"}, own) == 12.5
    with pytest.raises(ConfigError, match="node config memory-budget-mb: 'lots'"):
        memory_budget_of(c, 1, {"memory-budget-mb": "lots"}, own)


def test_a_device_with_a_bad_node_config_is_refused_when_it_joins(setup, tmp_path):
    """Its query answer reads its memory budget and checks its profile against the fleet's model, so a
    bad value is the refusal's reason at join, not a failure in every round it is later sampled for."""
    cfg, profile = setup
    own = profile.save(tmp_path / "own.yaml")
    other = make_model(dataclasses.replace(cfg.model, name="mobilenet_v2"), 0)
    alien = proportional_profile(other, cfg.train.batch_size, cfg.data.input_size).save(tmp_path / "alien.yaml")
    base = {"partition-id": 1, "profile": str(own)}
    assert tasks.query(tasks.Device.from_configs(cfg, base))["full-time-s"] > 0
    tasks.query(tasks.Device.from_configs(cfg, {**base, "state-dir": str(tmp_path / "new" / "state")}))
    assert (tmp_path / "new" / "state").is_dir()  # a state-dir not there yet is made at join
    # a device told its uplink plans its upload at it; without, at the fleet's
    assert tasks.Device.from_configs(cfg, {**base, "uplink-mbps": 20}).bandwidth == 20e6 / 8
    assert tasks.Device.from_configs(cfg, base).bandwidth == cfg.devices.bandwidth_bytes_per_s
    for extra, message in (
        ({"memory-budget-mb": "lots"}, "node config memory-budget-mb: 'lots' is not allowed"),
        ({"memory-budget-mb": -5}, "node config memory-budget-mb: -5 is not allowed"),
        ({"profile": str(alien)}, f"profile {alien} (node config profile)"),
        ({"uplink-mbps": "fast"}, "node config uplink-mbps: 'fast' is not allowed"),
        ({"state-dir": str(own)}, f"node config state-dir: {str(own)!r} cannot be made"),  # a file, not a folder
        ({"state-dir": str(own / "s")}, f"node config state-dir: {str(own / 's')!r} cannot be made"),
    ):
        with pytest.raises(FleetError, match=re.escape(message)):  # the refusal's reason, in one line
            tasks.query(tasks.Device.from_configs(cfg, {**base, **extra}))


def test_a_deployed_device_measures_its_activation_memory_when_it_joins_once_for_every_run(setup, tmp_path):
    """Measured once, at its query, and kept beside its runs' state: its first train message starts as warm as
    the later ones (a fifth of a core once spent 13 s of its first round on it), and its next run's join does not
    measure again (a pi4 at 48 px: about 30 s)."""
    cfg, profile = setup
    node = {"partition-id": 1, "profile": str(profile.save(tmp_path / "own.yaml")), "state-dir": str(tmp_path / "s")}
    kept = tmp_path / "s" / "profiles" / "memory-profile.json"
    tasks.query(tasks.Device.from_configs(cfg, node, long_lived=True))
    tasks.query(tasks.Device.from_configs(cfg, node))
    assert not kept.exists()  # a simulation worker, or a device without a budget: nothing to measure
    tasks.query(tasks.Device.from_configs(cfg, {**node, "memory-budget-mb": 40}))
    measured = kept.stat().st_mtime_ns
    assert json.loads(kept.read_text())["blocks"] and not (tmp_path / "s" / cfg.name / "memory-profile.json").exists()
    another_run = dataclasses.replace(cfg, name=f"{cfg.name}-next")
    tasks.query(tasks.Device.from_configs(another_run, {**node, "memory-budget-mb": 40}))
    assert kept.stat().st_mtime_ns == measured  # read back, not measured again


def test_round_under_a_memory_budget(setup, tmp_path):
    """A device with half the activation memory of a full step: every step (and the probe) runs the
    plan, the measured peak stays within the budget, and the plan's added time is on the clock."""
    cfg, profile = setup
    cfg = dataclasses.replace(
        cfg, federation=dataclasses.replace(cfg.federation, deadline_includes_upload=False, local_steps=4)
    )
    model = make_model(cfg.model, 0)
    memory = device_memory(cfg, model, 1000.0, tmp_path, {}, tmp_path)
    assert (tmp_path / "memory-profile.json").is_file()
    again = device_memory(cfg, model, 1000.0, tmp_path, {}, tmp_path)
    assert again.profile == memory.profile  # measured once per device, then read back
    memory.budget_bytes = budget = int(0.5 * memory.profile.unconstrained_peak_bytes)
    data = device_data(cfg, 1).train
    full = train_round(cfg, model, profile, data, TrainOrder(1, "fedavg", 0.0), memory).metrics
    assert full["selected"] == full["num-tensors"]
    assert full["memory-budget-bytes"] == budget and 0 < full["memory-peak-bytes"] <= budget
    assert full["memory-added-s"] > 0
    assert full["predicted-time-s"] == pytest.approx(full["steps"] * (profile.full_step_time + full["memory-added-s"]))
    # an elastic round: plan overhead and probe fit the deadline together
    cfg = dataclasses.replace(cfg, federation=dataclasses.replace(cfg.federation, local_steps=10))
    slow = profile.scaled(2.0)
    deadline = 0.8 * cfg.federation.local_steps * slow.full_step_time
    m = train_round(cfg, make_model(cfg.model, 0), slow, data, TrainOrder(1, "naive", deadline), memory).metrics
    assert 0 < m["selected"] < m["num-tensors"] and m["predicted-time-s"] <= deadline + 1e-9
    assert list(tmp_path.glob("spill/*")) == []  # spill files cleaned up
    memory.budget_bytes, memory.plans = 1000, {}
    with pytest.raises(BudgetError, match="memory-budget-mb"):
        train_round(cfg, make_model(cfg.model, 0), profile, data, TrainOrder(1, "fedavg", 0.0), memory)


def test_partitions_are_disjoint_and_hold_out_pretraining_data():
    cfg = fleet_config_from_dict(
        {"data": {"dataset": "synthetic"}, "devices": {"num_devices": 4}, "start": {"samples": 100}}
    )
    labels = torch.arange(2000).remainder(10).numpy()
    pre, parts = fleet_indices(cfg, labels)
    everything = [set(pre.tolist())] + [set(p.tolist()) for p in parts]
    assert len(pre) == 100 and sum(len(s) for s in everything) == 2000
    assert len(set().union(*everything)) == 2000  # disjoint, nothing dropped


def test_pretraining_from_other_classes_holds_out_only_those():
    cfg = fleet_config_from_dict(
        {
            "data": {"dataset": "synthetic"},
            "devices": {"num_devices": 4},
            "start": {"samples": 100, "classes": [0, 1, 2]},
        }
    )
    labels = torch.arange(2000).remainder(10).numpy()
    pre, parts = fleet_indices(cfg, labels)
    assert len(pre) == 100 and set(labels[pre].tolist()) == {0, 1, 2}
    rest = np.concatenate(parts)
    assert len(rest) + 100 == 2000 and not set(pre.tolist()) & set(rest.tolist())
    assert set(labels[rest].tolist()) == set(range(10))  # the fleet still learns every class


@pytest.mark.parametrize(
    "data, field",
    [
        ({"federation": {"strategy": "fedprox"}}, "federation.strategy"),
        ({"devices": {"tiers": [0.5]}}, "devices.tiers"),
        ({"elastic": {"window_blocks": 9, "num_blocks": 4}}, "elastic.window_blocks"),
        ({"federation": {"rounds": "many"}}, "federation.rounds"),
        ({"elastic": {"blend_beta": 2}}, "elastic.blend_beta"),
        ({"federation": {"speed": 1}}, "federation.speed"),
        ({"start": {"classes": [3, 12]}}, "start.classes"),
        ({"start": {"classes": [1, 1]}}, "start.classes"),
    ],
)
def test_bad_federation_field_is_one_clear_line(data, field):
    with pytest.raises(ConfigError) as exc:
        fleet_config_from_dict(data)
    assert str(exc.value).startswith(field) and "\n" not in str(exc.value)


def test_a_probe_is_skipped_when_it_would_cost_more_than_the_round_must_shed():
    from fleet.federated.on_device.round import RoundBudget, probe_pays

    nearly = RoundBudget(deadline_s=9.5, full_time_s=9.0, upload_s=[0.5, 0.5], buffers_s=0.1)  # 0.6 s short
    assert not probe_pays(nearly, probe_s=1.8)  # a 2-step probe costs more than the whole cut
    tight = RoundBudget(deadline_s=5.0, full_time_s=9.0, upload_s=[0.5, 0.5], buffers_s=0.1)  # 5.1 s short
    assert probe_pays(tight, probe_s=1.8)


def test_a_probe_is_skipped_when_it_would_push_the_round_past_its_deadline():
    from fleet.federated.on_device.round import RoundBudget, probe_fits

    # a 4x-slow device: 17 s of full training, its cheapest selection 0.24 of it (4.1 s), a 3.4 s probe
    slow = RoundBudget(deadline_s=6.05, full_time_s=17.06, upload_s=[0.5], buffers_s=0.01)
    assert not probe_fits(slow, probe_s=3.41, floor=0.24)  # 7.5 s: the fleet would wait 1.4 s for it
    quicker = RoundBudget(deadline_s=6.05, full_time_s=12.79, upload_s=[0.5], buffers_s=0.01)
    assert probe_fits(quicker, probe_s=2.56, floor=0.26)  # 5.9 s
    assert probe_fits(RoundBudget(deadline_s=0, full_time_s=17.06, upload_s=[], buffers_s=0), 3.41, 0.24)


def test_a_profile_file_is_read_once_per_process_until_it_changes(setup, tmp_path):
    """A simulation worker serves every device's messages from one profile file: it is parsed and
    checked once, and a rewritten file (a re-profiled device) is read again."""
    from fleet.federated.on_device.device import device_profile

    cfg, profile = setup
    path = tmp_path / "profile.yaml"
    profile.save(path)
    cfg = dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, profile=str(path)))
    model = make_model(cfg.model, 0)
    first = device_profile(cfg, model, {}, tmp_path)
    assert device_profile(cfg, model, {}, tmp_path) is first
    dataclasses.replace(profile, t_fw=profile.t_fw * 3).save(path)
    again = device_profile(cfg, model, {}, tmp_path)
    assert again is not first and again.full_step_time > first.full_step_time


def test_device_state_is_a_record_on_disk_and_reads_the_dict_earlier_versions_saved(tmp_path):
    """The state file is the record's fields as a plain dict (loaded with weights_only); a state saved as the
    dict of earlier versions loads as the record, and a foreign, damaged or other run's file is ignored."""
    from fleet.base.atomic import save_torch
    from fleet.federated.on_device.device import DeviceState, load_state, save_state

    path = tmp_path / "state.pt"
    state = DeviceState(
        run_tag="t", round=3, rounds_trained=2, importance=[0.5, 1.0], importance_round=3, trained=["a"]
    )
    save_state(path, state)
    assert load_state(path, "t") == state and load_state(path) == state
    assert load_state(path, "another run") is None
    old = {"round": 2, "rounds_trained": 1, "optimizer": {"state": {}, "param_groups": []}, "run_tag": "t"}
    old |= {"personal": {"w": torch.ones(2)}, "importance": [1.0], "importance_round": 2, "trained": []}
    save_torch(path, old)
    loaded = load_state(path, "t")
    assert loaded.rounds_trained == 1 and loaded.trained == [] and torch.equal(loaded.personal["w"], torch.ones(2))
    save_torch(path, {"round": 2, "importance": "lots", "run_tag": "t"})
    assert load_state(path, "t") is None
    save_torch(path, {"round": 2, "importance": [1.0]})  # no run tag: belongs to no run
    assert load_state(path, "t") is None and load_state(path).round == 2
    path.write_bytes(b"not a torch file")
    assert load_state(path, "t") is None


def test_a_second_round_starts_from_the_state_the_first_kept(setup):
    """The next round reads the state the first kept: its importance (not yet due again), its count."""
    cfg, profile = setup
    cfg = dataclasses.replace(
        cfg,
        federation=dataclasses.replace(cfg.federation, deadline_includes_upload=False, local_steps=10),
        elastic=dataclasses.replace(cfg.elastic, importance_interval=2),
    )
    slow = profile.scaled(2.0)
    data = device_data(cfg, 1).train
    plan = TrainOrder(1, "naive", 0.6 * cfg.federation.local_steps * slow.full_step_time)
    first = train_round(cfg, make_model(cfg.model, 0), slow, data, plan)
    assert first.state.round == 1 and first.state.rounds_trained == 1 and first.state.importance_round == 1
    assert 0 < len(first.state.trained) < first.metrics["num-tensors"]
    again = DeviceRound(cfg, make_model(cfg.model, 0), slow, data, 1, first.state)
    second = again.train(dataclasses.replace(plan, server_round=2))
    assert second.metrics["rounds-trained"] == 2 and second.state.importance_round == 1  # interval 2: no probe yet
    assert second.state.importance == first.state.importance


def test_fine_tuning_gets_its_steps_share_of_the_deadline_and_no_upload(setup):
    from fleet.federated.on_device.round import finetune_work, round_work

    cfg, _ = setup
    cfg = dataclasses.replace(cfg, personalization=dataclasses.replace(cfg.personalization, finetune_steps=3))
    steps = cfg.federation.local_steps
    ditto = TrainOrder(4, "ditto", 12.0)
    assert round_work(cfg, ditto).compute_steps == 2 * steps  # the shared update and the personal model
    work = finetune_work(cfg, ditto)
    assert (work.strategy, work.steps, work.models, work.with_upload) == ("naive", 3, 1, False)
    assert work.deadline_s == pytest.approx(12.0 * 3 / (2 * steps))
    assert finetune_work(cfg, TrainOrder(4, "fleet", 12.0)).deadline_s == pytest.approx(12.0 * 3 / steps)
    # the server orders FedAvg no deadline (aggregate.round_deadline, the one place that decides it): FedAvg+FT
    # fine-tunes every tensor
    assert finetune_work(cfg, TrainOrder(4, "fedavg", 0.0)).deadline_s == 0.0


@pytest.mark.parametrize("rule", [True, False])
def test_a_probe_that_would_overrun_the_deadline_is_skipped_and_the_round_keeps_it(setup, rule):
    """A slow device whose probe and cheapest selection exceed the deadline selects without probing and ends
    within the deadline; with the rule off it probes and overruns, as the compute regime's tier-4 device did."""
    cfg, profile = setup
    cfg = dataclasses.replace(
        cfg,
        federation=dataclasses.replace(cfg.federation, deadline_includes_upload=False, local_steps=10),
        elastic=dataclasses.replace(cfg.elastic, probe_only_when_it_fits=rule),
    )
    slow = profile.scaled(4.0)
    full_s = cfg.federation.local_steps * slow.full_step_time
    deadline = (rho_floor(cfg, slow) + 0.1) * full_s  # the probe (two full steps: 0.2 of it) does not fit
    first = train_round(
        cfg, make_model(cfg.model, 0), slow, device_data(cfg, 1).train, TrainOrder(1, "naive", deadline)
    )
    predicted = first.metrics[keys.PREDICTED_TIME_S]
    if rule:
        assert first.state.importance_round != 1 and predicted <= deadline * 1.001
    else:
        assert first.state.importance_round == 1 and predicted > deadline

"""Personal-model methods (personalization.method): FedRep, FedALA and APFL on a device, and their pure parts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fleet.base.errors import ConfigError
from fleet.federated.on_device import tasks
from fleet.federated.on_device.local_methods import Apfl, ala_merge, learn_ala
from fleet.federated.shared import keys
from fleet.federated.shared.config import load_fleet_config
from fleet.federated.shared.transfer import wire_bytes
from tests.test_personal import TINY, device, round_config


def method_device(tmp_path, method: str, policy: str = "none", **extra) -> tasks.Device:
    dev, _ = device(tmp_path, "none")
    overrides = {
        "output_dir": str(tmp_path / method),
        "personalization.method": method,
        "personalization.policy": policy,
        "hardware.profile": dev.cfg.hardware.profile,
        **extra,
    }
    return tasks.Device.from_configs(load_fleet_config(TINY, overrides), {"partition-id": 0})


def fresh(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in weights.items()}


def test_ala_merge_is_local_plus_weighted_difference():
    local, glob = {"a": torch.tensor([1.0, 2.0])}, {"a": torch.tensor([3.0, 0.0])}
    merged = ala_merge(local, glob, {"a": torch.tensor([0.5, 1.0])})
    assert torch.equal(merged["a"], torch.tensor([2.0, 0.0]))


def test_learn_ala_moves_the_weights_toward_the_model_that_fits_the_data():
    """Local head fits label 0, the global head label 1, the data is all label 1: the merge weights (from 0:
    the local head) rise toward the global head, and the merged model ends with a lower loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    x, y = torch.randn(64, 1, 2, 2), torch.ones(64, dtype=torch.long)
    with torch.no_grad():
        model[1].weight.zero_()
        model[1].bias.copy_(torch.tensor([0.0, 2.0]))  # the global model: predicts 1
    local = {n: p.detach().clone() for n, p in model.named_parameters()}
    local["1.bias"] = torch.tensor([2.0, 0.0])  # the device's own: predicts 0
    weights = {n: torch.zeros_like(local[n]) for n in ("1.weight", "1.bias")}
    loss_local = nn.functional.cross_entropy(x.flatten(1) @ local["1.weight"].T + local["1.bias"], y)
    result = learn_ala(model, local, weights, [[(x[:32], y[:32]), (x[32:], y[32:])]], first=False)
    assert result.batches == 2
    assert float(result.weights["1.bias"].mean()) > 0.5
    assert float(nn.functional.cross_entropy(model(x), y).detach()) < float(loss_local) - 0.5
    assert all(float(w.min()) >= 0 and float(w.max()) <= 1 for w in result.weights.values())


def test_an_apfl_step_moves_alpha_by_the_mixtures_gradient():
    """alpha's step is -lr * <v - w, grad f(v_bar)>, computed here independently of the class."""
    torch.manual_seed(1)
    v, w = nn.Linear(3, 2), nn.Linear(3, 2)
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    alpha, lr = 0.4, 0.1
    mixed = {
        n: (alpha * pv + (1 - alpha) * pw).detach().requires_grad_(True)
        for (n, pv), pw in zip(v.named_parameters(), w.parameters())
    }
    loss = nn.functional.cross_entropy(torch.func.functional_call(v, mixed, (x,)), y)
    grads = torch.autograd.grad(loss, list(mixed.values()))
    expected = alpha - lr * sum(
        float(((pv - pw) * g).sum().detach()) for pv, pw, g in zip(v.parameters(), w.parameters(), grads)
    )
    apfl = Apfl(v, w, alpha, torch.optim.SGD(v.parameters(), lr=lr), lr)
    apfl.step(x, y)
    assert float(apfl.alpha.detach()) == pytest.approx(expected, abs=1e-6)


def test_a_fedrep_device_trains_its_head_first_then_sends_only_the_body(tmp_path):
    dev, weights = device(tmp_path, "head")
    rep = method_device(tmp_path, "fedrep", "head")
    result = tasks.train(rep, fresh(weights), round_config(1))
    assert "fc.weight" not in result.arrays and "conv1.weight" in result.arrays
    assert not torch.equal(result.state.personal["fc.weight"], weights["fc.weight"])  # the head trained
    profile, steps = rep.profile(), rep.cfg.federation.local_steps
    # the head phase is priced (a forward and the head's backward a step) on top of the body's steps
    assert result.metrics[keys.PREDICTED_TIME_S] > steps * profile.step_time(
        [n != "fc.weight" and n != "fc.bias" for n in _names(rep)]
    )


def _names(dev: tasks.Device) -> list[str]:
    return [t.name for t in dev.profile().tensors]


def test_fedrep_without_a_personal_head_is_one_line():
    with pytest.raises(ConfigError, match=r"^personalization.method: fedrep trains a personal head.*use policy head"):
        load_fleet_config(TINY, {"personalization.method": "fedrep"})


def test_a_fedala_device_merges_the_global_model_into_its_own_from_its_second_round(tmp_path):
    _, weights = device(tmp_path, "none")
    ala = method_device(tmp_path, "fedala")
    first = tasks.train(ala, fresh(weights), round_config(1))
    assert first.state.method_state == {}  # nothing of its own to merge yet
    assert sorted(first.state.personal) == ["fc.bias", "fc.weight"]  # kept: only what its next merge starts from
    second = tasks.train(ala, fresh(weights), round_config(2))
    learned = second.state.method_state["ala"]
    assert sorted(learned) == ["fc.bias", "fc.weight"]  # the last two tensors (FedALA's p = 2)
    assert all(float(w.min()) >= 0 and float(w.max()) <= 1 for w in learned.values())
    assert second.metrics[keys.PREDICTED_TIME_S] > first.metrics[keys.PREDICTED_TIME_S]  # the merge is priced


def test_an_apfl_device_keeps_its_personal_model_and_alpha_and_is_scored_on_the_mix(tmp_path):
    _, weights = device(tmp_path, "none")
    # float32 uploads: the mix below is checked against the exact upload (float16's rounding is 5e-4)
    apfl = method_device(tmp_path, "apfl", **{"personalization.apfl_alpha": 0.5, "federation.transfer": "float32"})
    result = tasks.train(apfl, fresh(weights), round_config(1))
    kept = result.state.method_state
    alpha = kept["alpha"]
    assert 0 <= alpha <= 1 and alpha != 0.5  # learned
    name = "conv1.weight"
    mix = alpha * kept["v"][name] + (1 - alpha) * result.arrays[name]
    assert torch.allclose(result.personalized[name], mix, atol=1e-5)
    assert result.state.personal == {}  # the mix is scored as the round ends, not kept: v and alpha rebuild it
    assert 0 <= result.state.personal_accuracy <= 1
    steps, full = apfl.cfg.federation.local_steps, apfl.profile().full_step_time
    assert result.metrics[keys.FULL_TIME_S] == pytest.approx(2 * steps * full)  # two models on its clock


def test_an_unknown_personal_method_is_one_line():
    with pytest.raises(ConfigError, match=r"^personalization.method: 'perfedavg' is not allowed; use one of none"):
        load_fleet_config(TINY, {"personalization.method": "perfedavg"})


def test_another_method_beside_the_ditto_strategy_is_one_line():
    with pytest.raises(ConfigError, match=r"^personalization.method: apfl cannot run beside the ditto strategy"):
        load_fleet_config(TINY, {"personalization.method": "apfl", "federation.strategy": "ditto"})


def test_dittos_own_personal_selection_trains_more_within_the_same_deadline(tmp_path):
    """The personal model is never sent: choosing its own tensors by compute alone, it trains more of them than
    the shared update (which pays each tensor's upload), and the round still fits its deadline."""
    _, weights = device(tmp_path, "none")
    trained = {}
    for choice in ("same", "own"):
        dev = method_device(
            tmp_path / choice,
            "ditto",
            **{"personalization.personal_selection": choice, "devices.bandwidth_bytes_per_s": 1e7},
        )
        profile, steps = dev.profile(), dev.cfg.federation.local_steps
        shared = [v for v in weights.values() if v.is_floating_point()]
        upload = sum(wire_bytes(v, dev.cfg.federation.transfer) for v in shared) / 1e7
        deadline = 0.5 * (2 * steps * profile.full_step_time + upload)
        result = tasks.train(dev, fresh(weights), {**round_config(1), keys.DEADLINE_S: deadline})
        assert result.metrics[keys.PREDICTED_TIME_S] + upload * result.metrics[keys.TRAINED_FRACTION] <= deadline * 1.05
        moved = [
            n for n, t in result.state.personal.items() if t.is_floating_point() and not torch.equal(t, weights[n])
        ]
        trained[choice] = (len(moved), result.metrics[keys.SELECTED])
    assert trained["own"][1] == trained["same"][1]  # the shared update is chosen as before
    assert trained["own"][0] > trained["same"][0]  # the personal model trains more tensors

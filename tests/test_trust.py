"""robust.validate: trust, the server's own step as the reference direction, judged over rounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch.nn.functional as F

from fleet.base.errors import ConfigError
from fleet.data.datasets import batches
from fleet.federated.on_server.accept import ModelNames
from fleet.federated.on_server.coordinator import Coordinator
from fleet.federated.on_server.server_eval import global_model, reference_set
from fleet.federated.on_server.server_run import initial_arrays
from fleet.federated.on_server.state import ServerState
from fleet.federated.on_server.trust import direction, server_step, trust_problems
from fleet.federated.shared.config import load_fleet_config
from tests.test_fleet_strategy import reply, train

TINY = "simulations/fleet-tiny.yaml"


def test_a_device_is_judged_on_its_mean_direction_over_rounds_not_on_one_round():
    trust: dict[str, list[float]] = {}
    # round 1: an honest non-IID device can point well away from the server's balanced data once
    assert trust_problems(trust, {"honest": 0.3, "dipping": -0.38, "flipper": -0.2}) == {}
    assert trust_problems(trust, {"honest": 0.2, "dipping": 0.05, "flipper": -0.3}) == {}
    third = trust_problems(trust, {"honest": 0.1, "dipping": 0.12, "flipper": -0.3, "late": -0.9})
    assert list(third) == ["flipper"]  # dipping's mean -0.07 stays above the floor; late has one reply
    assert "mean cosine -0.27 with the server's step over 3 rounds" in third["flipper"]
    assert trust == {"honest": [0.3, 0.2, 0.1], "dipping": [-0.38, 0.05, 0.12], "flipper": [-0.2, -0.3, -0.3],
                     "late": [-0.9]}  # fmt: skip


def test_direction_is_the_cosine_over_the_tensors_the_device_sent():
    current = {"a": np.zeros(2, np.float32), "b": np.ones(2, np.float32)}
    step = {"a": np.array([1.0, 0.0]), "b": np.array([0.0, 1.0])}
    assert direction(current, {"a": np.array([2.0, 0.0], np.float32)}, step) == pytest.approx(1.0)
    assert (
        direction(current, {"a": np.array([-1.0, 0.0], np.float32), "b": np.array([1.0, 2.0], np.float32)}, step) == 0
    )
    assert direction(current, {"b": np.array([1.0, 0.0], np.float32)}, step) == pytest.approx(-1.0)
    assert direction(current, {}, step) == 0.0  # nothing sent: no direction, not a verdict
    assert direction(current, {"b": current["b"]}, step) == 0.0  # an update of zero


def test_the_servers_step_repeats_for_its_round_and_goes_down_its_own_datas_loss():
    cfg = load_fleet_config(TINY, {"start.samples": 300, "federation.local_steps": 5})
    arrays, names, data = initial_arrays(cfg), ModelNames.of(cfg).shared, reference_set(cfg)
    first = server_step(cfg, arrays, data, names, 1)
    again, other = server_step(cfg, arrays, data, names, 1), server_step(cfg, arrays, data, names, 2)
    assert set(first) == set(names) and all(np.array_equal(first[n], again[n]) for n in names)
    assert not all(np.array_equal(first[n], other[n]) for n in names)  # each round draws its own batches
    model = global_model(cfg, arrays)
    model.train()
    x, y = next(batches(data, len(data), shuffle=False, input_size=cfg.data.input_size))
    F.cross_entropy(model(x), y).backward()
    grads = dict(model.named_parameters())
    descent = sum(float((grads[n].grad.numpy() * first[n]).sum()) for n in names)
    assert descent < 0  # the step points down the gradient of the server's own loss


def test_a_device_that_keeps_pointing_against_the_servers_own_step_is_rejected_from_its_third_round():
    checks_off = {f"robust.{k}": None for k in ("norm_bound", "min_pull", "min_cos", "max_sign_skew", "norm_growth")}
    overrides = {"start.samples": 300, "robust.validate": "trust", "robust.aggregation": "mean", **checks_off}
    cfg = load_fleet_config(TINY, {**overrides, "federation.transfer": "float32"})
    names = ModelNames.of(cfg)
    c = Coordinator(cfg, ServerState(), initial_arrays(cfg), names=names)
    c.accept.reference = reference_set(cfg)
    for server_round in (1, 2, 3):
        step = server_step(cfg, c.arrays, c.accept.reference, names.shared, server_round)
        moves = {10: 1.0, 11: 0.5, 12: -1.0}  # node 12 sends the server's step reversed, every round
        train(
            c, server_round, [reply(n, {k: c.arrays[k] + m * step[k] for k in names.shared}) for n, m in moves.items()]
        )
        report = c.state.replies.defense
        assert report.trust == pytest.approx({"10": 1.0, "11": 1.0, "12": -1.0}, abs=1e-4)
        rejected = {r.node_id: r.reason for r in c.state.replies.rejections}
        assert list(rejected) == ([12] if server_round == 3 else [])
    assert "mean cosine -1.00 with the server's step over 3 rounds" in rejected[12]


@pytest.mark.parametrize("value, ok", [("trust", True), ("start", True), (None, True), ("loss", False)])
def test_validate_takes_start_trust_or_null(value, ok):
    if ok:
        assert load_fleet_config(TINY, {"robust.validate": value}).robust.validate == value
        return
    with pytest.raises(ConfigError, match="robust.validate.*start, trust or null"):
        load_fleet_config(TINY, {"robust.validate": value})

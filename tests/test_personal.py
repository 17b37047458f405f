"""Personal tensors (personalization.policy): kept on the device, never sent, never averaged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fleet.base.errors import ConfigError
from fleet.engine.experiment import make_model, model_with_weights
from fleet.engine.models import model_meta
from fleet.engine.trainer import accuracy
from fleet.federated.on_device import tasks
from fleet.federated.on_server.robust import upload_problem
from fleet.federated.shared import keys, schema
from fleet.federated.shared.config import load_fleet_config
from fleet.federated.shared.personal import personal_names
from fleet.federated.shared.transfer import upload_values
from tests.conftest import proportional_profile

TINY = "simulations/fleet-tiny.yaml"


def device(tmp_path, policy: str) -> tuple[tasks.Device, dict[str, torch.Tensor]]:
    """Device 0 of the tiny fleet under ``policy``, with a size-proportional profile, and the global model."""
    cfg = load_fleet_config(TINY, {"output_dir": str(tmp_path / policy), "personalization.policy": policy})
    model = make_model(cfg.model, 0)
    m = cfg.model
    meta = model_meta(m.name, m.num_classes, m.in_channels, m.small_input)
    path = tmp_path / "profile.yaml"
    proportional_profile(model, cfg.train.batch_size, cfg.data.input_size, meta=meta).save(path)
    cfg = load_fleet_config(
        TINY, {"output_dir": str(tmp_path / policy), "personalization.policy": policy, "hardware.profile": str(path)}
    )
    return tasks.Device.from_configs(cfg, {"partition-id": 0}), {k: v.clone() for k, v in model.state_dict().items()}


def round_config(server_round: int) -> dict:
    # no deadline: the device trains every tensor, its personal ones included
    return {keys.SERVER_ROUND: server_round, keys.STRATEGY: "fleet", keys.DEADLINE_S: 0.0, keys.RUN_TAG: "t"}


@pytest.mark.parametrize("policy", ["head", "norms", "head+norms"])
def test_personal_tensors_are_trained_but_never_appear_in_a_reply(tmp_path, policy):
    dev, weights = device(tmp_path, policy)
    personal = personal_names(model_with_weights(dev.cfg.model, dict(weights)), policy)
    result = tasks.train(dev, {k: v.clone() for k, v in weights.items()}, round_config(1))
    assert personal and not personal & set(result.arrays)
    params = {n for n, _ in make_model(dev.cfg.model, 0).named_parameters()}
    assert result.metrics[keys.SELECTED] == len(params - personal)  # the reply's trainable tensors, exactly
    assert result.metrics[keys.PERSONAL_SELECTED] == len(params & personal)
    assert result.metrics[keys.BYTES_UPLOADED] == sum(a.numel() * a.element_size() for a in result.arrays.values())
    mine = result.state.personal
    assert any(not torch.equal(mine[n], weights[n]) for n in personal if weights[n].is_floating_point())  # trained
    values = upload_values(result.arrays, weights, dev.cfg.federation.transfer)  # float16 changes, as values
    arrays = {k: v.numpy() for k, v in values.items()}
    assert upload_problem(arrays, result.metrics[keys.SELECTED], sorted(params), personal) is None


def test_a_fedbn_device_keeps_its_own_norm_statistics_across_rounds(tmp_path):
    """Round 2's global model carries other norm statistics and weights; a FedBN device trains on
    with its own from round 1, where a device without personal tensors takes the global ones."""
    kept = {}
    for policy in ("norms", "none"):
        dev, weights = device(tmp_path, policy)
        tasks.train(dev, {k: v.clone() for k, v in weights.items()}, round_config(1))
        round1 = tasks.load_state(dev.state_dir / tasks.STATE_FILE, "t").personal
        foreign = {k: v.clone() for k, v in weights.items()}
        foreign["bn1.running_mean"].fill_(7.0)
        foreign["bn1.weight"].fill_(3.0)
        result = tasks.train(dev, foreign, round_config(2))
        kept[policy] = (round1, result.personalized, result.arrays)
    round1, round2, sent = kept["norms"]
    assert round2["bn1.running_mean"].abs().max() < 3.5  # decayed from its own, not from 7.0
    assert torch.allclose(round2["bn1.weight"], round1["bn1.weight"], atol=0.05)  # its own, trained on
    assert "bn1.weight" not in sent and "bn1.running_mean" not in sent
    _, shared2, shared_sent = kept["none"]
    assert shared2["bn1.weight"].mean() > 2.9 and "bn1.weight" in shared_sent  # the global values, sent back


def test_the_device_evaluates_the_global_shared_tensors_with_its_own_personal_ones(tmp_path):
    dev, weights = device(tmp_path, "head")
    tasks.train(dev, {k: v.clone() for k, v in weights.items()}, round_config(1))
    wrecked = {k: v.clone() for k, v in weights.items()}
    wrecked["fc.weight"].zero_()
    wrecked["fc.bias"].zero_()
    plain = tasks.evaluate(dev, {k: v.clone() for k, v in weights.items()}, {keys.RUN_TAG: "t"})
    with_own_head = tasks.evaluate(
        dev, wrecked, {keys.RUN_TAG: "t"}
    )  # the global head never reaches the device's model
    assert with_own_head[keys.GLOBAL_ACCURACY] == plain[keys.GLOBAL_ACCURACY]


def test_the_server_rejects_a_reply_that_carries_a_personal_tensor():
    import numpy as np

    arrays = {"fc.weight": np.zeros((10, 4), np.float32), "conv1.weight": np.zeros(3, np.float32)}
    reason = upload_problem(arrays, 2, ["conv1.weight", "fc.weight"], frozenset({"fc.weight", "fc.bias"}))
    assert reason == "uploads tensor 'fc.weight', which personalization.policy keeps on the device"


def test_an_unknown_personal_policy_is_one_line():
    with pytest.raises(ConfigError, match=r"^personalization.policy: 'tail' is not allowed; use one of none, head"):
        load_fleet_config(TINY, {"personalization.policy": "tail"})


def test_fine_tuning_before_evaluation_is_elastic_timed_and_keeps_nothing(tmp_path):
    """personalization.finetune_steps: the device scores the global model, then a copy fine-tuned for that many
    steps within the round's share of the deadline; its simulated time is reported for the clock."""
    dev, weights = device(tmp_path, "none")
    cfg = dev.cfg
    dev = tasks.Device.from_configs(
        load_fleet_config(
            TINY,
            {
                "output_dir": cfg.output_dir,
                "personalization.finetune_steps": 3,
                "hardware.profile": cfg.hardware.profile,
            },
        ),
        {"partition-id": 0},
    )
    tasks.train(dev, {k: v.clone() for k, v in weights.items()}, round_config(1))
    state_file = dev.state_dir / tasks.STATE_FILE
    before = state_file.read_bytes()
    profile = dev.profile()
    full_step = profile.full_step_time
    deadline = 0.5 * full_step * dev.cfg.federation.local_steps  # half of a full round
    out = tasks.evaluate(
        dev, {k: v.clone() for k, v in weights.items()}, {**round_config(2), keys.DEADLINE_S: deadline}
    )
    assert 0 <= out[keys.FINETUNED_ACCURACY] <= 1 and out[keys.GLOBAL_ACCURACY] >= 0
    assert 0 < out[keys.FINETUNE_TIME_S] <= 3 * 0.5 * full_step * 1.05  # 3 steps in their share of the deadline
    full = tasks.evaluate(dev, {k: v.clone() for k, v in weights.items()}, {**round_config(2), keys.STRATEGY: "fedavg"})
    assert full[keys.FINETUNE_TIME_S] == pytest.approx(3 * full_step)  # FedAvg+FT fine-tunes every tensor
    assert state_file.read_bytes() == before  # nothing of the fine-tuning is kept
    plain = tasks.evaluate(dev, {k: v.clone() for k, v in weights.items()}, {keys.RUN_TAG: "t"})
    assert keys.FINETUNED_ACCURACY not in plain  # an evaluation without the round's config does not fine-tune


def test_negative_finetune_steps_are_one_line():
    with pytest.raises(ConfigError, match=r"^personalization.finetune_steps: -1 is not allowed; use an integer >= 0"):
        load_fleet_config(TINY, {"personalization.finetune_steps": -1})


def test_dittos_proximal_term_pulls_the_personal_model_toward_the_global_one(tmp_path):
    """The same personal model, trained the same steps on the same batches: with ditto_lambda it ends
    nearer the global weights it is anchored to than without."""
    from fleet.engine.trainer import Trainer
    from fleet.federated.on_device.round import train_steps
    from fleet.federated.shared.split import device_data

    dev, weights = device(tmp_path, "none")
    data = device_data(dev.cfg, 0).train
    torch.manual_seed(0)
    start = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in weights.items()}

    def distance(prox: float) -> float:
        model = model_with_weights(dev.cfg.model, {k: v.clone() for k, v in start.items()})
        train = dataclasses.replace(dev.cfg.train, method="full", seed=1)
        trainer = Trainer(model, train, dev.profile(model), input_size=16)
        trainer.set_anchor(weights, prox)
        train_steps(trainer, data, 5)
        return sum(float(((p.detach() - weights[n]) ** 2).sum()) for n, p in zip(trainer.names, trainer.params))

    assert distance(5.0) < 0.5 * distance(0.0)


def test_a_ditto_device_keeps_a_personal_model_and_sends_only_its_shared_update(tmp_path):
    dev, weights = device(tmp_path, "none")
    ditto = tasks.Device.from_configs(
        load_fleet_config(
            TINY,
            {
                "output_dir": str(tmp_path / "d"),
                "federation.strategy": "ditto",
                "hardware.profile": dev.cfg.hardware.profile,
            },
        ),
        {"partition-id": 0},
    )
    config = {**round_config(1), keys.STRATEGY: "ditto"}
    result = tasks.train(ditto, {k: v.clone() for k, v in weights.items()}, config)
    personal, sent = result.state.personal, result.arrays
    assert any(not torch.equal(personal[n], sent[n]) for n in sent if n.endswith("weight"))  # two models
    full_step = ditto.profile().full_step_time
    steps = ditto.cfg.federation.local_steps
    assert result.metrics[keys.FULL_TIME_S] == pytest.approx(2 * steps * full_step)  # both models on its clock
    assert result.metrics[keys.PREDICTED_TIME_S] == pytest.approx(2 * steps * full_step)  # no deadline: all trained
    again = tasks.train(ditto, {k: v.clone() for k, v in weights.items()}, {**config, keys.SERVER_ROUND: 2})
    moved = again.state.personal["fc.weight"] - personal["fc.weight"]
    assert float(moved.abs().max()) > 0  # round 2 trains on from its own personal model


def test_a_negative_ditto_lambda_is_one_line():
    with pytest.raises(ConfigError, match=r"^personalization.ditto_lambda: -0.5 is not allowed; use a number >= 0"):
        load_fleet_config(TINY, {"personalization.ditto_lambda": -0.5})


def test_a_devices_reported_fine_tuning_time_is_held_to_a_band_on_the_clock():
    from fleet.federated.on_server.coordinator import finetune_time
    from fleet.federated.on_server.membership import member
    from fleet.federated.on_server.state import ServerState
    from fleet.federated.shared.records import EvaluateReply

    def scored(node: int, finetune_s: float) -> EvaluateReply:
        return EvaluateReply(node, None, 10, 0.5, 0.5, finetune_time_s=finetune_s)

    cfg = load_fleet_config(TINY, {"personalization.finetune_steps": 1, "federation.local_steps": 2})
    state = ServerState(run_tag="r", roster={"7": member("a", 2.0), "8": member("b", 2.0)})
    state.replies.evaluation = [scored(7, 0.5), scored(8, 1e6)]
    assert finetune_time(cfg, state) == pytest.approx(4.0 * 2.0 * 1 / 2)  # band 4 x the device's full time x 1/2
    state.replies.evaluation = [scored(7, 0.5)]
    assert finetune_time(cfg, state) == pytest.approx(0.5)


@pytest.mark.parametrize("policy", ["none", "head"])
def test_a_device_keeps_only_what_the_global_model_will_not_bring_back_and_is_scored_as_it_trained(tmp_path, policy):
    """Compact state: the file holds the personal tensors and the trained tensors' momentum, never a shared
    tensor; the evaluation reports the personalized model's accuracy as the round ended it."""
    dev, weights = device(tmp_path, policy)
    result = tasks.train(dev, {k: v.clone() for k, v in weights.items()}, round_config(1))
    path = dev.state_dir / tasks.STATE_FILE
    saved = tasks.load_state(path, "t")
    assert set(saved.personal) == set(personal_names(model_with_weights(dev.cfg.model, dict(weights)), policy))
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    momentum_bytes = sum(s["momentum_buffer"].numel() * 4 for s in saved.optimizer["state"].values())
    assert dev.cfg.federation.state_precision == "float16"  # cast as the state is written, not in the round
    assert {s["momentum_buffer"].dtype for s in saved.optimizer["state"].values()} == {torch.float16}
    personal_bytes = sum(t.numel() * t.element_size() for t in saved.personal.values())
    assert path.stat().st_size < momentum_bytes + personal_bytes + model_bytes * 0.05  # no copy of the weights
    model = model_with_weights(dev.cfg.model, dict(weights))
    model.load_state_dict(result.personalized)
    scored = accuracy(model, dev.data().test, dev.cfg.data.input_size)
    other = {k: v.clone() for k, v in weights.items()}  # a later global model: the score stays its own
    assert tasks.evaluate(dev, other, {keys.RUN_TAG: "t"})[keys.PERSONAL_ACCURACY] == scored == saved.personal_accuracy
    assert 0 < result.metrics[keys.SCORE_TIME_S] < 60  # evaluation work the train reply reports (scale bench)
    assert schema.metric_problem(result.metrics, schema.TRAIN) is None


def test_a_state_saved_whole_by_an_earlier_version_is_still_scored(tmp_path):
    dev, weights = device(tmp_path, "none")
    result = tasks.train(dev, {k: v.clone() for k, v in weights.items()}, round_config(1))
    path = dev.state_dir / tasks.STATE_FILE
    old = dataclasses.replace(tasks.load_state(path, "t"), personal=result.personalized, personal_accuracy=None)
    raw = old.to_dict()
    del raw["personal_accuracy"]  # the earlier layout had no such key
    torch.save(raw, path)
    got = tasks.evaluate(dev, {k: v.clone() for k, v in weights.items()}, {keys.RUN_TAG: "t"})
    assert got[keys.PERSONAL_ACCURACY] == result.state.personal_accuracy


def test_ready_s_leaves_out_the_scoring_of_the_received_model(tmp_path, monkeypatch):
    """``ready_s`` is start-up; scoring the last round's model on a pipelined train message is evaluation,
    timed as eval_time_s: a slow scoring must not read as a slow start."""
    import time

    dev, weights = device(tmp_path, "none")
    born = time.monotonic()
    monkeypatch.setattr(tasks, "process_age_s", lambda: time.monotonic() - born)
    scoring = tasks.score_received

    def slow_scoring(*args):
        time.sleep(1.0)
        return scoring(*args)

    monkeypatch.setattr(tasks, "score_received", slow_scoring)
    tasks._HANDLED[0] = 0
    result = tasks.train(dev, dict(weights), {**round_config(2), keys.SCORE_RECEIVED: True})
    assert keys.GLOBAL_ACCURACY in result.metrics and keys.EVAL_TIME_S in result.metrics  # it was scored
    assert result.metrics[keys.READY_S] < 1.0  # it was 1 s more with the scoring counted as start-up

"""``evaluation.pipelined``: a round's model is scored by the next round's trainers, in their train message.

On a device, scoring the model it received must not change what it trains, and must give what an evaluate
message would. On the server, a round's record waits for those scores (in the checkpoint too), the last
round evaluates in a wave of its own, and a bad score is left out with a line. End to end, Flower's
simulation runs rounds with no evaluation wave but the last.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch

from fleet.base.errors import ConfigError
from fleet.engine.experiment import make_model
from fleet.federated.on_device import tasks
from fleet.federated.on_server.coordinator import Coordinator
from fleet.federated.on_server.mailbox import Mailbox
from fleet.federated.on_server.server_loop import run_round
from fleet.federated.on_server.server_run import initial_arrays
from fleet.federated.on_server.state import ServerState, load_checkpoint, save_checkpoint
from fleet.federated.shared import keys
from fleet.federated.shared.config import load_fleet_config
from fleet.federated.shared.config import pipelined as pipelined_rule
from fleet.federated.shared.records import QUERY, TRAIN, Reply, TrainOrder
from tests.test_coordinator import NODES, config, query, train_reply
from tests.test_fleet_simulation import TINY, read_metrics, run_fleet
from tests.test_server_loop import FakeLink


def pipelined() -> Coordinator:
    """Deployed rounds that ride; ``grace_s`` short, so the last round's wave, which nobody answers, ends soon."""
    cfg = config()
    membership = dataclasses.replace(cfg.membership, grace_s=0.5)
    cfg = dataclasses.replace(
        cfg, membership=membership, evaluation=dataclasses.replace(cfg.evaluation, pipelined=True)
    )
    return Coordinator(cfg, ServerState(run_tag="p"), initial_arrays(cfg))


def scored(node: str, server_round: int, sent: dict, accuracy: float, test: int = 20, **extra):
    """A train reply that also scored the model it received: ``accuracy`` global, its personal 0.9."""
    scores = {keys.GLOBAL_ACCURACY: accuracy, keys.PERSONAL_ACCURACY: 0.9, keys.TEST_EXAMPLES: test, **extra}
    return train_reply(node, server_round, sent, 0.1, **{keys.EVAL_TIME_S: 0.05, **scores})


def one_round(coord: Coordinator, box: Mailbox, server_round: int, replies) -> tuple[list[dict], TrainOrder]:
    """A whole round through the server's loop: the devices answer their query, their train order with
    ``replies(order, arrays sent)``, and no evaluation wave; the records the round releases, and the order."""
    sent: dict[str, object] = {}

    def answer(node: str, kind: str, r: int, arrays: dict, order: TrainOrder | None) -> Reply | None:
        if kind == QUERY:
            return query(node, f"device-{NODES.index(node)}", 2.0)
        if kind != TRAIN:
            return None
        if "replies" not in sent:
            sent.update(order=order, replies={str(x.node_id): x for x in replies(order, arrays)})
        return sent["replies"].get(node)

    box.link.answer = answer
    return [r.to_json() for r in run_round(coord, box, server_round)], sent["order"]


def test_a_rounds_record_waits_for_the_next_rounds_scores_and_the_last_round_is_not_held(tmp_path, caplog):
    coord, box = pipelined(), Mailbox(FakeLink(lambda *a: None, NODES))
    released, order = one_round(coord, box, 1, lambda order, sent: [train_reply(n, 1, sent, 0.1) for n in NODES])
    assert released == [] and coord.state.held.round == 1 and not order.score_received
    save_checkpoint(tmp_path, coord.arrays, coord.state)  # a resumed run still holds it
    assert load_checkpoint(tmp_path)[1].held == coord.state.held

    def scores(order, sent):
        assert order.score_received and order.to_config()[keys.SCORE_RECEIVED] is True
        out = [scored(n, 2, sent, acc, test) for n, acc, test in zip(NODES, (0.5, 0.8, 0.2), (10, 30, 20))]
        return [*out, scored(NODES[3], 2, sent, 1.5), train_reply(NODES[4], 2, sent, 0.1)]  # a bad score; none

    with caplog.at_level(logging.WARNING, logger="fleet.server"):
        released, _ = one_round(coord, box, 2, scores)
    (first,) = released
    assert first["round"] == 1 and first["evaluated_in_round"] == 2
    assert first["global_accuracy"] == pytest.approx((0.5 * 10 + 0.8 * 30 + 0.2 * 20) / 60)
    assert first["personal_accuracy"] == pytest.approx(0.9)
    rows = {d["device"]: d for d in first["devices"]}
    assert rows["device-1"]["global_accuracy"] == 0.8 and rows["device-1"]["test_examples"] == 30
    assert "eval_time_s" not in rows["device-1"]  # spent in round 2: its train row there carries it
    assert "global_accuracy" not in rows["device-3"] and "global_accuracy" not in rows["device-4"]
    bad = "device device-3 (node 104)"
    assert f"round 1: evaluation from {bad} failed: metric 'global-accuracy' must be in [0, 1]" in caplog.text
    assert f"round 2: rejected reply from {bad}: metric 'global-accuracy'" in caplog.text  # a faulty reply, whole
    assert coord.state.held.round == 2
    second_rows = {d.device: d for d in coord.state.held.devices}
    assert second_rows["device-0"].eval_time_s == pytest.approx(0.05)
    assert second_rows["device-0"].train_eval_time_s == pytest.approx(0.05)  # inside its train message
    released, _ = one_round(coord, box, 3, lambda order, sent: [scored(n, 3, sent, 0.6) for n in NODES])
    assert [r["round"] for r in released] == [2, 3] and coord.state.held is None  # the last round is not held
    assert released[0]["global_accuracy"] == pytest.approx(0.6)
    assert released[1]["global_accuracy"] is None  # its own wave (here, nobody answered)


def test_scoring_the_received_model_changes_nothing_it_trains_and_scores_as_an_evaluation(tmp_path):
    torch.set_num_threads(1)
    cfg = load_fleet_config(TINY, {"output_dir": str(tmp_path)})
    weights = make_model(cfg.model, 0).state_dict()
    device = tasks.Device.from_configs(cfg, {"partition-id": 2})
    evaluated = tasks.evaluate(device, {k: v.clone() for k, v in weights.items()}, {keys.RUN_TAG: "t"})
    order = TrainOrder(1, "fleet", 0.0, "t", score_received=True).to_config()
    trained = tasks.train(device, {k: v.clone() for k, v in weights.items()}, order).metrics
    assert trained[keys.GLOBAL_ACCURACY] == evaluated[keys.GLOBAL_ACCURACY]
    assert trained[keys.PERSONAL_ACCURACY] == evaluated[keys.PERSONAL_ACCURACY]  # never trained: the global model's
    assert trained[keys.TEST_EXAMPLES] == evaluated[keys.NUM_EXAMPLES] and trained[keys.EVAL_TIME_S] > 0
    plain = tasks.train(
        device, {k: v.clone() for k, v in weights.items()}, TrainOrder(2, "fleet", 0.0, "t").to_config()
    )
    assert keys.GLOBAL_ACCURACY not in plain.metrics and keys.EVAL_TIME_S not in plain.metrics


def test_scoring_first_leaves_the_update_as_it_was(tmp_path):
    torch.set_num_threads(1)
    weights = make_model(load_fleet_config(TINY).model, 0).state_dict()
    results = []
    for score in (False, True):  # each from a fresh state folder: the same device's first round
        cfg = load_fleet_config(TINY, {"output_dir": str(tmp_path / str(score))})
        device = tasks.Device.from_configs(cfg, {"partition-id": 0})
        order = TrainOrder(1, "fleet", 0.0, "t", score_received=score)
        results.append(tasks.train(device, {k: v.clone() for k, v in weights.items()}, order.to_config()))
    plain, scoring = results
    assert plain.arrays.keys() == scoring.arrays.keys()
    for name in plain.arrays:
        np.testing.assert_array_equal(plain.arrays[name].numpy(), scoring.arrays[name].numpy())


def test_a_pipelined_score_cannot_cover_every_member_nor_a_fine_tuned_model():
    with pytest.raises(ConfigError, match="evaluation.pipelined: only the next round's trainers"):
        load_fleet_config(TINY, {"evaluation.pipelined": True, "evaluation.all_devices": True})
    with pytest.raises(ConfigError, match="evaluation.pipelined: a device scores the model it received"):
        load_fleet_config(TINY, {"evaluation.pipelined": True, "personalization.finetune_steps": 2})


def test_by_default_deployed_rounds_ride_and_simulated_ones_and_every_member_scores_do_not():
    cfg = config()
    assert cfg.evaluation.pipelined is None and not pipelined_rule(cfg, simulated=True) and pipelined_rule(cfg, False)
    deployed = Coordinator(cfg, ServerState(run_tag="d"), initial_arrays(cfg))
    simulated = Coordinator(cfg, ServerState(run_tag="s"), initial_arrays(cfg), simulated=True)
    assert deployed.rides(1) and not simulated.rides(1) and not deployed.rides(cfg.federation.rounds)
    for field, value in (("evaluation.all_devices", True), ("personalization.finetune_steps", 2)):
        assert not pipelined_rule(load_fleet_config(TINY, {field: value}), simulated=False), field
    off = load_fleet_config(TINY, {"evaluation.pipelined": False})
    assert not pipelined_rule(off, simulated=False) and pipelined_rule(
        dataclasses.replace(off, evaluation=dataclasses.replace(off.evaluation, pipelined=True)), simulated=True
    )


def test_flowers_simulation_evaluates_in_a_wave_only_after_the_last_round(tmp_path):
    res = run_fleet(
        ["simulate", TINY, "--output-dir", str(tmp_path), "--rounds", "3", "--set", "evaluation.pipelined=true"]
    )
    assert res.returncode == 0, res.stdout[-3000:]
    records = read_metrics(tmp_path / "fleet-tiny")
    assert [r["round"] for r in records] == [1, 2, 3]
    assert [r.get("evaluated_in_round") for r in records] == [2, 3, None]
    assert ["push_eval_s" in r["server_s"] for r in records] == [False, False, True]
    for r in records:
        assert len([d for d in r["devices"] if "global_accuracy" in d]) == 4 and 0 <= r["global_accuracy"] <= 1
    assert all(d["eval_time_s"] > 0 for d in records[1]["devices"])  # round 2's trainers scored round 1's model
    lines = [line for line in res.stdout.splitlines() if line.startswith("round ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]

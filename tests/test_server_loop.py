"""The server's round loop (fleet/federated/on_server/server_loop.py) driven whole, through a fake Link, without Flower.

Five devices answer as functions of what they are sent: a query with their name, a train order with the
head moved by their step (and, under ``evaluation.pipelined``, their score of the model they received),
an evaluation with a score. One never answers in round 1 and its reply arrives in round 2 (late), one
pulls back, a sixth device connects in round 2 and takes part at once, and the last round evaluates in a
wave of its own. The loop's records, laps and bounds are checked, not a sequence written by hand.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

import numpy as np
import pytest

from fleet.federated.on_server.coordinator import Coordinator
from fleet.federated.on_server.mailbox import Mailbox, Sent
from fleet.federated.on_server.server_loop import run_round
from fleet.federated.on_server.server_run import initial_arrays
from fleet.federated.on_server.state import ServerState
from fleet.federated.on_server.wall import Lap
from fleet.federated.shared import keys
from fleet.federated.shared.records import EVALUATE, QUERY, TRAIN, Reply, TrainOrder
from fleet.federated.shared.round_record import RoundRecord
from tests.test_coordinator import NODES, config, evaluate_reply, query, train_reply

# (node, kind, round, arrays sent, order sent) -> the node's reply, or None: silence
Answer = Callable[[str, str, int, dict, TrainOrder | None], Reply | None]


class FakeLink:
    """Devices behind a Link: each message is answered at once by ``answer``, unless it is a train order to a
    node in ``holding`` (the reply waits until :meth:`release`), or ``answer`` gives None (never)."""

    def __init__(self, answer: Answer, nodes: list[str]) -> None:
        self.answer, self.connected = answer, set(nodes)
        self.inbox: dict[str, Reply] = {}
        self.held: dict[str, tuple[str, Reply]] = {}  # message id -> (node, its reply), not yet delivered
        self.holding: set[str] = set()
        self.sent: list[tuple[str, str, int]] = []  # (node, kind, round) of every message, in order
        self.count = 0

    def nodes(self) -> set[str]:
        return set(self.connected)

    def send(self, nodes: list[str], kind: str, arrays, order: TrainOrder | None) -> list[str]:
        ids = []
        for node in nodes:
            self.count += 1
            msg_id, server_round = f"m{self.count}", order.server_round if order else 0
            self.sent.append((node, kind, server_round))
            reply = self.answer(node, kind, server_round, arrays or {}, order)
            if reply is not None:
                if kind == TRAIN and node in self.holding:
                    self.held[msg_id] = (node, reply)
                else:
                    self.inbox[msg_id] = reply
            ids.append(msg_id)
        return ids

    def release(self, node: str) -> None:
        for msg_id, (held_node, _) in list(self.held.items()):
            if held_node == node:
                self.inbox[msg_id] = self.held.pop(msg_id)[1]

    def receive(self, sent: Mapping[str, Sent]) -> list[tuple[str, Reply]]:
        out = []
        for msg_id in [i for i in self.inbox if i in sent]:
            reply = self.inbox.pop(msg_id)
            s = sent[msg_id]
            out.append((msg_id, dataclasses.replace(reply, node_id=s.node, kind=s.kind, server_round=s.server_round)))
        return out


STEPS = {"101": 0.1, "102": 0.3, "103": 0.2, "104": 0.2, "105": 0.1, "106": 0.2}
NAMES = {**{n: f"device-{i}" for i, n in enumerate(NODES)}, "106": "device-5"}


def devices(pulling: str, pull_round: int) -> Answer:
    """Every device's answers; ``pulling`` steps back five times in ``pull_round``. A train reply carries its
    score of the model it received (the riding evaluation), which this config asks for."""

    def answer(node: str, kind: str, server_round: int, arrays: dict, order: TrainOrder | None) -> Reply | None:
        if kind == QUERY:
            return query(node, NAMES[node], 2.0)
        if kind == EVALUATE:
            return evaluate_reply(node, server_round, 0.6, 0.7, 10)
        step = -1.0 if (node, server_round) == (pulling, pull_round) else STEPS[node]
        scores = {keys.GLOBAL_ACCURACY: 0.5, keys.PERSONAL_ACCURACY: 0.8, keys.TEST_EXAMPLES: 10}
        reply = train_reply(node if node in NODES else "101", server_round, arrays, step, **scores)
        return dataclasses.replace(reply, name=NAMES[node])

    return answer


def pipelined_coordinator() -> Coordinator:
    cfg = config()
    fed = dataclasses.replace(cfg.federation, timeout_s=1.0)  # a simulated round's every wait
    cfg = dataclasses.replace(cfg, federation=fed, evaluation=dataclasses.replace(cfg.evaluation, pipelined=True))
    return Coordinator(cfg, ServerState(run_tag="loop"), initial_arrays(cfg), simulated=True)


def lines(records: list[RoundRecord]) -> list[dict]:
    """The records as metrics.jsonl holds them."""
    return [r.to_json() for r in records]


@pytest.fixture(scope="module")
def rounds() -> dict:
    coord = pipelined_coordinator()
    link = FakeLink(devices(pulling="103", pull_round=2), NODES)
    link.holding.add("105")  # its round-1 reply comes only in round 2
    box = Mailbox(link)
    start = dict(coord.arrays)
    out = [lines(run_round(coord, box, 1))]
    after1 = dict(coord.arrays)
    link.release("105")
    link.holding.clear()
    link.connected.add("106")  # a new device, there before round 2 opens
    with_logs = logging.getLogger("fleet.server")
    with pytest.MonkeyPatch.context() as mp:
        seen: list[str] = []
        mp.setattr(with_logs, "warning", lambda msg, *a: seen.append(msg % a))
        out.append(lines(run_round(coord, box, 2)))
    out.append(lines(run_round(coord, box, 3)))
    return {"released": out, "link": link, "coord": coord, "warnings": seen, "start": start, "after1": after1}


def test_each_round_releases_the_last_ones_record_once_its_trainers_scored_it(rounds):
    released = rounds["released"]
    assert [[r["round"] for r in batch] for batch in released] == [[], [1], [2, 3]]
    rec1, rec2, rec3 = released[1][0], *released[2]
    assert rec1["evaluated_in_round"] == 2 and rec2["evaluated_in_round"] == 3
    assert rec1["global_accuracy"] == pytest.approx(0.5)  # round 2's trainers' scores of round 1's model
    assert rec3["global_accuracy"] == pytest.approx(0.6)  # the last round's own evaluation wave
    kinds = [(kind, r) for _, kind, r in rounds["link"].sent if kind != QUERY]
    assert (EVALUATE, 1) not in kinds and (EVALUATE, 2) not in kinds and (EVALUATE, 3) in kinds


def test_a_silent_device_misses_and_its_late_reply_is_dropped(rounds):
    rec1 = rounds["released"][1][0]
    assert rec1["missed"] == ["device-4"] and rec1["joined"] == [f"device-{i}" for i in range(5)]
    assert any("late" in w and "device-4" in w for w in rounds["warnings"]), rounds["warnings"]


def test_a_joining_device_takes_part_at_once_and_one_stepping_back_is_rejected(rounds):
    rec2 = rounds["released"][2][0]
    assert rec2["joined"] == ["device-5"] and "device-5" in rec2["sampled"]
    assert [(r["device"], r["round"]) for r in rec2["rejections"]] == [("device-2", 2)]
    assert "points against the global model's last step" in rec2["rejections"][0]["reason"]


def test_the_loop_times_its_own_laps_and_keeps_every_round_within_its_bound(rounds):
    rec1, (rec2, rec3) = rounds["released"][1][0], rounds["released"][2]
    assert set(rec1["server_s"]) >= {Lap.OPEN, Lap.PUSH_TRAIN, Lap.WAIT_TRAIN, Lap.AGGREGATE}
    assert Lap.WAIT_EVAL not in rec1["server_s"] and Lap.WAIT_EVAL in rec3["server_s"]  # riding, then its own
    assert rec1["server_s"][Lap.WAIT_TRAIN] == pytest.approx(1.0, abs=0.3)  # device-4's silence: the whole wait
    assert rec2["server_s"][Lap.WAIT_TRAIN] < 0.5  # everyone answered at once
    for rec in (rec1, rec2, rec3):
        assert rec["round_wall_s"] <= rec["round_bound_s"]


def test_round_ones_model_is_the_trimmed_mean_of_the_four_that_answered(rounds):
    start, after = rounds["start"], rounds["after1"]
    for name in ("fc.weight", "fc.bias"):  # steps 0.1, 0.3, 0.2, 0.2: a quarter trimmed at each end, 0.2
        np.testing.assert_allclose(after[name], start[name] + np.float32(0.2), rtol=0, atol=1e-6)
    assert after["conv1.weight"] is start["conv1.weight"]  # trained by nobody: kept as it was
    assert rounds["coord"].state.round == 3


class SlowJoins(FakeLink):
    """Devices whose answer to their first query comes ``late_s`` seconds after it was sent (a board profiling
    itself as it joins); None: never."""

    def __init__(self, answer: Answer, nodes: list[str], late_s: dict[str, float | None]) -> None:
        super().__init__(answer, nodes)
        self.late_s, self.due = late_s, {}

    def send(self, nodes: list[str], kind: str, arrays, order: TrainOrder | None) -> list[str]:
        ids = super().send(nodes, kind, arrays, order)
        for node, msg_id in zip(nodes, ids, strict=True):
            if kind == QUERY and node in self.late_s:
                reply, late = self.inbox.pop(msg_id), self.late_s[node]
                if late is not None:
                    self.due[msg_id] = (time.monotonic() + late, reply)
        return ids

    def receive(self, sent: Mapping[str, Sent]) -> list[tuple[str, Reply]]:
        for msg_id, (when, reply) in list(self.due.items()):
            if time.monotonic() >= when:
                self.inbox[msg_id] = reply
                del self.due[msg_id]
        return super().receive(sent)


@pytest.mark.parametrize("late_s", [0.8, None])
def test_the_first_round_waits_for_the_devices_joining_within_the_fleets_timeout(late_s):
    """A device answering its first query after ``grace_s`` still trains in round 1; one that never answers
    holds round 1 for ``federation.timeout_s`` at most."""
    coord = pipelined_coordinator()
    cfg = coord.cfg
    fed, member = dataclasses.replace(cfg.federation, timeout_s=2.0), dataclasses.replace(cfg.membership, grace_s=0.2)
    coord.cfg = dataclasses.replace(cfg, federation=fed, membership=member)
    link = SlowJoins(devices(pulling="", pull_round=0), NODES, {"105": late_s})
    started = time.monotonic()
    run_round(coord, Mailbox(link), 1)
    took, trained = time.monotonic() - started, {n for n, kind, r in link.sent if kind == TRAIN}
    if late_s is not None:
        assert trained == set(NODES) and late_s <= took < 1.5
    else:
        assert trained == set(NODES) - {"105"} and 2.0 <= took < 2.8

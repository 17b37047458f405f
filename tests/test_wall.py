"""A round's whole wall-time bound (fleet/federated/on_server/wall.py) and the waits that keep it (its mailbox)."""

from __future__ import annotations

import time

import pytest

from fleet.federated.on_server import wall
from fleet.federated.on_server.mailbox import Mailbox
from fleet.federated.shared.records import TRAIN, Reply


def test_before_any_round_the_servers_work_is_taken_as_twice_the_push():
    work = wall.expected_work(None, push_s=4.0)
    assert (work.after_train_s, work.close_s) == (8.0, 2.0)
    bound = wall.round_bound(5.0, 60.0, 20.0, work)
    assert bound == pytest.approx(5.0 + 60.0 + 20.0 + 1.5 * 10.0 + 2.0)
    assert wall.round_bound(5.0, 60.0, None, work) == pytest.approx(bound - 20.0)  # a round that does not evaluate


def test_learned_work_follows_a_slower_round_at_once_and_a_faster_one_slowly():
    slow = wall.learn_work(wall.ServerWork(2.0, 1.0), wall.ServerWork(10.0, 0.5))
    assert (slow.after_train_s, slow.close_s) == (10.0, 0.8)
    assert wall.learn_work(slow, wall.ServerWork(1.0, 0.1)).after_train_s == pytest.approx(8.0)
    assert wall.expected_work(slow, push_s=100.0) is slow  # learned beats the guess


def test_the_evaluation_wait_gives_way_when_the_server_ran_over_and_never_goes_negative():
    work = wall.ServerWork(after_train_s=4.0, close_s=2.0)
    assert wall.evaluation_wait(30.0, left_s=100.0, work=work) == 30.0
    assert wall.evaluation_wait(30.0, left_s=20.0, work=work) == pytest.approx(20.0 - (1.5 * 2.0 + 1.0))
    assert wall.evaluation_wait(30.0, left_s=1.0, work=work) == 0.0


def test_the_servers_work_is_what_the_laps_do_not_spend_waiting():
    laps = {"open_s": 1.0, "push_train_s": 2.0, "wait_train_s": 50.0, "aggregate_s": 3.0, "push_eval_s": 2.0}
    laps["wait_eval_s"] = 10.0
    work = wall.work_of(laps, wall_s=70.0)
    assert (work.after_train_s, work.close_s) == (5.0, pytest.approx(2.0))


class SlowLink:
    """A stand-in link: replies come ``arrive_s`` after the push, each receive that brings any takes ``pull_s``."""

    def __init__(self, arrive_s: dict[int, float], pull_s: float) -> None:
        self.arrive_s, self.pull_s, self.pushed, self.start = arrive_s, pull_s, {}, time.monotonic()

    def nodes(self) -> set[str]:
        return {str(n) for n in self.arrive_s}

    def send(self, nodes, kind, arrays, order):
        ids = [f"m{node}-{i}" for i, node in enumerate(nodes)]
        self.pushed.update({msg_id: int(node) for msg_id, node in zip(ids, nodes)})
        return ids

    def receive(self, sent):
        now, out = time.monotonic() - self.start, []
        for msg_id in sent:
            node = self.pushed.get(msg_id)
            if node is not None and now >= self.arrive_s[node]:
                out.append((msg_id, Reply(node, sent[msg_id].kind, sent[msg_id].server_round)))
                del self.pushed[msg_id]
        if out:
            time.sleep(self.pull_s)
        return out


def test_a_wait_starts_no_pull_it_cannot_finish_within_its_bound():
    box = Mailbox(SlowLink({1: 0.0, 2: 0.9}, pull_s=0.4))
    ids = box.push(["1", "2"], TRAIN, 1)
    started = time.monotonic()
    got = box.collect(ids, timeout_s=1.0)
    took = time.monotonic() - started
    assert [r.node_id for r in got] == [1]  # node 2's reply would be pulled only after the bound
    assert got[0].wall_s == pytest.approx(0.4, abs=0.1)  # push to the end of the receive that brought it
    assert box.pull_s == pytest.approx(0.4, abs=0.1)
    assert took <= 1.0 + 0.05, took

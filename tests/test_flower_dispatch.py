"""fleet's dispatch for Flower's simulation engine, against Flower's own loop on a real in-memory LinkState."""

from __future__ import annotations

import dataclasses
import threading
import time
from queue import Queue

import pytest
from flwr.app import Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store.object_store_factory import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation.noop_federation_manager import NoOpFederationManager
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from fleet.commands import flower_dispatch

RUN_ID, TASK_ID = 7, 9


@pytest.fixture
def identity(monkeypatch):
    """The ServerApp's identity, as the launcher sets it, so that Messages can be made; restored after."""
    for name, value in (("_task_id", TASK_ID), ("_run_id", RUN_ID), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, name, value)


def link(nodes: int, targets: list[int], ttl: float | None = None):
    """Flower's in-memory LinkState with ``nodes`` registered nodes and one message pushed to each
    node index in ``targets`` (in that order); returns (state, Flower's node mapping, node ids)."""
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    state = factory.state()
    run = dataclasses.replace(
        Run.create_empty(run_id=RUN_ID), federation_id=NOOP_FEDERATION_ID, primary_task_id=TASK_ID
    )
    state.run_ids[RUN_ID] = RunRecord(run=run)
    state.task_store[TASK_ID] = Task(task_id=TASK_ID, run_id=RUN_ID)
    mapping = vce_api._register_nodes(nodes, factory)
    ids = list(mapping)
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    extra = {} if ttl is None else {"ttl": ttl}
    assert len(list(grid.push_messages([Message(RecordDict(), ids[i], "train", **extra) for i in targets]))) == len(
        targets
    )
    return state, mapping, ids


def flower_tick(state, mapping) -> list[int]:
    """One tick of Flower's own loop (run until it stops): the destination of each message it queued."""
    queue, stop = Queue(), threading.Event()
    thread = threading.Thread(target=flower_dispatch._FLOWER_LOOP[0], args=(state, queue, mapping, stop))
    thread.start()
    time.sleep(0.05)  # inside its first wait of 0.1 s
    stop.set()
    thread.join()
    return [m.metadata.dst_node_id for m in queue.queue]


def fleet_tick(state, mapping) -> list[int]:
    queue: Queue = Queue()
    flower_dispatch.dispatch_once(state, queue, mapping)
    return [m.metadata.dst_node_id for m in queue.queue]


@pytest.fixture(autouse=True)
def installed():
    flower_dispatch.install()


def test_install_replaces_flowers_loop_once():
    original = flower_dispatch._FLOWER_LOOP[0]
    flower_dispatch.install()
    assert vce_api.add_messages_to_queue is flower_dispatch.add_messages_to_queue
    assert flower_dispatch._FLOWER_LOOP == [original] and original is not flower_dispatch.add_messages_to_queue


def test_a_tick_queues_what_flowers_loop_queues_in_its_order(identity):
    """Messages to nodes 150, 3, 77 and 3 again: one a node a tick, in the nodes' order, the second message
    to node 3 on the next tick, then nothing, as Flower's own loop does."""
    targets = [150, 3, 77, 3]
    state, mapping, ids = link(200, targets)
    assert flower_tick(state, mapping) == [ids[3], ids[77], ids[150]]
    state, mapping, ids = link(200, targets)  # new node ids, the same indices
    assert fleet_tick(state, mapping) == [ids[3], ids[77], ids[150]]
    assert fleet_tick(state, mapping) == [ids[3]]
    assert fleet_tick(state, mapping) == []


def test_a_tick_asks_flower_only_about_the_nodes_with_a_message_waiting(identity, monkeypatch):
    state, mapping, ids = link(1000, [5, 500, 999])
    asked: list[int] = []
    real = state.get_message_ins
    monkeypatch.setattr(state, "get_message_ins", lambda node_id, limit: asked.append(node_id) or real(node_id, limit))
    assert fleet_tick(state, mapping) == [ids[5], ids[500], ids[999]]
    assert asked == [ids[5], ids[500], ids[999]]


def test_an_expired_message_is_dropped_by_flowers_checks_and_never_queued(identity):
    state, mapping, ids = link(50, [10], ttl=0.05)
    time.sleep(0.1)
    assert fleet_tick(state, mapping) == []
    assert not state.message_ins_store


def test_a_state_it_cannot_read_is_served_by_flowers_loop(monkeypatch):
    """A LinkState without the in-memory store (another flwr) goes to Flower's loop, arguments unchanged."""
    calls = []
    monkeypatch.setattr(flower_dispatch, "_FLOWER_LOOP", [lambda *args: calls.append(args)])
    stop = threading.Event()
    flower_dispatch.add_messages_to_queue(object(), Queue(), {}, stop)
    assert len(calls) == 1 and calls[0][3] is stop

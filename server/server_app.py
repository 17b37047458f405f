"""Flower ServerApp of the fleet (Message API): unpack, call the core, pack.

Every decision of a round is the Flower-free :class:`~fleet.federated.coordinator.Coordinator`'s.
This module only moves its records across Flower: a :class:`~fleet.federated.records.TrainOrder`
and the global arrays into Messages, replies back into :class:`~fleet.federated.records.Reply`
records, through the :class:`~server.mailbox.Mailbox`, which bounds every wait. ``resume = true``
in the run config continues from the last checkpoint (fleet.federated.server_run).
"""

from __future__ import annotations

import logging
import time

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common.constant import SType
from flwr.serverapp import Grid, ServerApp

from fleet.base.errors import FleetError
from fleet.federated import keys
from fleet.federated.config import FleetConfig, config_from_run_config
from fleet.federated.coordinator import Coordinator, PlannedRound, devices_wanted
from fleet.federated.npy import npy_view
from fleet.federated.records import EVALUATE, QUERY, TRAIN, Reply, TrainOrder
from fleet.federated.server_run import ServerRun
from server.mailbox import Mailbox, Sent, from_device

app = ServerApp()
log = logging.getLogger("fleet.server")
MESSAGE_TYPES = {QUERY: MessageType.QUERY, TRAIN: MessageType.TRAIN, EVALUATE: MessageType.EVALUATE}


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_config = dict(context.run_config)
    cfg = config_from_run_config(run_config)
    run_fleet(
        grid, cfg, resume=bool(run_config.get("resume", False)), simulated=bool(run_config.get("simulation", False))
    )


def run_fleet(grid: Grid, cfg: FleetConfig, *, resume: bool, simulated: bool = False) -> dict:
    """Run (or continue) the fleet until ``federation.rounds`` or, when set, until the simulated clock
    reaches ``federation.time_budget_s``; returns the summary."""
    run = ServerRun.start(cfg, resume=resume, simulated=simulated)
    mailbox = Mailbox(grid)
    wait_for_devices(grid, cfg)
    for server_round in run.rounds():
        run.keep(run_round(grid, run.coordinator, mailbox, server_round))
    return run.finish()


def run_round(grid: Grid, coord: Coordinator, mailbox: Mailbox, server_round: int) -> list[dict]:
    """One round: admit, plan, train, evaluate, within the round's whole bound; returns the records to write now:
    its own, unless its evaluation rides on the next round's training (``evaluation.pipelined``), after the last
    round's, once this round's trainers have scored its model."""
    connected = connected_nodes(grid)
    started = t = coord.open_round(connected)
    eligible = open_membership(grid, coord, mailbox, server_round, connected)
    plan = coord.plan_round(server_round, eligible, connected)
    t = coord.lap("open_s", t)
    ids = mailbox.push(messages(plan.nodes, TRAIN, coord.outgoing(), plan.order), TRAIN, server_round)
    t = coord.lap("push_train_s", t)
    end = coord.fix_bound(plan, started)
    pulled = mailbox.collect(ids, plan.train_bound_s)
    t = coord.lap("wait_train_s", t)
    replies = take(coord, pulled, server_round, TRAIN, connected_nodes(grid))
    coord.take_scores(server_round, replies)
    del pulled  # the messages' bytes: each reply holds its own arrays now (a model a device, twice otherwise)
    coord.close_train(plan, replies)
    ask(grid, coord, mailbox, server_round)  # who connected while it trained answers before the next round
    t = coord.lap("aggregate_s", t)
    rides = coord.rides(server_round)
    if coord.evaluates(server_round) and not rides:
        evaluate(grid, coord, mailbox, plan, end)
    record = coord.close_round(plan, started)
    mailbox.forget_old(server_round)
    return coord.release(record, rides)


def evaluate(grid: Grid, coord: Coordinator, mailbox: Mailbox, plan: PlannedRound, end: float) -> None:
    """The evaluation phase, its wait cut to what is left of the round's bound."""
    t, server_round = time.perf_counter(), plan.server_round
    nodes, order = coord.evaluation_nodes(server_round, connected_nodes(grid)), plan.order.for_evaluation()
    ids = mailbox.push(messages(nodes, EVALUATE, coord.outgoing(), order), EVALUATE, server_round)
    t = coord.lap("push_eval_s", t)
    pulled = mailbox.collect(ids, coord.evaluation_wait(plan, end))
    t = coord.lap("wait_eval_s", t)
    coord.close_evaluate(server_round, take(coord, pulled, server_round, EVALUATE, connected_nodes(grid)))
    ask(grid, coord, mailbox, server_round)
    coord.lap("close_eval_s", t)


# --- membership over the Grid ------------------------------------------------------------------
def connected_nodes(grid: Grid) -> set[str]:
    return {str(n) for n in grid.get_node_ids()}


def wait_for_devices(grid: Grid, cfg: FleetConfig) -> set[str]:
    """The connected nodes once ``membership.min_devices`` (default: the devices taking part) are there; a
    FleetError after ``federation.timeout_s`` (a fleet that never assembles must not hang the server)."""
    want, timeout_s = devices_wanted(cfg), cfg.federation.timeout_s
    deadline = time.monotonic() + timeout_s
    nodes = connected_nodes(grid)
    while len(nodes) < want:
        if time.monotonic() > deadline:
            raise FleetError(
                f"only {len(nodes)} of {want} devices connected within {timeout_s:.0f}s (federation.timeout_s); "
                "start the missing SuperNodes or lower membership.min_devices"
            )
        log.info("waiting for devices: %d of %d connected", len(nodes), want)
        time.sleep(1.0)
        nodes = connected_nodes(grid)
    return nodes


def open_membership(
    grid: Grid, coord: Coordinator, mailbox: Mailbox, server_round: int, connected: set[str]
) -> list[str]:
    """Take the query answers already in, query the nodes the coordinator asks about; the eligible nodes.
    With nobody eligible (the first round, or every device gone) it waits for query answers
    (:func:`wait_for_members`)."""
    waiting = mailbox.waiting(QUERY)
    if waiting:  # a device asked during the last round that has answered since takes part in this one
        take(coord, mailbox.collect(waiting, 0.0), server_round, QUERY, connected)
    ask(grid, coord, mailbox, server_round, connected)
    first = mailbox.first_queries()
    if first:  # a device that connected since the last round takes part in this one: its answer is waited for, once
        take(coord, mailbox.collect(first, coord.cfg.membership.grace_s), server_round, QUERY, connected)
    return coord.eligible(connected) or wait_for_members(grid, coord, mailbox, server_round)


def ask(grid: Grid, coord: Coordinator, mailbox: Mailbox, server_round: int, connected: set[str] | None = None) -> None:
    """Query the connected nodes the coordinator asks about (new ones, benched members), unless a query
    is out to them already."""
    connected = connected_nodes(grid) if connected is None else connected
    asked = {str(n) for n in mailbox.pending(QUERY)}
    mailbox.push(messages(coord.queries(connected, asked), QUERY), QUERY, server_round)


def wait_for_members(grid: Grid, coord: Coordinator, mailbox: Mailbox, server_round: int) -> list[str]:
    """Take query answers until enough devices are eligible, every query is answered, or
    ``federation.timeout_s`` has passed (a device that never answers holds up only this, and only this long)."""
    end = time.monotonic() + coord.cfg.federation.timeout_s
    while True:
        connected = connected_nodes(grid)
        eligible = coord.eligible(connected)
        waiting, left = mailbox.waiting(QUERY), end - time.monotonic()
        if coord.enough(eligible) or not waiting or left <= 0:
            return eligible
        take(coord, mailbox.collect(waiting, min(1.0, left)), server_round, QUERY, connected)


# --- records <-> Messages ----------------------------------------------------------------------
def messages(
    nodes: list[str], kind: str, arrays: dict[str, np.ndarray] | None = None, order: TrainOrder | None = None
) -> list[Message]:
    """One message of ``kind`` per node, all carrying the same content: the arrays and the order, if any."""
    content = RecordDict({keys.CONFIG: ConfigRecord({} if order is None else order.to_config())})
    if arrays is not None:
        content[keys.ARRAYS] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})
    return [Message(content, dst_node_id=int(n), message_type=MESSAGE_TYPES[kind]) for n in nodes]


def take(
    coord: Coordinator, pulled: list[tuple[Sent, Message]], server_round: int, phase: str, connected: set[str]
) -> list[Reply]:
    """The pulled replies as records, handed to the coordinator; the ones of this round's ``phase``."""
    return coord.take(server_round, phase, [unpack(sent, msg) for sent, msg in pulled], connected)


def unpack(sent: Sent, msg: Message) -> Reply:
    """What a reply says, unchecked: its claimed name, metrics and (to a train message) tensors, or why
    there are none."""
    reply = Reply(sent.node, sent.kind, sent.server_round, by_device=from_device(sent, msg), wall_s=sent.wall_s)
    if msg.has_error():
        reply.error = msg.error.reason
        return reply
    content = msg.content
    if keys.DEVICE in content.config_records:
        name = content.config_records[keys.DEVICE].get(keys.DEVICE_NAME)
        reply.name = name if isinstance(name, str) else None
    reply.metrics = dict(content.metric_records.get(keys.METRICS, {}))
    if keys.METRICS not in content.metric_records:
        reply.problem = f"no '{keys.METRICS}' MetricRecord"
    if sent.kind != TRAIN:
        return reply
    if len(content.array_records) != 1:
        reply.problem = f"expected one ArrayRecord, got {len(content.array_records)}"
        return reply
    for name, arr in next(iter(content.array_records.values())).items():
        try:
            reply.arrays[name] = array_view(arr)
        except Exception as exc:  # a corrupt payload is the device's fault, not the round's
            reply.problem = reply.problem or f"tensor {name!r} cannot be decoded ({type(exc).__name__})"
            break
    return reply


def array_view(arr: Array) -> np.ndarray:
    """The tensor a reply carries, read in place from the message's bytes (read-only): ``Array.numpy()`` copies
    every reply's model, 45 MB a ResNet-18, while the server waits to aggregate. Anything but a plain numeric
    ``.npy`` raises, as ``Array.numpy()`` would."""
    if arr.stype != SType.NUMPY:
        raise TypeError(f"serialization type {arr.stype!r} is not {SType.NUMPY!r}")
    return npy_view(arr.data)

"""The server's round loop, Flower-free: one visible loop, the coordinator's decisions as its hooks.

Design notes:

* **One loop owns the round.** :func:`run_round` opens it, takes in who joined, plans, pushes the
  train order, collects within the round's bounds, aggregates, evaluates (unless the evaluation rides
  on the next round's training, ``evaluation.pipelined``) and closes it; it times every part of it
  itself (:class:`~fleet.federated.on_server.wall.Lap`). Every decision inside is the
  :class:`~fleet.federated.on_server.coordinator.Coordinator`'s, as in flwr's ``fedavg.py`` a loop calls the
  strategy's hooks.
* **The transport is three calls.** A :class:`~fleet.federated.on_server.mailbox.Link` says who is
  connected, sends and receives; the :class:`~fleet.federated.on_server.mailbox.Mailbox` on top of it bounds
  every wait. server/ implements the link over Flower's Grid and does nothing else, and tests drive
  whole rounds through a fake one.
* **Membership waits are policy, and bounded.** The fleet starts once ``membership.min_devices``
  are connected (a FleetError after ``federation.timeout_s``); a round with nobody eligible, the
  first one among them, waits for query answers up to ``federation.timeout_s``, so the fleet's first
  round trains every device it waited for, however long a slow board takes to join (a pi4 profiling
  itself at a fifth of a core: about 90 s); in a running fleet, a device that connected since the last
  round is waited for ``membership.grace_s``, once.
"""

from __future__ import annotations

import logging
import time

from fleet.base.errors import FleetError
from fleet.federated.on_server.coordinator import Coordinator, PlannedRound, devices_wanted
from fleet.federated.on_server.mailbox import Link, Mailbox
from fleet.federated.on_server.server_run import ServerRun
from fleet.federated.on_server.wall import Lap
from fleet.federated.shared.config import FleetConfig
from fleet.federated.shared.records import EVALUATE, QUERY, TRAIN, Reply
from fleet.federated.shared.round_record import RoundRecord
from fleet.federated.shared.run_summary import RunSummary

log = logging.getLogger("fleet.server")


def run_fleet(link: Link, cfg: FleetConfig, *, resume: bool, simulated: bool = False) -> RunSummary:
    """Run (or continue) the fleet until ``federation.rounds`` or, when set, until the simulated clock
    reaches ``federation.time_budget_s``; returns the summary."""
    run = ServerRun.start(cfg, resume=resume, simulated=simulated)
    box = Mailbox(link)
    wait_for_devices(box, cfg)
    for server_round in run.rounds():
        run.keep(run_round(run.coordinator, box, server_round))
    return run.finish()


def run_round(coord: Coordinator, box: Mailbox, server_round: int) -> list[RoundRecord]:
    """One round: admit, plan, train, evaluate, within the round's whole bound; returns the records to write now:
    its own, unless its evaluation rides on the next round's training (``evaluation.pipelined``), after the last
    round's, once this round's trainers have scored its model."""
    connected = box.connected()
    started = t = coord.open_round(connected)
    eligible = open_membership(coord, box, server_round, connected)
    plan = coord.plan_round(server_round, eligible, connected)
    t = coord.lap(Lap.OPEN, t)
    ids = box.push(plan.nodes, TRAIN, server_round, coord.outgoing(), plan.order)
    t = coord.lap(Lap.PUSH_TRAIN, t)
    end = coord.fix_bound(plan, started)
    pulled = box.collect(ids, plan.train_bound_s)
    t = coord.lap(Lap.WAIT_TRAIN, t)
    replies = coord.take(server_round, TRAIN, pulled, box.connected())
    coord.take_scores(server_round, replies)
    del pulled  # each reply holds its own arrays now
    coord.close_train(plan, replies)
    ask(coord, box, server_round)  # who connected while it trained answers before the next round
    t = coord.lap(Lap.AGGREGATE, t)
    rides = coord.rides(server_round)
    if coord.evaluates(server_round) and not rides:
        evaluate(coord, box, plan, end)
    record = coord.close_round(plan, started)
    box.forget_old(server_round)
    return coord.release(record, rides)


def evaluate(coord: Coordinator, box: Mailbox, plan: PlannedRound, end: float) -> None:
    """The evaluation phase, its wait cut to what is left of the round's bound."""
    t, server_round = time.perf_counter(), plan.server_round
    nodes, order = coord.evaluation_nodes(server_round, box.connected()), plan.order.for_evaluation()
    ids = box.push(nodes, EVALUATE, server_round, coord.outgoing(), order)
    t = coord.lap(Lap.PUSH_EVAL, t)
    pulled = box.collect(ids, coord.evaluation_wait(plan, end))
    t = coord.lap(Lap.WAIT_EVAL, t)
    coord.close_evaluate(server_round, coord.take(server_round, EVALUATE, pulled, box.connected()))
    ask(coord, box, server_round)
    coord.lap(Lap.CLOSE_EVAL, t)


# --- membership ------------------------------------------------------------------------------------
def wait_for_devices(box: Mailbox, cfg: FleetConfig) -> set[str]:
    """The connected nodes once ``membership.min_devices`` (default: the devices taking part) are there; a
    FleetError after ``federation.timeout_s`` (a fleet that never assembles must not hang the server)."""
    want, timeout_s = devices_wanted(cfg), cfg.federation.timeout_s
    deadline = time.monotonic() + timeout_s
    nodes = box.connected()
    while len(nodes) < want:
        if time.monotonic() > deadline:
            raise FleetError(
                f"only {len(nodes)} of {want} devices connected within {timeout_s:.0f}s (federation.timeout_s); "
                "start the missing SuperNodes or lower membership.min_devices"
            )
        log.info("waiting for devices: %d of %d connected", len(nodes), want)
        time.sleep(1.0)
        nodes = box.connected()
    return nodes


def open_membership(coord: Coordinator, box: Mailbox, server_round: int, connected: set[str]) -> list[str]:
    """Take the query answers already in, query the nodes the coordinator asks about; the eligible nodes.
    With nobody eligible (the first round, or every device gone) it waits for query answers
    (:func:`wait_for_members`)."""
    waiting = box.waiting(QUERY)
    if waiting:  # a device asked during the last round that has answered since takes part in this one
        take_queries(coord, box.collect(waiting, 0.0), server_round, connected)
    ask(coord, box, server_round, connected)
    first = box.first_queries()
    if first and coord.eligible(connected):  # a newcomer to a running fleet takes part at once: waited for, once
        take_queries(coord, box.collect(first, coord.cfg.membership.grace_s), server_round, connected)
    return coord.eligible(connected) or wait_for_members(coord, box, server_round)


def ask(coord: Coordinator, box: Mailbox, server_round: int, connected: set[str] | None = None) -> None:
    """Query the connected nodes the coordinator asks about (new ones, benched members), unless a query
    is out to them already."""
    connected = box.connected() if connected is None else connected
    asked = {str(n) for n in box.pending(QUERY)}
    box.push(coord.queries(connected, asked), QUERY, server_round)


def wait_for_members(coord: Coordinator, box: Mailbox, server_round: int) -> list[str]:
    """Take query answers until enough devices are eligible, every query is answered, or
    ``federation.timeout_s`` has passed (a device that never answers holds up only this, and only this long)."""
    end = time.monotonic() + coord.cfg.federation.timeout_s
    while True:
        connected = box.connected()
        eligible = coord.eligible(connected)
        waiting, left = box.waiting(QUERY), end - time.monotonic()
        if coord.enough(eligible) or not waiting or left <= 0:
            return eligible
        take_queries(coord, box.collect(waiting, min(1.0, left)), server_round, connected)


def take_queries(coord: Coordinator, pulled: list[Reply], server_round: int, connected: set[str]) -> None:
    """Query answers handed to the coordinator (any late train or evaluation reply among them is its to drop)."""
    coord.take(server_round, QUERY, pulled, connected)

"""Open membership over Flower: who is connected, who answered a query, who is sampled.

A thin adapter over :mod:`fleet.federated.membership`: it sends query messages through
the :class:`~server.mailbox.Mailbox` and turns their replies into members or refusals.
A device joins by answering a query (its name and full-round time); a device whose
query fails (a bad data tree, a bad profile) or whose name is taken is refused with
the reason, and asked again in later rounds, since its owner may fix it.
"""

from __future__ import annotations

import logging
import time

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fleet.base.errors import FleetError
from fleet.federated import keys, membership, schema
from fleet.federated.aggregate import error_summary
from fleet.federated.config import FleetConfig
from fleet.federated.device import DEVICE_NAME
from fleet.federated.state import ServerState
from server.mailbox import Mailbox, Sent, from_device
from server.strategy import claimed_name

log = logging.getLogger("fleet.server")


def connected_nodes(grid: Grid) -> set[str]:
    return {str(n) for n in grid.get_node_ids()}


def wait_for_devices(grid: Grid, cfg: FleetConfig) -> set[str]:
    """The connected nodes once ``membership.min_devices`` (default: the devices taking part) are there; a
    FleetError after ``federation.timeout_s`` (a fleet that never assembles must not hang the server)."""
    fed = cfg.federation
    want = cfg.membership.min_devices or cfg.devices.taking_part
    deadline = time.monotonic() + fed.timeout_s
    nodes = connected_nodes(grid)
    while len(nodes) < want:
        if time.monotonic() > deadline:
            raise FleetError(
                f"only {len(nodes)} of {want} devices connected within {fed.timeout_s:.0f}s (federation.timeout_s); "
                "start the missing SuperNodes or lower membership.min_devices"
            )
        log.info("waiting for devices: %d of %d connected", len(nodes), want)
        time.sleep(1.0)
        nodes = connected_nodes(grid)
    return nodes


def query_messages(nodes: list[str]) -> list[Message]:
    content = RecordDict({keys.CONFIG: ConfigRecord({})})
    return [Message(content, dst_node_id=int(n), message_type=MessageType.QUERY) for n in nodes]


class Membership:
    """The round loop's view of the fleet: the roster in ``state`` plus this run's refusals."""

    def __init__(self, cfg: FleetConfig, state: ServerState, mailbox: Mailbox) -> None:
        self.cfg, self.state, self.mailbox = cfg, state, mailbox
        self.refusals: dict[str, str] = {}  # node -> the last reason it was refused (logged once)

    def open_round(self, grid: Grid, server_round: int, wait_s: float) -> list[str]:
        """Query new and benched devices; returns the eligible ones. With nobody eligible (the first
        round, or every device gone) it waits up to ``wait_s`` for answers, then stops the run."""
        roster, att = self.state.roster, self.state.replies.attendance
        connected = connected_nodes(grid)
        att.connected = len(connected)
        asked = {str(n) for n in self.mailbox.pending("query")}
        bench = set(membership.benched(roster, connected, self.cfg.membership.max_missed))
        ask = sorted(n for n in connected if (n not in roster or n in bench) and n not in asked)
        self.mailbox.push(query_messages(ask), "query", server_round)
        eligible = membership.eligible(roster, connected, self.cfg.membership.max_missed)
        if not eligible:
            eligible = self.wait_for_members(grid, server_round, wait_s)
        att.benched = [roster[n]["name"] for n in membership.benched(roster, connected, self.cfg.membership.max_missed)]
        if not eligible:
            reasons = "; ".join(sorted(set(self.refusals.values()))) or "none answered its query"
            raise FleetError(f"round {server_round}: no device could take part within {wait_s:.0f}s ({reasons})")
        return eligible

    def wait_for_members(self, grid: Grid, server_round: int, wait_s: float) -> list[str]:
        """Take query answers until ``min_devices`` are eligible, every query is answered, or ``wait_s``
        has passed (a device that never answers holds up only this, and only this long)."""
        want, end = self.cfg.membership.min_devices or self.cfg.devices.taking_part, time.monotonic() + wait_s
        while True:
            connected = connected_nodes(grid)
            eligible = membership.eligible(self.state.roster, connected, self.cfg.membership.max_missed)
            waiting = {i for i, s in self.mailbox.sent.items() if s.kind == "query"}
            left = end - time.monotonic()
            if len(eligible) >= want or not waiting or left <= 0:
                return eligible
            replies = self.mailbox.collect(waiting, min(1.0, left), server_round, "query")
            self.take(replies, connected, server_round)

    def take(self, replies: list[tuple[Sent, Message]], connected: set[str], server_round: int) -> list[Message]:
        """Admit or refuse the query replies among ``replies``; returns the other replies the devices
        themselves sent (one the SuperLink wrote for a device that went silent is no answer)."""
        others = []
        for sent, msg in replies:
            if not from_device(sent, msg):
                log.debug("round %d: %s", server_round, error_summary(msg.error.reason) if msg.has_error() else "")
            elif sent.kind == "query":
                self.on_query(msg, connected, server_round)
            else:
                others.append(msg)
        return others

    def on_query(self, msg: Message, connected: set[str], server_round: int) -> None:
        node = str(msg.metadata.src_node_id)
        name, reason = claimed_name(msg), None
        if msg.has_error():
            reason = error_summary(msg.error.reason)
        else:
            metrics = dict(msg.content.metric_records.get(keys.METRICS, {}))
            reason = schema.metric_problem(metrics, schema.QUERY)
            if reason is None and (name is None or not DEVICE_NAME.fullmatch(name)):
                reason = f"query reply without a usable '{keys.DEVICE_NAME}' ({name!r})"
            if reason is None:
                full = float(metrics[keys.FULL_TIME_S])
                reason = membership.admit(self.state.roster, node, name, full, connected)
        if reason is not None:
            self.refuse(node, name, reason, server_round)
            return
        self.refusals.pop(node, None)
        self.state.replies.attendance.joined.append(name)
        log.info("round %d: device %s (node %s) joined", server_round, name, node)

    def refuse(self, node: str, name: str | None, reason: str, server_round: int) -> None:
        self.state.replies.attendance.refused.append({"node_id": int(node), "device": name, "reason": reason})
        if self.refusals.get(node) != reason:
            who = f"device {name} (node {node})" if name else f"node {node}"
            log.warning("round %d: refused %s: %s", server_round, who, reason)
        self.refusals[node] = reason

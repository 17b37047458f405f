"""Messages out, replies in, and no wait without a bound; Flower-free.

The round talks to its devices through a :class:`Link`: three calls, which server/ implements
over Flower's Grid (and tests with a fake). Flower's ``Grid.send_and_receive`` waits for the
replies of one batch only and polls every 3 s. The fleet needs more: a round waits for its
sampled devices' train replies until the round closes, while queries to joining or benched
devices ride along and are picked up whenever they answer. :class:`Mailbox` keeps every message
it pushed until its reply is pulled (or it is given up), so nothing is waited on twice, and hands
each reply up as a :class:`~fleet.federated.shared.records.Reply` that says what it answers: the
coordinator decides what is late.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fleet.federated.shared.records import QUERY, Reply, TrainOrder

POLL_S = 0.1  # the longest pause between pulls: a reply is picked up within this of its arrival
FIRST_POLL_S = 0.02  # the pause after a push or a reply, doubled while nothing comes, up to POLL_S
PULL_DECAY = 0.8  # the pull time a wait keeps in hand follows a slower pull at once, a faster one by this a pull
FORGET_ROUNDS = 3  # a message unanswered this many rounds later is no longer pulled (a query is then sent again)


@dataclass
class Sent:
    """A message out: what the reply to it answers."""

    kind: str  # records.QUERY, TRAIN or EVALUATE
    node: int
    server_round: int
    pushed_s: float = 0.0  # time.monotonic() when it was pushed
    first: bool = False  # the first query to its node (its answer is waited for, once)


class Link(Protocol):
    """What a round needs of a transport: who is connected, send, receive. Only conversion belongs in it."""

    def nodes(self) -> set[str]:
        """The ids of the nodes connected now."""
        ...

    def send(
        self, nodes: list[str], kind: str, arrays: dict[str, np.ndarray] | None, order: TrainOrder | None
    ) -> list[str]:
        """One message of ``kind`` per node, all with the same content; their ids, in the nodes' order."""
        ...

    def receive(self, sent: Mapping[str, Sent]) -> list[tuple[str, Reply]]:
        """The replies that have come to the messages in ``sent`` (by id), each unpacked (unchecked), with
        the id it answers; ``Reply.wall_s`` is the mailbox's to set."""
        ...


class Mailbox:
    """Every message pushed and not yet answered, and the replies that came back."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.sent: dict[str, Sent] = {}
        self.asked: set[int] = set()  # nodes ever sent a query
        self.pull_s = 0.0  # how long a pull that brings replies takes, lately at most (decaying)

    def connected(self) -> set[str]:
        return self.link.nodes()

    def push(
        self,
        nodes: list[str],
        kind: str,
        server_round: int,
        arrays: dict[str, np.ndarray] | None = None,
        order: TrainOrder | None = None,
    ) -> set[str]:
        ids = self.link.send(nodes, kind, arrays, order) if nodes else []
        for msg_id, node in zip(ids, map(int, nodes)):
            first = kind == QUERY and node not in self.asked
            self.sent[msg_id] = Sent(kind, node, server_round, time.monotonic(), first=first)
            self.asked.update([node] if kind == QUERY else [])
        return set(ids)

    def first_queries(self) -> set[str]:
        """Ids of first queries still unanswered, each handed out once."""
        ids = {i for i, s in self.sent.items() if s.first}
        for i in ids:
            self.sent[i].first = False
        return ids

    def collect(self, wait_for: set[str], timeout_s: float) -> list[Reply]:
        """Pull until every message in ``wait_for`` is answered or ``timeout_s`` has passed; returns
        every reply pulled meanwhile (late ones included). A pull that brings replies takes time
        (each carries the model): none starts that would end past ``timeout_s`` by the time such
        pulls lately took, so the wait keeps its bound."""
        end = time.monotonic() + max(0.0, timeout_s)
        replies: list[Reply] = []
        waiting = set(wait_for)
        pause = FIRST_POLL_S  # replies come in bursts (a simulation's workers finish together): look again soon
        while True:
            started, before = time.monotonic(), len(replies)
            for msg_id, reply in self._pull():
                sent = self.sent.pop(msg_id, None)
                waiting.discard(msg_id)
                if sent is not None:
                    reply.wall_s = time.monotonic() - sent.pushed_s
                    replies.append(reply)
            if len(replies) > before:
                self.pull_s = max(time.monotonic() - started, PULL_DECAY * self.pull_s)
                pause = FIRST_POLL_S
            left = end - time.monotonic() - self.pull_s
            if not waiting or left <= 0:
                return replies
            time.sleep(min(pause, left))
            pause = min(2 * pause, POLL_S)

    def _pull(self) -> list[tuple[str, Reply]]:
        return self.link.receive(self.sent) if self.sent else []  # read only: popped once it returns

    def forget_old(self, server_round: int) -> None:
        """Stop pulling messages of rounds long closed (a dead device never answers)."""
        stale = [i for i, s in self.sent.items() if s.server_round <= server_round - FORGET_ROUNDS]
        for msg_id in stale:
            del self.sent[msg_id]

    def pending(self, kind: str) -> set[int]:
        """Nodes with a message of ``kind`` still unanswered (a query is not sent twice)."""
        return {s.node for s in self.sent.values() if s.kind == kind}

    def waiting(self, kind: str) -> set[str]:
        """Ids of the messages of ``kind`` still unanswered."""
        return {i for i, s in self.sent.items() if s.kind == kind}

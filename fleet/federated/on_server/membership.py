"""Who is in the fleet: devices join, leave, die and come back; the server samples from who is here.

Pure bookkeeping over :class:`~fleet.federated.shared.records.Member` entries (the checkpoint holds them
as plain dicts, fleet.federated.on_server.state). A device
becomes a member once it has answered a query (its name, its full-round time); a member
is eligible while it is connected and has not missed ``max_missed`` rounds in a row; a
benched member is eligible again once it answers a query.

Design notes:

* **Names, not node ids.** A SuperNode that restarts gets a new node id, so results and
  device state follow the device's name. A name held by a live, answering node is not
  handed to a second node (two devices claiming one name would merge silently); a name
  whose node is gone or has missed its last round moves to the new node: that is a
  restarted device.
* **Seeded sampling.** The sample is drawn from the eligible devices sorted by name, with
  a generator seeded by the run's seed and the round, so the same fleet samples the same
  devices whatever node ids the SuperLink handed out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from fleet.federated.shared.records import Member

Roster = dict[str, Member]  # node id (as a string: checkpoint keys) -> its member entry


def member(name: str, full_time_s: float) -> Member:
    """A device that has just joined: ``profile_s`` keeps the full-round time it joined with, and its
    later reports are clamped around it (fleet.federated.on_server.robust.plausible)."""
    return Member(name, float(full_time_s), float(full_time_s))


def holder_of(roster: Mapping[str, Member], name: str) -> str | None:
    return next((node for node, m in roster.items() if m.name == name), None)


def admit(roster: Roster, node: str, name: str, full_time_s: float, connected: Iterable[str]) -> str | None:
    """Make ``node`` the member called ``name``; the reason it is refused, or None when admitted."""
    holder = holder_of(roster, name)
    if holder is not None and holder != node:
        if holder in set(connected) and roster[holder].missed == 0:
            return (
                f"device name {name!r} is already used by node {holder}; "
                "give each SuperNode its own device-name (--node-config \"device-name='pi-2'\")"
            )
        del roster[holder]  # the device restarted as a new node: its name (and state) moves with it
    previous = roster.get(node)
    roster[node] = member(name, full_time_s)
    if previous is not None and previous.name == name:  # benched and back: what was learned of it stays
        roster[node].overhead_s = previous.overhead_s
    return None


def eligible(roster: Mapping[str, Member], connected: Iterable[str], max_missed: int) -> list[str]:
    """Connected members that have not missed ``max_missed`` rounds in a row, in name order."""
    here = set(connected)
    nodes = [n for n, m in roster.items() if n in here and m.missed < max_missed]
    return sorted(nodes, key=lambda n: roster[n].name)


def benched(roster: Mapping[str, Member], connected: Iterable[str], max_missed: int) -> list[str]:
    """Connected members left out for missing rounds: they are sent a query until one answers."""
    here = set(connected)
    return sorted(n for n, m in roster.items() if n in here and m.missed >= max_missed)


TRAIN_STREAM, EVAL_STREAM = 13, 17  # independent seeded draws: who trains, and who of them is evaluated


def sample(nodes: list[str], k: int | None, seed: int, server_round: int, stream: int = TRAIN_STREAM) -> list[str]:
    """Up to ``k`` of ``nodes`` (all when k is None or covers them), the same for the same seed and round."""
    if k is None or k >= len(nodes):
        return list(nodes)
    rng = np.random.default_rng([seed, stream, server_round])
    picked = rng.choice(len(nodes), size=k, replace=False)
    return [nodes[i] for i in sorted(picked)]


OVERHEAD_DECAY = 0.8  # a learned overhead follows a slower round trip at once and a faster one by this a reply


def learn_overhead(previous: float | None, wall_s: float, work_s: float, cap_s: float) -> float:
    """A member's round-trip overhead after one more timed reply: the server's ``wall_s`` less the
    ``work_s`` the device says its own work took (held to [0, wall_s]: a device cannot shrink the
    server's clock). It follows a slower trip at once and a faster one slowly, since it only widens a
    wait bound, where too tight drops a healthy device; ``cap_s`` keeps a slow liar from widening it
    without end."""
    sample = wall_s - min(max(work_s, 0.0), wall_s)
    value = sample if previous is None else max(sample, OVERHEAD_DECAY * previous)
    return min(value, cap_s)


def overhead_of(roster: Mapping[str, Member], nodes: Iterable[str]) -> float:
    """The largest learned overhead among ``nodes`` (0 before any was timed): what a wait on them adds."""
    return max((roster[n].overhead_s or 0.0 for n in nodes if n in roster), default=0.0)


def record_attendance(roster: Roster, sampled: Iterable[str], answered: Iterable[str]) -> list[str]:
    """Count a missed round for each sampled member without an answer (reset for the others);
    returns the names of those that missed."""
    answered = set(answered)
    missed = []
    for node in sampled:
        if node not in roster:
            continue
        if node in answered:
            roster[node].missed = 0
        else:
            roster[node].missed += 1
            missed.append(roster[node].name)
    return missed


def full_times(roster: Mapping[str, Member], nodes: Iterable[str]) -> dict[str, float]:
    return {n: roster[n].full_time_s for n in nodes if n in roster}


def name_of(roster: Mapping[str, Member], node: str) -> str | None:
    m = roster.get(node)
    return None if m is None else m.name


@dataclass(frozen=True)
class Refusal:
    """A device that answered a query and was not admitted, and why (it is asked again later)."""

    node_id: int
    device: str | None  # the name it claimed, if any
    reason: str


@dataclass
class Attendance:
    """What one round's membership did: for metrics.jsonl and the progress line."""

    connected: int = 0
    sampled: list[str] = field(default_factory=list)  # device names
    missed: list[str] = field(default_factory=list)
    misses: dict[str, str] = field(default_factory=dict)  # device name -> why it missed the round
    joined: list[str] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    benched: list[str] = field(default_factory=list)
    offline: list[str] = field(default_factory=list)  # simulated device classes: eligible, but not online
    online: int = 0  # eligible devices online when the round sampled (all of them without availability)
    sampled_at_s: float = 0.0  # the simulated clock when the round sampled: where a trace is read

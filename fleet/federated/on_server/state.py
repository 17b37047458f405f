"""The server's state: one object the round loop owns, checkpointed after every round.

:class:`ServerState` holds everything that outlives a round (round number, clocks,
the devices' full-training times, the global importance signal) and, in
``replies``, what the current round's replies brought. The coordinator
(fleet.federated.on_server.coordinator) reads and writes this object and keeps no state of
its own that outlives a run, so what a resumed run needs is exactly what the
checkpoint holds. Written atomically, so a server killed at any
moment resumes from the last completed round with nothing lost.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fleet.base.atomic import load_torch, save_torch
from fleet.base.errors import FleetError
from fleet.federated.on_server.aggregate import Rejection
from fleet.federated.on_server.defense import DefenseReport
from fleet.federated.on_server.membership import Attendance, Roster
from fleet.federated.on_server.similarity import History
from fleet.federated.on_server.trust import Trust
from fleet.federated.on_server.wall import ServerWork
from fleet.federated.shared.records import Accuracy, EvaluateReply, Member, TrainReply
from fleet.federated.shared.round_record import RoundRecord

CHECKPOINT_FILE = "checkpoint.pt"


@dataclass
class RoundReplies:
    """What one round's replies brought; a new one each round (not checkpointed: a resumed round is run again)."""

    sent: dict[str, np.ndarray] = field(default_factory=dict)  # the global arrays the round started from
    train: list[TrainReply] = field(default_factory=list)  # accepted train replies (aggregated)
    answered: list[str] = field(default_factory=list)  # nodes whose train reply came without a device failure
    round_time_s: float = 0.0  # the slowest accepted device's compute plus upload (the simulated clock's step)
    evaluation: list[EvaluateReply] = field(default_factory=list)  # accepted evaluate replies
    accuracy: Accuracy | None = None  # the round's evaluation; None when it did not evaluate or nobody answered
    rejections: list[Rejection] = field(default_factory=list)  # train replies the round went on without
    senders: dict[str, int] = field(default_factory=dict)  # tensor -> devices that trained it this round
    attendance: Attendance = field(default_factory=Attendance)  # who was here, sampled, missed, joined
    defense: DefenseReport = field(default_factory=DefenseReport)  # what robust aggregation did
    timings: dict[str, float] = field(default_factory=dict)  # the server's wall seconds per part of the round
    no_answer: dict[str, str] = field(default_factory=dict)  # node -> why the SuperLink, not the device, replied
    expected_work: ServerWork | None = None  # the server's work after the train wait, as the bound allowed for it
    round_bound_s: float | None = None  # the whole round's wall-time bound, fixed once its train messages are out

    def lap(self, key: str, started: float) -> float:
        """Record the seconds since ``started`` under ``key``; returns now, the next part's start."""
        now = time.perf_counter()
        self.timings[key] = round(now - started, 4)
        return now


@dataclass
class ServerState:
    """What the loop carries from round to round."""

    round: int = 0
    sim_time_s: float = 0.0
    wall_time_s: float = 0.0
    run_tag: str = ""
    roster: Roster = field(default_factory=dict)  # node id -> member (fleet.federated.on_server.membership)
    global_importance: dict[str, float] = field(default_factory=dict)
    # device name -> the round its update was rejected for pulling the model back: while its updates stay
    # oversized it is not trusted again (an honest device is never oversized), back to ordinary size it is
    suspects: dict[str, int] = field(default_factory=dict)
    # device name -> the recent rounds its update pointed against the others' or the last step (robust.strikes)
    strikes: dict[str, list[int]] = field(default_factory=dict)
    # tensor -> its typical update norm (lower median over its senders) as the defense last bounded it: a bound
    # may grow from it by robust.norm_growth a round, so attackers alone on a tensor cannot set their own
    typical_norms: dict[str, float] = field(default_factory=dict)
    # the secret each round's judged coordinates are drawn from (robust.round_key): a deployment's from the OS,
    # never sent to a device, so none can poison only the coordinates it knows go unread; a simulation's from
    # train.seed, so a seeded experiment repeats (its devices are the project's own code)
    screen_secret: int = 0
    # tensor -> the global model's last step on it (robust.min_cos judges updates against it); not checkpointed:
    # a resumed run judges against the first step it takes
    last_step: dict[str, np.ndarray] = field(default_factory=dict)
    momentum: dict[str, np.ndarray] = field(default_factory=dict)  # federation.server_momentum, per trained tensor
    # device -> tensor -> its summed update (robust.similarity); not checkpointed: a resumed run sums afresh
    similarity: History = field(default_factory=dict)
    # device -> its update's cosine with the server's own step, one per round it sent (robust.validate: trust)
    trust: Trust = field(default_factory=dict)
    server_work: ServerWork | None = (
        None  # the server's own seconds around the waits, learned (fleet.federated.on_server.wall)
    )
    # the last round's metrics.jsonl record, written once the next round's trainers have scored its model
    # (evaluation.pipelined); checkpointed, so a resumed run scores and writes it too
    held: RoundRecord | None = None
    replies: RoundReplies = field(default_factory=RoundReplies)

    def finish_round(self, server_round: int, round_time_s: float, wall_s: float) -> None:
        """Advance the round number and both clocks once a round's replies are in."""
        self.round = server_round
        self.sim_time_s += round_time_s
        self.wall_time_s += wall_s

    def persistent(self) -> dict:
        """Plain values only: the checkpoint is read back with weights_only, which loads no classes."""
        meta = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in TENSORS}
        meta["roster"] = {node: m.as_dict() for node, m in self.roster.items()}
        meta["server_work"] = None if self.server_work is None else dataclasses.asdict(self.server_work)
        meta["held"] = None if self.held is None else self.held.to_json()
        return meta


# not in the checkpoint's meta: the round's replies, and arrays (momentum is saved as tensors, the last step not)
TENSORS = ("replies", "momentum", "last_step", "similarity")


def _tensors(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v)) for k, v in arrays.items()}


def save_checkpoint(out: Path, arrays: dict[str, np.ndarray], state: ServerState) -> Path:
    path = out / CHECKPOINT_FILE
    save_torch(path, {"model": _tensors(arrays), "meta": state.persistent(), "momentum": _tensors(state.momentum)})
    return path


def load_checkpoint(out: Path) -> tuple[dict[str, torch.Tensor], ServerState] | None:
    obj = load_torch(out / CHECKPOINT_FILE)
    if not obj or "model" not in obj or "meta" not in obj:
        return None
    known = {f.name for f in dataclasses.fields(ServerState)} - set(TENSORS)
    state = ServerState(**{k: v for k, v in obj["meta"].items() if k in known})
    state.roster = {node: Member.from_dict(m) for node, m in state.roster.items()}
    state.server_work = _work(obj["meta"].get("server_work"))
    held = obj["meta"].get("held")
    state.held = RoundRecord.from_json(held) if isinstance(held, dict) else None
    state.momentum = {k: v.numpy() for k, v in obj.get("momentum", {}).items()}
    return obj["model"], state


def _work(saved: object) -> ServerWork | None:
    """The learned server work of a checkpoint; one it cannot read is relearned (it only sizes a bound)."""
    try:
        return ServerWork(**saved) if isinstance(saved, dict) else None
    except TypeError:
        return None


def check_resumable(out: Path) -> None:
    """A resume that cannot read its checkpoint stops here, with every file as it was: starting
    over would rewrite metrics.jsonl from round 1 and lose the rounds already run."""
    path = out / CHECKPOINT_FILE
    if path.exists() and load_checkpoint(out) is None:
        raise FleetError(
            f"resume: {path} cannot be read (cut short or not a fleet checkpoint); nothing was changed. "
            f"Restore it, or move {out} aside and start without resume"
        )
    if not path.exists() and (out / "metrics.jsonl").is_file():
        raise FleetError(
            f"resume: {out} has metrics.jsonl but no {CHECKPOINT_FILE}; nothing was changed. "
            f"Restore the checkpoint, or move {out} aside and start without resume"
        )


def keep_previous_run(out: Path, name: str, log: Callable[[str], None] = print) -> Path | None:
    """Move a finished or interrupted run in ``out`` aside (``<out>.<timestamp>``) before a fresh
    start, so that starting again never overwrites results."""
    if not (out / CHECKPOINT_FILE).exists():
        return None
    backup = out.with_name(f"{out.name}.{time.strftime('%Y%m%d-%H%M%S')}")
    shutil.move(str(out), backup)
    log(f"kept the previous run of {name} in {backup}")
    return backup

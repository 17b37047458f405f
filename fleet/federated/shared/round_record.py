"""A round's record, typed: the one line of ``metrics.jsonl`` each round writes, and its rows per device.

The coordinator builds a :class:`RoundRecord` as a round closes, the tracker serializes it, and the
benches, the plots and the progress lines read it back through the same type, so each metrics.jsonl key
is named once: a field's name is its key (``device_class`` is written ``class``). Design notes:

* **What a line leaves out.** A device row holds only what happened (a device that only evaluated has
  no training figures), so its ``None`` fields are not written; a round always writes its own figures,
  ``None`` included, except the few only some runs make (:data:`OPTIONAL`).
* **Old lines.** A key this version does not know is dropped on reading, and one it lacks reads as
  ``None``: a run written before a field existed still loads.
* **Figures made once.** The accuracies of a round, its p10 and its rows' round speedups are computed
  when the record is made (:mod:`fleet.federated.on_server.tracking`); readers take them from the record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

JSON_KEY = "json"  # a field's metrics.jsonl key, where it is not the field's name
OPTIONAL = "optional"  # a field left out of the line while it is None


def optional_field(json_key: str | None = None) -> Any:
    meta: dict[str, Any] = {OPTIONAL: True}
    if json_key is not None:
        meta[JSON_KEY] = json_key
    return field(default=None, metadata=meta)


def key_of(f: dataclasses.Field) -> str:
    return f.metadata.get(JSON_KEY, f.name)


def fields_json(record: Any) -> dict[str, Any]:
    """A record dataclass as its JSON object: each field under its key, the optional ones only when set."""
    out = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if value is None and f.metadata.get(OPTIONAL):
            continue
        out[key_of(f)] = value
    return out


def from_json_fields(cls: type, line: Mapping[str, Any], **given: Any) -> Any:
    """``cls`` from a JSON object by its fields' keys (unknown keys dropped, missing ones default); ``given``
    fields are built by the caller (nested records)."""
    values = {f.name: line[key_of(f)] for f in dataclasses.fields(cls) if key_of(f) in line}
    return cls(**{**values, **given})


@dataclass
class DeviceRow:
    """One device in one round: its train reply's figures if it trained, its scores if it was evaluated, and
    what the server derived (its class, its round on the simulated clock, its round speedup). Field names follow
    :class:`~fleet.federated.shared.records.TrainReply` and :class:`~fleet.federated.shared.records.EvaluateReply`."""

    device: str | None = optional_field()  # the roster's name, else node-<id>
    node_id: int | None = optional_field()
    device_class: str | None = optional_field("class")  # simulated or testbed device classes only
    partition_id: int | None = optional_field()
    # --- what its train reply said (fleet.federated.shared.records.TrainReply) ---
    tier: float | None = optional_field()
    selected: int | None = optional_field()
    num_tensors: int | None = optional_field()
    trained_fraction: float | None = optional_field()
    rho: float | None = optional_field()
    predicted_time_s: float | None = optional_field()
    measured_time_s: float | None = optional_field()
    full_time_s: float | None = optional_field()
    bytes_uploaded: int | None = optional_field()
    steps: int | None = optional_field()
    personal_selected: int | None = optional_field()
    loss: float | None = optional_field()
    rounds_trained: int | None = optional_field()
    memory_budget_bytes: float | None = optional_field()
    memory_peak_bytes: float | None = optional_field()
    memory_added_s: float | None = optional_field()
    cuda: int | None = optional_field()
    ready_s: float | None = optional_field()
    score_time_s: float | None = optional_field()
    eval_time_s: float | None = optional_field()  # its scoring, in its train reply (pipelined) and evaluation together
    # ... of which its train reply's: work inside the train message, so inside its wall_s
    train_eval_time_s: float | None = optional_field()
    train_examples: float | None = optional_field()  # its sample weight, when it trained
    speedup: float | None = optional_field()  # its compute's speedup: set exactly when it trained
    wall_s: float | None = optional_field()  # the server's wall seconds from the train message to its reply
    # --- what the server derived for it ---
    round_time_s: float | None = optional_field()  # its round on the simulated clock
    fixed_s: float | None = optional_field()  # what its round costs whatever it trains (start, download); None: 0
    round_speedup: float | None = optional_field()  # its whole round against training and uploading everything
    # --- what its evaluation said (fleet.federated.shared.records.EvaluateReply) ---
    global_accuracy: float | None = optional_field()
    personal_accuracy: float | None = optional_field()
    finetuned_accuracy: float | None = optional_field()
    finetune_time_s: float | None = optional_field()
    eval_ready_s: float | None = optional_field()
    test_examples: float | None = optional_field()  # its held-out split's size, when it was evaluated

    @property
    def trained(self) -> bool:
        return self.speedup is not None

    @property
    def whole_round_speedup(self) -> float:
        """Its round speedup, else (a run without uplinks) its compute's."""
        return self.round_speedup if self.round_speedup is not None else self.speedup or 0.0

    def to_json(self) -> dict[str, Any]:
        return fields_json(self)

    @classmethod
    def from_json(cls, line: Mapping[str, Any]) -> DeviceRow:
        return from_json_fields(cls, line)


@dataclass
class RejectionRow:
    """A reply the round went on without (fleet.federated.on_server.aggregate.Rejection), as the record keeps it."""

    round: int = 0
    node_id: int | None = None
    device: str | None = None  # its name, when the server knew it
    reason: str = ""


@dataclass
class RoundRecord:
    """One round: its clocks and bounds, the fleet's accuracy, its bytes, what the defense and the membership
    did, and a :class:`DeviceRow` per device."""

    round: int = 0
    strategy: str = ""  # federation.strategy: fleet, naive, fedavg, ditto, ...
    deadline_s: float = 0.0  # the compute deadline each device planned its round for (0: train fully)
    round_time_s: float = 0.0  # the round on the simulated clock
    sim_time_s: float = 0.0  # the simulated clock at its close
    wall_time_s: float = 0.0  # the run's wall seconds at its close
    # the devices' scores of its model, weighted by their test samples: None while unscored
    global_accuracy: float | None = None
    personal_accuracy: float | None = None
    personal_accuracy_p10: float | None = None
    finetuned_accuracy: float | None = optional_field()  # personalization.finetune_steps only
    finetuned_accuracy_p10: float | None = optional_field()
    bytes_uploaded: int = 0  # of the accepted replies' tensors, as the server counted them
    tensors_trained_by_nobody: int = 0  # trainable tensors no accepted reply carried: they kept last round's values
    rejections: list[RejectionRow] = field(default_factory=list)
    defense: dict = field(default_factory=dict)  # what the defense capped, clipped and screened (defense.DefenseReport)
    server_s: dict[str, float] = field(default_factory=dict)  # the server's wall seconds per part of the round
    devices: list[DeviceRow] = field(default_factory=list)
    round_wall_s: float | None = None  # its own wall seconds
    round_bound_s: float | None = None  # what its wall seconds were bounded by
    train_bound_s: float | None = None  # how long the training wave was waited for
    eval_bound_s: float | None = None  # ... and the evaluation wave
    # --- what the membership did (fleet.federated.on_server.membership.Attendance), by device name ---
    connected: int = 0  # nodes connected when the round opened
    sampled: list[str] = field(default_factory=list)  # asked to train
    missed: list[str] = field(default_factory=list)  # sampled, but no accepted reply within the bound
    miss_reasons: dict[str, str] = field(default_factory=dict)  # why each one missed
    joined: list[str] = field(default_factory=list)  # admitted this round
    refused: list[dict] = field(default_factory=list)  # not admitted: node_id, device and reason (membership.Refusal)
    benched: list[str] = field(default_factory=list)  # left out after missing membership.max_missed rounds in a row
    offline: list[str] = field(default_factory=list)  # simulated classes: eligible, but not online
    online: int = 0  # eligible devices online when the round sampled
    sampled_at_s: float = 0.0  # the simulated clock when it sampled: where a trace was read
    server_accuracy: float | None = optional_field()  # evaluation.server_test only
    evaluated_in_round: int | None = optional_field()  # evaluation.pipelined: the round whose trainers scored it

    @property
    def evaluated(self) -> bool:
        return self.global_accuracy is not None

    def trained_rows(self) -> list[DeviceRow]:
        return [d for d in self.devices if d.trained]

    def to_json(self) -> dict[str, Any]:
        out = fields_json(self)
        out["rejections"] = [dataclasses.asdict(r) for r in self.rejections]
        return {**out, "devices": [d.to_json() for d in self.devices]}

    @classmethod
    def from_json(cls, line: Mapping[str, Any]) -> RoundRecord:
        devices = [DeviceRow.from_json(d) for d in line.get("devices", [])]
        rejections = [from_json_fields(RejectionRow, r) for r in line.get("rejections", [])]
        return from_json_fields(cls, line, devices=devices, rejections=rejections)


ACCURACIES = ("global_accuracy", "personal_accuracy", "server_accuracy")  # what a bench may read a run's score by


def accuracy_of(record: RoundRecord, which: str) -> float | None:
    """The record's accuracy named ``which`` (one of :data:`ACCURACIES`)."""
    if which not in ACCURACIES:
        raise ValueError(f"accuracy {which!r}: use one of {', '.join(ACCURACIES)}")
    return getattr(record, which)

"""Typed records of what crosses the wire, and of who is in the fleet.

A Message carries config and metric dicts keyed by strings (:mod:`fleet.federated.shared.keys`). Every
conversion between those dicts and typed fields happens here, once: a field names its wire key in
its metadata, :func:`wire_fields` reads them, and a reply is typed only after
:mod:`fleet.federated.shared.schema` has checked it. The rest of the server reads fields, never strings,
and a figure derived from a reply (its speedup, its round time, its round speedup) is a property
computed in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleet.federated.shared import keys, schema

QUERY, TRAIN, EVALUATE = "query", "train", "evaluate"  # what a message asks (Flower's message types)


def wire(key: str, default: Any = dataclasses.MISSING) -> Any:
    """A field carried on the wire under ``key`` (a metric or config key)."""
    return field(default=default, metadata={"key": key})


def wire_fields(cls: type) -> Iterator[tuple[dataclasses.Field, str]]:
    """Each field of ``cls`` that travels on the wire, with its key."""
    for f in dataclasses.fields(cls):
        if "key" in f.metadata:
            yield f, f.metadata["key"]


def from_metrics(cls: type, metrics: Mapping[str, object], spec: Mapping[str, schema.Field], **given: Any) -> Any:
    """``cls`` from metrics that passed ``spec`` (whole-number metrics as ints); ``given`` fields win."""
    values = dict(given)
    for f, key in wire_fields(cls):
        if f.name not in values and key in metrics:
            values[f.name] = int(metrics[key]) if spec[key].integer else metrics[key]
    return cls(**values)


def as_row(record: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The record's wire fields that are set, by field name (the metrics.jsonl spelling)."""
    return {
        f.name: getattr(record, f.name)
        for f, _ in wire_fields(type(record))
        if getattr(record, f.name) is not None and f.name not in skip
    }


# --- server -> device ------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainOrder:
    """What the server asks of a device this round (a train message's config; an evaluate message's
    too, without the importance signal: fine-tuning runs under the same deadline and strategy)."""

    server_round: int
    strategy: str  # fleet | naive | fedavg | ditto
    deadline_s: float  # <= 0: no deadline, train fully
    run_tag: str = ""  # a device's saved state from another run is ignored
    global_importance: dict[str, float] = field(default_factory=dict)  # empty: none sent
    score_received: bool = False  # score the model received before training it: the last round's evaluation

    def to_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            keys.SERVER_ROUND: self.server_round,
            keys.STRATEGY: self.strategy,
            keys.DEADLINE_S: float(self.deadline_s),
            keys.RUN_TAG: self.run_tag,
        }
        if self.global_importance:
            config[keys.GLOBAL_IMPORTANCE_NAMES] = list(self.global_importance)
            config[keys.GLOBAL_IMPORTANCE_VALUES] = [float(v) for v in self.global_importance.values()]
        if self.score_received:
            config[keys.SCORE_RECEIVED] = True
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any], default_strategy: str) -> TrainOrder:
        names = list(config.get(keys.GLOBAL_IMPORTANCE_NAMES, []))
        values = list(config.get(keys.GLOBAL_IMPORTANCE_VALUES, []))
        return cls(
            server_round=int(config[keys.SERVER_ROUND]),
            strategy=str(config.get(keys.STRATEGY, default_strategy)),
            deadline_s=float(config.get(keys.DEADLINE_S, 0.0)),
            run_tag=str(config.get(keys.RUN_TAG, "")),
            global_importance=dict(zip(names, (float(v) for v in values))),
            score_received=bool(config.get(keys.SCORE_RECEIVED, False)),
        )

    def for_evaluation(self) -> TrainOrder:
        return dataclasses.replace(self, global_importance={}, score_received=False)


# --- device -> server: as unpacked, then as checked ---------------------------------------------
@dataclass
class Reply:
    """One reply as the transport unpacked it. Nothing in it is checked yet: a device can be faulty,
    out of date or hostile, so only the coordinator's checks turn it into a typed record."""

    node_id: int
    kind: str  # what it answers: QUERY, TRAIN or EVALUATE
    server_round: int  # the round of the message it answers (a reply after its phase closed is late)
    name: str | None = None  # the device name it claims (trusted only by admission, from a query reply)
    metrics: dict[str, object] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    error: str | None = None  # the device failed: the reason relayed for it
    problem: str | None = None  # the message is malformed: no metrics, not one set of arrays, undecodable
    by_device: bool = True  # False: the transport wrote it in the device's stead (a silent node): no answer
    wall_s: float | None = None  # the server's wall seconds from sending the message to pulling this reply


@dataclass(frozen=True)
class TrainReply:
    """A train reply that passed its checks, every figure typed. ``num_examples`` is its capped
    sample weight and ``bytes_uploaded`` what the server counted; the times are held to a band."""

    node_id: int
    device: str | None  # the roster's name for the node, else the name the reply claims
    num_examples: float = wire(keys.NUM_EXAMPLES)
    tier: float = wire(keys.TIER)
    selected: int = wire(keys.SELECTED)
    num_tensors: int = wire(keys.NUM_TENSORS)
    trained_fraction: float = wire(keys.TRAINED_FRACTION)
    rho: float = wire(keys.RHO)
    predicted_time_s: float = wire(keys.PREDICTED_TIME_S)
    measured_time_s: float = wire(keys.MEASURED_TIME_S)
    full_time_s: float = wire(keys.FULL_TIME_S)
    bytes_uploaded: int = wire(keys.BYTES_UPLOADED)
    steps: int = wire(keys.STEPS)
    partition_id: int | None = wire(keys.PARTITION_ID, None)
    personal_selected: int | None = wire(keys.PERSONAL_SELECTED, None)
    loss: float | None = wire(keys.LOSS, None)
    rounds_trained: int | None = wire(keys.ROUNDS_TRAINED, None)
    memory_budget_bytes: float | None = wire(keys.MEMORY_BUDGET_BYTES, None)
    memory_peak_bytes: float | None = wire(keys.MEMORY_PEAK_BYTES, None)
    memory_added_s: float | None = wire(keys.MEMORY_ADDED_S, None)
    cuda: int | None = wire(keys.CUDA, None)  # 1: trained on a CUDA GPU; None: on the CPU
    ready_s: float | None = wire(keys.READY_S, None)  # its process's start and setup, before training
    score_time_s: float | None = wire(keys.SCORE_TIME_S, None)  # scoring its personalized model after training
    eval_time_s: float | None = wire(keys.EVAL_TIME_S, None)  # scoring the model it received (evaluation.pipelined)
    # measured by the server, not told: wall seconds from sending the train message to pulling this reply (the
    # device's whole real round: its ClientApp's start, both transfers, its compute); None when not measured
    wall_s: float | None = None

    @classmethod
    def from_metrics(cls, node_id: int, device: str | None, metrics: Mapping[str, object], **given: Any) -> TrainReply:
        """From metrics that passed schema.TRAIN; the device's own ``speedup`` is checked there but
        not kept: the server derives it from the (clamped) times."""
        return from_metrics(cls, metrics, schema.TRAIN, node_id=node_id, device=device, **given)

    @property
    def speedup(self) -> float:
        return speedup(self.full_time_s, self.predicted_time_s)

    def round_time_s(self, bandwidth: float, fixed_s: float = 0.0) -> float:
        """Its round on the simulated clock: what it costs whatever it trains (``fixed_s``: its start and
        download), its compute, and its upload over its uplink (bytes/s)."""
        return fixed_s + self.predicted_time_s + self.bytes_uploaded / bandwidth

    def round_speedup(self, full_bytes: int, bandwidth: float, fixed_s: float = 0.0) -> float:
        """Its whole round against training and uploading every shared tensor (``full_bytes``). ``speedup``
        compares compute alone, which hides what selection saves on the uplink: a fast device short only of
        part of its upload reads below 1x there (its probe), while its round, uploading less, is shorter."""
        used = self.round_time_s(bandwidth, fixed_s)
        return (fixed_s + self.full_time_s + full_bytes / bandwidth) / used if used > 0 else 0.0

    def row(self) -> dict[str, Any]:
        """Its part of the device's metrics.jsonl row: its sample weight is ``train_examples`` (whether or not
        the round's own evaluation scored it: a pipelined round's is joined to the row later)."""
        return {
            "node_id": self.node_id,
            "device": self.device,
            **as_row(self, ("num_examples",)),
            "train_examples": self.num_examples,
            "speedup": self.speedup,
            **({"wall_s": self.wall_s} if self.wall_s is not None else {}),
        }


def speedup(full_time_s: float, predicted_time_s: float) -> float:
    """A round's compute speedup: its full-training time over its predicted time (0 when it took none). The
    device reports it (keys.SPEEDUP) and the server derives it again from the times it clamped: one formula."""
    return full_time_s / predicted_time_s if predicted_time_s > 0 else 0.0


@dataclass(frozen=True)
class EvaluateReply:
    """An evaluate reply that passed schema.EVALUATE."""

    node_id: int
    device: str | None
    num_examples: float = wire(keys.NUM_EXAMPLES)
    global_accuracy: float = wire(keys.GLOBAL_ACCURACY)
    personal_accuracy: float = wire(keys.PERSONAL_ACCURACY)
    partition_id: int | None = wire(keys.PARTITION_ID, None)
    finetuned_accuracy: float | None = wire(keys.FINETUNED_ACCURACY, None)
    finetune_time_s: float | None = wire(keys.FINETUNE_TIME_S, None)
    eval_time_s: float | None = wire(keys.EVAL_TIME_S, None)
    eval_ready_s: float | None = wire(keys.READY_S, None)  # its process's start and setup, before evaluating

    @classmethod
    def from_metrics(cls, node_id: int, device: str | None, metrics: Mapping[str, object]) -> EvaluateReply:
        return from_metrics(cls, metrics, schema.EVALUATE, node_id=node_id, device=device)

    def row(self) -> dict[str, Any]:
        """Its part of the device's metrics.jsonl row: its test samples are ``test_examples``."""
        row = {"node_id": self.node_id, "device": self.device, **as_row(self, ("num_examples",))}
        return {**row, "test_examples": self.num_examples}


@dataclass(frozen=True)
class QueryReply:
    """A query reply that passed schema.QUERY: who the device says it is, and its full-round time."""

    node_id: int
    name: str
    tier: float = wire(keys.TIER)
    full_time_s: float = wire(keys.FULL_TIME_S)
    min_rho: float = wire(keys.MIN_RHO)
    num_examples: int = wire(keys.NUM_EXAMPLES)
    partition_id: int | None = wire(keys.PARTITION_ID, None)

    @classmethod
    def from_metrics(cls, node_id: int, name: str, metrics: Mapping[str, object]) -> QueryReply:
        return from_metrics(cls, metrics, schema.QUERY, node_id=node_id, name=name)


@dataclass(frozen=True)
class Accuracy:
    """A round's evaluation: each accuracy weighted by the devices' test samples."""

    global_accuracy: float
    personal_accuracy: float
    finetuned_accuracy: float | None = None  # personalization.finetune_steps only

    @classmethod
    def of(cls, rows: list[EvaluateReply]) -> Accuracy | None:
        if not rows:
            return None
        tuned = [(r.finetuned_accuracy, r.num_examples) for r in rows if r.finetuned_accuracy is not None]
        return cls(
            weighted([(r.global_accuracy, r.num_examples) for r in rows]),
            weighted([(r.personal_accuracy, r.num_examples) for r in rows]),
            weighted(tuned) if tuned else None,
        )


def weighted(values: list[tuple[float, float]]) -> float:
    """The mean of (value, weight) pairs by weight (NaN for none)."""
    total = sum(w for _, w in values)
    return float(sum(v * w for v, w in values) / total) if total else float("nan")


# --- the roster -------------------------------------------------------------------------------
@dataclass
class Member:
    """A device in the fleet, by node id in the roster (fleet.federated.on_server.membership)."""

    name: str
    full_time_s: float  # its full-round time: the deadline's input, as last reported (held to a band)
    profile_s: float  # the full-round time it joined with: later reports are clamped around it
    missed: int = 0  # rounds missed in a row
    # seconds its round trips take beyond its own work (its ClientApp's start, the transfers, the polling), learned
    # from the server's timing of its replies, late ones included: what its wait bound adds (membership.overhead)
    overhead_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain values for the checkpoint (loaded with weights_only, which takes no classes)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Member:
        """From a checkpoint's entry; one saved before ``profile_s`` existed joined with its full time, and
        one saved before ``overhead_s`` has learned none yet."""
        full, overhead = float(d["full_time_s"]), d.get("overhead_s")
        overhead = None if overhead is None else float(overhead)
        return cls(str(d["name"]), full, float(d.get("profile_s", full)), int(d.get("missed", 0)), overhead)

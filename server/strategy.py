"""ElasticFedAvg: FedAvg over only the tensors each device trained (ALGORITHMS.md section 5).

``W_k <- sum_n a_nk m_n W_nk / sum_n a_nk m_n`` over the devices n that uploaded
tensor k (``m_n`` its samples); a tensor nobody trained keeps its value, so the
global model is never truncated to a subset. Flower's own FedAvg rejects
replies whose keys differ, and ``aggregate_train`` does not see the current
global arrays, so they are kept from ``configure_train``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

log = logging.getLogger("fleet.server")

WEIGHT_KEY = "num-examples"


@dataclass
class Rejection:
    """A reply the round went on without, and why."""

    server_round: int
    node_id: int
    partition_id: int | None
    reason: str

    def as_dict(self) -> dict:
        return {"round": self.server_round, "node_id": self.node_id, "partition_id": self.partition_id, "reason": self.reason}


def _partition(msg: Message) -> int | None:
    if msg.has_error() or "metrics" not in msg.content.metric_records:
        return None
    value = msg.content.metric_records["metrics"].get("partition-id")
    return int(value) if isinstance(value, (int, float)) else None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failure|Interrupt|Exit)(: .*)?$")


def error_summary(reason: str, limit: int = 300) -> str:
    """One line for a device's failure: the first exception line of the traceback Flower relays
    (the root cause: a simulated ClientApp's error arrives wrapped in Ray's and Flower's own)."""
    lines = [ln.strip() for ln in _ANSI.sub("", reason).splitlines() if ln.strip()]
    first = next((ln for ln in lines if _EXCEPTION_LINE.match(ln)), lines[0] if lines else "no reason given")
    return first if len(first) <= limit else first[: limit - 3] + "..."


def check_reply(msg: Message, global_arrays: dict[str, np.ndarray]) -> str | None:
    """Why a train reply cannot be aggregated, or None when it is sound."""
    if msg.has_error():
        return f"device failed: {error_summary(msg.error.reason)}"
    content = msg.content
    if len(content.array_records) != 1:
        return f"expected one ArrayRecord, got {len(content.array_records)}"
    if "metrics" not in content.metric_records:
        return "no 'metrics' MetricRecord"
    weight = content.metric_records["metrics"].get(WEIGHT_KEY)
    if not isinstance(weight, (int, float)) or not np.isfinite(weight) or weight <= 0:
        return f"'{WEIGHT_KEY}' must be a positive number, got {weight!r}"
    record = next(iter(content.array_records.values()))
    for name, arr in record.items():
        if name not in global_arrays:
            return f"unknown tensor {name!r}"
        ref = global_arrays[name]
        if tuple(arr.shape) != tuple(ref.shape):
            return f"tensor {name!r} has shape {tuple(arr.shape)}, the model has {tuple(ref.shape)}"
        if np.dtype(arr.dtype) != ref.dtype:
            return f"tensor {name!r} has dtype {arr.dtype}, the model has {ref.dtype}"
        try:
            values = arr.numpy()
        except Exception as exc:  # a corrupt payload is the device's fault, not the round's
            return f"tensor {name!r} cannot be decoded ({type(exc).__name__})"
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            return f"tensor {name!r} holds non-finite values"
    return None


def masked_average(
    global_arrays: dict[str, np.ndarray], updates: list[tuple[dict[str, np.ndarray], float]]
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Per tensor, the sample-weighted mean over the devices that sent it; (new arrays, senders per tensor)."""
    sums: dict[str, np.ndarray] = {}
    weights: dict[str, float] = {}
    counts: dict[str, int] = {}
    for arrays, w in updates:
        for name, value in arrays.items():
            acc = sums.get(name)
            contrib = value.astype(np.float64) * w
            sums[name] = contrib if acc is None else acc + contrib
            weights[name] = weights.get(name, 0.0) + w
            counts[name] = counts.get(name, 0) + 1
    out = {}
    for name, ref in global_arrays.items():
        out[name] = (sums[name] / weights[name]).astype(ref.dtype) if name in sums else ref
    return out, counts


class ElasticFedAvg(FedAvg):
    """FedAvg that aggregates per tensor over only the devices that trained it.

    Also sends each round's deadline and the global importance signal, and keeps
    per-device results of the last round for tracking.
    """

    def __init__(
        self,
        *,
        method: str = "fleet",
        deadline_s: float | None = None,
        deadline_factor: float = 1.0,
        full_upload_s: float = 0.0,
        param_names: Iterable[str] = (),
        lr: float = 0.01,
        blend: bool = True,
        run_tag: str = "",
        **kwargs,
    ) -> None:
        kwargs.setdefault("weighted_by_key", WEIGHT_KEY)
        super().__init__(**kwargs)
        self.method = method
        self.deadline_s = deadline_s
        self.deadline_factor = deadline_factor
        self.full_upload_s = full_upload_s  # uploading every tensor and norm statistic (0: the deadline is compute only)
        self.param_names = list(param_names)
        self.lr = lr
        self.blend = blend
        self.run_tag = run_tag
        self.full_times: dict[int, float] = {}  # node id -> its full-training time for one round's work
        self.global_importance: dict[str, float] = {}
        self.current: dict[str, np.ndarray] = {}
        self.rejections: list[Rejection] = []
        self.train_results: list[dict] = []
        self.eval_results: list[dict] = []
        self.senders: dict[str, int] = {}

    # --- round deadline ---------------------------------------------------
    def round_deadline(self) -> float:
        """0 (train fully) for FedAvg; else the configured deadline or the fastest device's round time
        when it trains fully: its full-training time plus, when the deadline covers uploads, the
        upload of the whole model. A slower device then spends on compute what it saves on upload."""
        if self.method == "fedavg":
            return 0.0
        if self.deadline_s is not None:
            return self.deadline_s
        if not self.full_times:
            return 0.0
        return self.deadline_factor * (min(self.full_times.values()) + self.full_upload_s)

    # --- training ---------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        self.current = {name: arr.numpy() for name, arr in arrays.items()}
        config = ConfigRecord(dict(config))
        config["strategy"] = self.method
        config["deadline-s"] = float(self.round_deadline())
        config["run-tag"] = self.run_tag
        if self.blend and self.global_importance:
            config["gi-names"] = list(self.global_importance)
            config["gi-values"] = [float(v) for v in self.global_importance.values()]
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        self.train_results = []
        updates: list[tuple[dict[str, np.ndarray], float]] = []
        for msg in replies:
            reason = check_reply(msg, self.current)
            if reason is not None:
                self._reject(server_round, msg, reason)
                continue
            metrics = dict(msg.content.metric_records["metrics"])
            record = next(iter(msg.content.array_records.values()))
            updates.append(({k: a.numpy() for k, a in record.items()}, float(metrics[WEIGHT_KEY])))
            full = metrics.get("full-time-s")
            if isinstance(full, (int, float)) and full > 0:
                self.full_times[msg.metadata.src_node_id] = float(full)
            self.train_results.append({"node_id": msg.metadata.src_node_id, **metrics})
        if not updates:
            log.warning("round %d: no usable training replies; the global model is unchanged", server_round)
            return None, None
        new, self.senders = masked_average(self.current, updates)
        self.global_importance = {
            k: float(np.sum((new[k].astype(np.float64) - self.current[k]) ** 2) / self.lr)
            for k in self.param_names
            if k in new
        }
        record = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in new.items()})
        total = sum(w for _, w in updates)
        summary = MetricRecord(
            {
                "devices": len(updates),
                "loss": float(sum(r["loss"] * r[WEIGHT_KEY] for r in self.train_results) / total),
                "bytes-uploaded": int(sum(r.get("bytes-uploaded", 0) for r in self.train_results)),
            }
        )
        return record, summary

    def _reject(self, server_round: int, msg: Message, reason: str) -> None:
        rej = Rejection(server_round, msg.metadata.src_node_id, _partition(msg), reason)
        self.rejections.append(rej)
        who = f"node {rej.node_id}" + (f" (device {rej.partition_id})" if rej.partition_id is not None else "")
        log.warning("round %d: rejected reply from %s: %s", server_round, who, reason)

    # --- evaluation -------------------------------------------------------
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        config = ConfigRecord(dict(config))
        config["run-tag"] = self.run_tag
        return super().configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        self.eval_results = []
        for msg in replies:
            if msg.has_error() or "metrics" not in msg.content.metric_records:
                reason = error_summary(msg.error.reason) if msg.has_error() else "no 'metrics' MetricRecord"
                log.warning("round %d: evaluation from node %d failed: %s", server_round, msg.metadata.src_node_id, reason)
                continue
            metrics = dict(msg.content.metric_records["metrics"])
            if not isinstance(metrics.get(WEIGHT_KEY), (int, float)) or metrics[WEIGHT_KEY] <= 0:
                continue
            self.eval_results.append({"node_id": msg.metadata.src_node_id, **metrics})
        if not self.eval_results:
            return None
        total = sum(r[WEIGHT_KEY] for r in self.eval_results)
        return MetricRecord(
            {
                key: float(sum(r[key] * r[WEIGHT_KEY] for r in self.eval_results) / total)
                for key in ("global-accuracy", "personal-accuracy")
            }
        )

"""ElasticFedAvg: Flower's FedAvg, aggregating each tensor over only the devices that trained it.

A thin adapter: it unpacks Flower Messages and calls the Flower-free server
arithmetic in :mod:`fleet.federated.aggregate`. Flower's own FedAvg rejects
replies whose keys differ, and ``aggregate_train`` does not see the current global
arrays, so they are kept from ``train_messages``. Everything a round learns goes
into the one :class:`~fleet.federated.state.ServerState` the round loop owns.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from fleet.federated import keys
from fleet.federated.aggregate import (
    Rejection,
    error_summary,
    evaluation_problem,
    global_importance,
    masked_average,
    round_deadline,
    tensor_problem,
    weight_problem,
    weighted_mean,
)
from fleet.federated.membership import full_times, name_of
from fleet.federated.state import ServerState

log = logging.getLogger("fleet.server")


def claimed_name(msg: Message) -> str | None:
    """The name a reply says its device has (only a query reply's is trusted, by the roster)."""
    if msg.has_error() or keys.DEVICE not in msg.content.config_records:
        return None
    name = msg.content.config_records[keys.DEVICE].get(keys.DEVICE_NAME)
    return name if isinstance(name, str) else None


def check_reply(msg: Message, global_arrays: dict[str, np.ndarray]) -> str | None:
    """Why a train reply cannot be aggregated, or None when it is sound."""
    if msg.has_error():
        return f"device failed: {error_summary(msg.error.reason)}"
    content = msg.content
    if len(content.array_records) != 1:
        return f"expected one ArrayRecord, got {len(content.array_records)}"
    if keys.METRICS not in content.metric_records:
        return f"no '{keys.METRICS}' MetricRecord"
    problem = weight_problem(content.metric_records[keys.METRICS].get(keys.NUM_EXAMPLES))
    record = next(iter(content.array_records.values()))
    for name, arr in record.items():
        problem = problem or tensor_problem(name, arr.shape, arr.dtype, arr.numpy, global_arrays)
    return problem


class ElasticFedAvg(FedAvg):
    """FedAvg that aggregates per tensor over only the devices that trained it.

    Also sends each round's deadline and the global importance signal; per-device results
    of the round go to ``state.replies``.
    """

    def __init__(
        self,
        state: ServerState,
        *,
        method: str = "fleet",
        deadline_s: float | None = None,
        deadline_factor: float = 1.0,
        full_upload_s: float = 0.0,
        param_names: Iterable[str] = (),
        lr: float = 0.01,
        blend: bool = True,
        **kwargs,
    ) -> None:
        kwargs.setdefault("weighted_by_key", keys.NUM_EXAMPLES)
        super().__init__(**kwargs)
        self.state = state
        self.method = method
        self.deadline_s = deadline_s
        self.deadline_factor = deadline_factor
        self.full_upload_s = (
            full_upload_s  # uploading every tensor and norm statistic (0: the deadline is compute only)
        )
        self.param_names = list(param_names)
        self.lr = lr
        self.blend = blend

    def round_deadline(self, nodes: Iterable[str]) -> float:
        """The round's deadline from the full-round times of ``nodes`` (the devices eligible now)."""
        times = full_times(self.state.roster, nodes)
        return round_deadline(self.method, self.deadline_s, self.deadline_factor, times, self.full_upload_s)

    def device_of(self, msg: Message) -> str | None:
        """The name the roster has for the reply's node (else what the reply claims)."""
        return name_of(self.state.roster, str(msg.metadata.src_node_id)) or claimed_name(msg)

    # --- training ---------------------------------------------------------
    def train_messages(
        self, server_round: int, arrays: ArrayRecord, nodes: Iterable[int], deadline_s: float
    ) -> list[Message]:
        """The round's train messages to the sampled ``nodes``; the arrays sent are kept for aggregation."""
        self.state.replies.sent = {name: arr.numpy() for name, arr in arrays.items()}
        config = ConfigRecord({keys.SERVER_ROUND: server_round})
        config[keys.STRATEGY] = self.method
        config[keys.DEADLINE_S] = float(deadline_s)
        config[keys.RUN_TAG] = self.state.run_tag
        gi = self.state.global_importance
        if self.blend and gi:
            config[keys.GLOBAL_IMPORTANCE_NAMES] = list(gi)
            config[keys.GLOBAL_IMPORTANCE_VALUES] = [float(v) for v in gi.values()]
        record = RecordDict({keys.ARRAYS: arrays, keys.CONFIG: config})
        return list(self._construct_messages(record, list(nodes), MessageType.TRAIN))

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        state, current = self.state, self.state.replies.sent
        state.replies.train = []
        updates: list[tuple[dict[str, np.ndarray], float]] = []
        for msg in replies:
            reason = check_reply(msg, current)
            if reason is not None:
                self._reject(server_round, msg, reason)
                continue
            metrics = dict(msg.content.metric_records[keys.METRICS])
            record = next(iter(msg.content.array_records.values()))
            updates.append(({k: a.numpy() for k, a in record.items()}, float(metrics[keys.NUM_EXAMPLES])))
            full, node = metrics.get(keys.FULL_TIME_S), str(msg.metadata.src_node_id)
            if isinstance(full, (int, float)) and full > 0 and node in state.roster:
                state.roster[node]["full_time_s"] = float(full)
            state.replies.train.append({"node_id": msg.metadata.src_node_id, "device": self.device_of(msg), **metrics})
        if not updates:
            state.replies.senders = {}
            log.warning("round %d: no usable training replies; the global model is unchanged", server_round)
            return None, None
        new, state.replies.senders = masked_average(current, updates)
        state.global_importance = global_importance(new, current, self.param_names, self.lr)
        record = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in new.items()})
        rows = state.replies.train
        summary = {
            "devices": len(updates),
            keys.LOSS: weighted_mean(rows, keys.LOSS),
            keys.BYTES_UPLOADED: int(sum(r.get(keys.BYTES_UPLOADED, 0) for r in rows)),
        }
        return record, MetricRecord(summary)

    def _reject(self, server_round: int, msg: Message, reason: str) -> None:
        rej = Rejection(server_round, msg.metadata.src_node_id, self.device_of(msg), reason)
        self.state.replies.rejections.append(rej)
        log.warning("round %d: rejected reply from %s: %s", server_round, rej.who(), reason)

    # --- evaluation -------------------------------------------------------
    def evaluate_messages(self, server_round: int, arrays: ArrayRecord, nodes: Iterable[int]) -> list[Message]:
        config = ConfigRecord({keys.SERVER_ROUND: server_round, keys.RUN_TAG: self.state.run_tag})
        record = RecordDict({keys.ARRAYS: arrays, keys.CONFIG: config})
        return list(self._construct_messages(record, list(nodes), MessageType.EVALUATE))

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        rows = self.state.replies.evaluation = []
        for msg in replies:
            if msg.has_error() or keys.METRICS not in msg.content.metric_records:
                reason = error_summary(msg.error.reason) if msg.has_error() else f"no '{keys.METRICS}' MetricRecord"
            else:
                metrics = dict(msg.content.metric_records[keys.METRICS])
                reason = evaluation_problem(metrics)
            if reason is not None:
                who = Rejection(server_round, msg.metadata.src_node_id, self.device_of(msg), reason).who()
                log.warning("round %d: evaluation from %s failed: %s", server_round, who, reason)
                continue
            rows.append({"node_id": msg.metadata.src_node_id, "device": self.device_of(msg), **metrics})
        if not rows:
            return None
        return MetricRecord({key: weighted_mean(rows, key) for key in (keys.GLOBAL_ACCURACY, keys.PERSONAL_ACCURACY)})

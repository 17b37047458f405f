"""ElasticFedAvg: Flower's FedAvg, aggregating each tensor over only the devices that trained it.

A thin adapter: it unpacks Flower Messages and calls the Flower-free server
arithmetic in :mod:`fleet.federated.aggregate`. Flower's own FedAvg rejects
replies whose keys differ, and ``aggregate_train`` does not see the current global
arrays, so they are kept from ``train_messages``. Everything a round learns goes
into the one :class:`~fleet.federated.state.ServerState` the round loop owns.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from fleet.federated import keys, schema
from fleet.federated.aggregate import (
    Rejection,
    error_summary,
    global_importance,
    momentum_step,
    round_deadline,
    tensor_problem,
    weight_problem,
    weighted_mean,
)
from fleet.federated.membership import full_times, name_of
from fleet.federated.robust import (
    Defense,
    Screen,
    bound_update,
    plausible,
    plausible_times,
    robust_average,
    scale_update,
    screen_devices,
    update_limits,
    update_norms,
    upload_problem,
)
from fleet.federated.schema import known_metrics, metric_problem
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


@dataclass
class Accepted:
    """A train reply that passed its checks, on its way into the average."""

    msg: Message
    arrays: dict[str, np.ndarray]
    weight: float  # its sample count, capped
    row: dict  # its checked metrics, for the round's record


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
        defense: Defense | None = None,
        upload_s_of: Callable[[str | None], float] | None = None,
        personal: Iterable[str] = (),
        server_momentum: float | None = None,
        server_lr: float = 1.0,
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
        self.defense = defense or Defense()
        self.upload_s_of = upload_s_of  # a device's full upload by name, when devices' uplinks differ
        self.server_momentum, self.server_lr = server_momentum, server_lr  # FedAvgM (None: off)
        self.personal = frozenset(personal)  # what devices keep (personalization.policy): never sent, never averaged

    def round_deadline(self, nodes: Iterable[str]) -> float:
        """The round's deadline from the full-round times of ``nodes`` (the devices eligible now),
        each held to a band around the fleet's median, so one device cannot set it alone."""
        times = plausible_times(full_times(self.state.roster, nodes), self.defense.time_band)
        if self.upload_s_of is None:
            return round_deadline(self.method, self.deadline_s, self.deadline_factor, times, self.full_upload_s)
        roster = self.state.roster
        times = {n: t + self.upload_s_of(name_of(roster, n)) for n, t in times.items()}
        return round_deadline(self.method, self.deadline_s, self.deadline_factor, times, 0.0)

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
        accepted = [a for a in (self._accept(server_round, msg, current) for msg in replies) if a is not None]
        accepted = self._bound(server_round, accepted, current)
        if not accepted:
            state.replies.senders = {}
            log.warning("round %d: no usable training replies; the global model is unchanged", server_round)
            return None, None
        d = self.defense
        updates = [(a.arrays, a.weight) for a in accepted]
        new, state.replies.senders = robust_average(current, updates, d.aggregation, d.trim)
        shared = [n for n in self.param_names if n not in self.personal]
        if self.server_momentum is not None:
            new, state.momentum = momentum_step(
                current, new, state.replies.senders, state.momentum, shared, self.server_momentum, self.server_lr
            )
        state.replies.train = rows = [a.row for a in accepted]
        state.global_importance = global_importance(new, current, shared, self.lr)
        record = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in new.items()})
        summary = {
            "devices": len(updates),
            keys.LOSS: weighted_mean(rows, keys.LOSS),
            keys.BYTES_UPLOADED: int(sum(r[keys.BYTES_UPLOADED] for r in rows)),
        }
        return record, MetricRecord(summary)

    def _accept(self, server_round: int, msg: Message, current: dict[str, np.ndarray]) -> Accepted | None:
        """The reply's tensors, capped weight and checked metrics row, or None (rejected, with the reason)."""
        reason = check_reply(msg, current)
        metrics: dict = {}
        if reason is None:
            metrics = dict(msg.content.metric_records[keys.METRICS])
            reason = metric_problem(metrics, schema.TRAIN)
        arrays: dict[str, np.ndarray] = {}
        if reason is None:
            record = next(iter(msg.content.array_records.values()))
            arrays = {k: a.numpy() for k, a in record.items()}
            reason = upload_problem(arrays, metrics[keys.SELECTED], self.param_names, self.personal)
        if reason is not None:
            self._reject(server_round, msg, reason)
            return None
        name = self.device_of(msg)
        weight = min(float(metrics[keys.NUM_EXAMPLES]), self.defense.sample_cap(name))
        if weight < metrics[keys.NUM_EXAMPLES]:
            self.state.replies.defense.setdefault("capped", []).append(name)
        row = {"node_id": msg.metadata.src_node_id, "device": name, **known_metrics(metrics, schema.TRAIN)}
        row[keys.NUM_EXAMPLES] = weight
        row[keys.BYTES_UPLOADED] = int(sum(a.nbytes for a in arrays.values()))  # counted here, not told
        self._clamp_times(str(msg.metadata.src_node_id), row)
        return Accepted(msg, arrays, weight, row)

    def _clamp_times(self, node: str, row: dict) -> None:
        """A device's reported full-round time and round time, held to a band around the full time it
        joined with: it may drift (a hot Pi slows down), not move the fleet's deadline or clock at will."""
        m = self.state.roster.get(node)
        if m is None:
            return
        band = self.defense.time_band
        full = plausible(row[keys.FULL_TIME_S], m["profile_s"], band)
        m["full_time_s"] = row[keys.FULL_TIME_S] = full
        row[keys.PREDICTED_TIME_S] = min(row[keys.PREDICTED_TIME_S], band * full)
        row[keys.SPEEDUP] = full / row[keys.PREDICTED_TIME_S] if row[keys.PREDICTED_TIME_S] > 0 else 0.0

    def _bound(self, server_round: int, accepted: list[Accepted], current: dict[str, np.ndarray]) -> list[Accepted]:
        """Updates held to ``norm_bound`` x the lower median norm per tensor: clipped, or rejected."""
        d = self.defense
        accepted = self._screen(server_round, accepted, current)
        if d.norm_bound is None or not accepted:
            return accepted
        norms = update_norms(current, [a.arrays for a in accepted])  # computed once for the limits and the clips
        limits = update_limits(norms, d.norm_bound)
        kept = []
        for a, sent_norms in zip(accepted, norms):
            bounded, clipped = bound_update(current, a.arrays, limits, sent_norms)
            if clipped and d.norm_action == "reject":
                reason = (
                    f"update of {len(clipped)} tensors above {d.norm_bound:g}x the median norm (first {clipped[0]!r})"
                )
                self._reject(server_round, a.msg, reason)
                continue
            if clipped:
                self.state.replies.defense.setdefault("clipped", {})[a.row["device"]] = len(clipped)
            a.arrays = bounded
            kept.append(a)
        return kept

    def _screen(self, server_round: int, accepted: list[Accepted], current: dict[str, np.ndarray]) -> list[Accepted]:
        """Each device judged on the tensors others trained too, the verdict applied to its whole
        reply: pulling against the fleet (``pull`` below ``min_pull``) is rejected; oversized
        (above ``norm_bound`` x the others') is scaled down as a whole to their size, or rejected,
        and always rejected from a device caught pulling back in an earlier round (a suspect).

        The suspects' memory is for late rounds: honest updates grow nearly orthogonal, so an
        amplified sign flip's pull, its size counted only up to the bound, can read small and pass,
        scaled down but still reversed. An honest device is never oversized, so it never meets it."""
        d = self.defense
        suspects = self.state.suspects
        cap = d.norm_bound if d.norm_bound is not None else math.inf
        screens = screen_devices(current, [a.arrays for a in accepted], self.param_names, size_cap=cap)
        record = self.state.replies.defense.setdefault("screen", {})
        kept = []
        for i, a in enumerate(accepted):
            name, sc = a.row["device"], screens.get(i)
            if sc is None:  # it shares no tensor with enough others to be judged
                kept.append(a)
                continue
            record[name] = sc.as_dict()
            reason = _screen_problem(sc, d, suspects.get(name))
            if reason is not None:
                suspects.setdefault(name, server_round)
                self._reject(server_round, a.msg, reason)
                continue
            if _oversized(sc, d):
                # to a typical update's size, not to the bound: inflating an update past the bound buys nothing
                a.arrays = scale_update(current, a.arrays, 1.0 / sc.norm_ratio, self.param_names)
                self.state.replies.defense.setdefault("scaled", {})[name] = round(sc.norm_ratio, 3)
            else:
                suspects.pop(name, None)  # back to an ordinary size: trusted again
            kept.append(a)
        return kept

    def _reject(self, server_round: int, msg: Message, reason: str) -> None:
        rej = Rejection(server_round, msg.metadata.src_node_id, self.device_of(msg), reason)
        self.state.replies.rejections.append(rej)
        log.warning("round %d: rejected reply from %s: %s", server_round, rej.who(), reason)

    # --- evaluation -------------------------------------------------------
    def evaluate_messages(
        self, server_round: int, arrays: ArrayRecord, nodes: Iterable[int], deadline_s: float = 0.0
    ) -> list[Message]:
        """The new global model to score; the round's deadline and strategy let a device fine-tune it
        elastically first (personalization.finetune_steps)."""
        config = ConfigRecord({keys.SERVER_ROUND: server_round, keys.RUN_TAG: self.state.run_tag})
        config[keys.STRATEGY] = self.method
        config[keys.DEADLINE_S] = float(deadline_s)
        record = RecordDict({keys.ARRAYS: arrays, keys.CONFIG: config})
        return list(self._construct_messages(record, list(nodes), MessageType.EVALUATE))

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        rows = self.state.replies.evaluation = []
        for msg in replies:
            if msg.has_error() or keys.METRICS not in msg.content.metric_records:
                reason = error_summary(msg.error.reason) if msg.has_error() else f"no '{keys.METRICS}' MetricRecord"
            else:
                metrics = dict(msg.content.metric_records[keys.METRICS])
                reason = metric_problem(metrics, schema.EVALUATE)
            if reason is not None:
                who = Rejection(server_round, msg.metadata.src_node_id, self.device_of(msg), reason).who()
                log.warning("round %d: evaluation from %s failed: %s", server_round, who, reason)
                continue
            row = {"node_id": msg.metadata.src_node_id, "device": self.device_of(msg)}
            rows.append({**row, **known_metrics(metrics, schema.EVALUATE)})
        if not rows:
            return None
        figures = {key: weighted_mean(rows, key) for key in (keys.GLOBAL_ACCURACY, keys.PERSONAL_ACCURACY)}
        tuned = [r for r in rows if keys.FINETUNED_ACCURACY in r]
        if tuned:
            figures[keys.FINETUNED_ACCURACY] = weighted_mean(tuned, keys.FINETUNED_ACCURACY)
        return MetricRecord(figures)


def _oversized(sc: Screen, d: Defense) -> bool:
    return d.norm_bound is not None and sc.norm_ratio > d.norm_bound


def _screen_problem(sc: Screen, d: Defense, suspect_since: int | None = None) -> str | None:
    """Why a device's screen rejects its reply, or None; ``suspect_since``: the round the screen first
    rejected it, while it has stayed a suspect."""
    shared = f"over {sc.tensors} tensors other devices trained too"
    if d.min_pull is not None and sc.pull < d.min_pull:
        return f"its update pulls against the other devices' ({sc.pull:.2f} typical updates {shared})"
    oversized = f"its update is {sc.norm_ratio:.1f}x the other devices' (median {shared}; bound {d.norm_bound:g})"
    if _oversized(sc, d) and (d.norm_action == "reject" or suspect_since is not None):
        return oversized + ("" if suspect_since is None else f", and it pulled back in round {suspect_since}")
    return None

"""The server's half of a round, Flower-free: who takes part, what they are asked, what is kept.

The round's loop (:func:`fleet.federated.on_server.server_loop.run_round`) calls a :class:`Coordinator`'s hooks;
everything a round decides is decided here, once: who is admitted or refused, who is sampled, the
deadline and the wall-time bounds, whether the round evaluates, the simulated clock and the round's
metrics.jsonl record. What becomes of the train replies it closes on (every check, the defense, the
average) is its :class:`~fleet.federated.on_server.accept.Acceptance`'s. The Coordinator owns the
:class:`~fleet.federated.on_server.state.ServerState` and the current global arrays; the config's sections
(federation, membership, robust, evaluation, personalization, devices) are read as they are.

A round, as the loop calls it::

    started = open_round(connected)
    queries(...) out, their answers into take(round, QUERY, ...); eligible(connected)
    plan = plan_round(round, eligible, connected)     # sampled nodes, TrainOrder, wait bounds
    outgoing() with plan.order to plan.nodes; end = fix_bound(plan, started)
    replies = take(round, TRAIN, collected); take_scores(round, replies); close_train(plan, replies)
    rides = rides(round)                               # pipelined: the next round's trainers score it
    if evaluates(round) and not rides: evaluation_nodes, evaluation_wait(plan, end), close_evaluate
    release(close_round(plan, started), rides)         # the records to write now
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from fleet.base.errors import FleetError
from fleet.data.datasets import ArrayDataset
from fleet.federated.on_server.accept import Acceptance, ModelNames
from fleet.federated.on_server.aggregate import Rejection, error_summary, round_deadline
from fleet.federated.on_server.membership import (
    EVAL_STREAM,
    Refusal,
    admit,
    benched,
    eligible,
    full_times,
    learn_overhead,
    name_of,
    overhead_of,
    record_attendance,
    sample,
)
from fleet.federated.on_server.robust import plausible_times
from fleet.federated.on_server.server_eval import server_accuracy
from fleet.federated.on_server.state import RoundReplies, ServerState
from fleet.federated.on_server.tracking import device_rows, round_record, round_time, with_attendance, with_evaluation
from fleet.federated.on_server.wall import Lap, evaluation_wait, expected_work, learn_work, round_bound, work_of
from fleet.federated.shared import keys, schema
from fleet.federated.shared.classes import FleetClasses
from fleet.federated.shared.config import FleetConfig, compute_steps, pipelined
from fleet.federated.shared.names import DEVICE_NAME
from fleet.federated.shared.records import (
    EVALUATE,
    QUERY,
    TRAIN,
    Accuracy,
    EvaluateReply,
    QueryReply,
    Reply,
    TrainOrder,
)
from fleet.federated.shared.round_record import RoundRecord
from fleet.federated.shared.split import known_data_sizes
from fleet.federated.shared.transfer import encode, wire_bytes

log = logging.getLogger("fleet.server")


@dataclass(frozen=True)
class PlannedRound:
    """A round as planned before its messages go out."""

    server_round: int
    nodes: list[str]  # the sampled node ids
    order: TrainOrder  # what every sampled device is asked
    train_bound_s: float  # the longest the server waits for the train replies (wall seconds)
    eval_bound_s: float  # ... and for the evaluate replies

    @property
    def deadline_s(self) -> float:
        return self.order.deadline_s


def shared_bytes(arrays: dict[str, np.ndarray], personal: frozenset[str], transfer: str) -> int:
    """Bytes of a full upload on the wire: every float tensor but the personal ones, which never leave a device."""
    return sum(wire_bytes(a, transfer) for name, a in arrays.items() if a.dtype.kind == "f" and name not in personal)


def devices_wanted(cfg: FleetConfig) -> int:
    """How many devices the server waits for: ``membership.min_devices``, else the devices taking part."""
    return cfg.membership.min_devices or cfg.devices.taking_part


def evaluates(cfg: FleetConfig, server_round: int, sim_time_after_s: float) -> bool:
    """Whether this round evaluates: every ``evaluation.every`` rounds, and always the run's last round."""
    return last_round(cfg, server_round, sim_time_after_s) or server_round % cfg.evaluation.every == 0


def last_round(cfg: FleetConfig, server_round: int, sim_time_after_s: float) -> bool:
    """Whether no round follows this one: it is the one at ``rounds``, or the one that takes the simulated clock to
    ``time_budget_s`` (:meth:`fleet.federated.on_server.server_run.ServerRun.rounds` stops there)."""
    fed = cfg.federation
    return server_round >= fed.rounds or (fed.time_budget_s is not None and sim_time_after_s >= fed.time_budget_s)


def out_of_time(cfg: FleetConfig, state: ServerState) -> bool:
    """True once the simulated clock has reached ``federation.time_budget_s`` (if set):
    rounds that started before the horizon still finish."""
    budget = cfg.federation.time_budget_s
    return budget is not None and state.sim_time_s >= budget


def finetune_time(cfg: FleetConfig, state: ServerState) -> float:
    """The slowest evaluated device's fine-tuning (personalization.finetune_steps), each held to ``time_band``
    times what those steps take it when it trains fully (from the full-round time it joined with): a
    device reporting an hour cannot stop the clock."""
    longest = 0.0
    for row in state.replies.evaluation:
        member = state.roster.get(str(row.node_id))
        if row.finetune_time_s is None or member is None:
            continue
        cap = cfg.robust.time_band * member.profile_s * cfg.personalization.finetune_steps / compute_steps(cfg)
        longest = max(longest, min(float(row.finetune_time_s), cap))
    return longest


class Coordinator:
    """The server's round: membership, planning, checks, defense, aggregation, clocks, the record."""

    def __init__(
        self,
        cfg: FleetConfig,
        state: ServerState,
        arrays: dict[str, np.ndarray],
        *,
        names: ModelNames | None = None,
        classes: FleetClasses | None = None,
        simulated: bool = False,
        server_test: ArrayDataset | None = None,
    ) -> None:
        self.cfg, self.state, self.arrays = cfg, state, arrays  # arrays: the global model, as the round stands
        self.names = names or ModelNames.of(cfg)
        self.classes = classes or FleetClasses(cfg, {})  # simulated device classes: online, uplink, class name
        self.simulated = simulated  # simulated devices share this machine: wall time says nothing of the deadline
        # a simulation knows every device's data size, which caps a reply's weight
        self.accept = Acceptance(cfg, state, self.names, known_data_sizes(cfg) if simulated else {})
        self.full_bytes = shared_bytes(arrays, self.names.personal, cfg.federation.transfer)
        # each train message carries the whole model
        self.download_bytes = shared_bytes(arrays, frozenset(), cfg.federation.transfer)
        self.server_test = server_test  # evaluation.server_test: the global model is also scored on this
        self.refusals: dict[str, str] = {}  # node -> the last reason it was refused (logged once)

    # --- membership ---------------------------------------------------------------------------
    def name_of(self, node: str | int) -> str | None:
        return name_of(self.state.roster, str(node))

    def device_of(self, reply: Reply) -> str | None:
        """The roster's name for the reply's node, else the name the reply claims."""
        return self.name_of(reply.node_id) or reply.name

    def eligible(self, connected: Iterable[str]) -> list[str]:
        return eligible(self.state.roster, connected, self.cfg.membership.max_missed)

    def enough(self, eligible_nodes: list[str]) -> bool:
        return len(eligible_nodes) >= devices_wanted(self.cfg)

    def queries(self, connected: set[str], asked: set[str]) -> list[str]:
        """Connected nodes to ask who they are: new ones and benched members, unless a query is out to them."""
        roster = self.state.roster
        bench = set(benched(roster, connected, self.cfg.membership.max_missed))
        return sorted(n for n in connected if (n not in roster or n in bench) and n not in asked)

    def take(self, server_round: int, phase: str, replies: list[Reply], connected: set[str]) -> list[Reply]:
        """The replies to this round's ``phase`` messages. A query reply (of any round) admits or refuses its
        device on the way; any other reply is late, its phase closed: dropped, and said so. A reply the
        transport wrote for a silent device is no answer."""
        kept = []
        for reply in replies:
            if reply.by_device and reply.kind == QUERY:
                self._admit(server_round, reply, connected)
            self._learn(reply)
            if reply.kind != QUERY and (reply.kind != phase or reply.server_round != server_round):
                who = self.name_of(reply.node_id) or f"node {reply.node_id}"
                log.warning(
                    "round %d: dropped a late %s reply from %s (its phase of round %d had closed)",
                    server_round,
                    reply.kind,
                    who,
                    reply.server_round,
                )
            elif not reply.by_device:
                why = "its node is gone" if reply.error is None else error_summary(reply.error)
                self.state.replies.no_answer[str(reply.node_id)] = f"the SuperLink answered for it: {why}"
            elif reply.kind != QUERY:
                kept.append(reply)
        return kept

    def _learn(self, reply: Reply) -> None:
        """What the member's round trips cost beyond its work, from the server's timing of this reply (a
        late one too: it says how long the device really needs)."""
        member = self.state.roster.get(str(reply.node_id))
        if member is None or reply.wall_s is None or not reply.by_device or reply.error is not None:
            return
        work = {TRAIN: keys.MEASURED_TIME_S, EVALUATE: keys.EVAL_TIME_S}.get(reply.kind)
        reported = reply.metrics.get(work) if work else None
        work_s = float(reported) if isinstance(reported, (int, float)) and math.isfinite(reported) else 0.0
        cap = self.cfg.federation.timeout_s
        member.overhead_s = learn_overhead(member.overhead_s, reply.wall_s, work_s, cap)

    def _admit(self, server_round: int, reply: Reply, connected: set[str]) -> None:
        """Make the device a member under the name it gives, or refuse it with the reason (it is asked again
        in later rounds: its owner may fix a bad data tree or a taken name)."""
        node, reason = str(reply.node_id), _query_problem(reply)
        if reason is None:
            query = QueryReply.from_metrics(reply.node_id, str(reply.name), reply.metrics)
            reason = admit(self.state.roster, node, query.name, query.full_time_s, connected)
        if reason is not None:
            self.state.replies.attendance.refused.append(Refusal(reply.node_id, reply.name, reason))
            if self.refusals.get(node) != reason:
                who = f"device {reply.name} (node {node})" if reply.name else f"node {node}"
                log.warning("round %d: refused %s: %s", server_round, who, reason)
            self.refusals[node] = reason
            return
        self.refusals.pop(node, None)
        self.state.replies.attendance.joined.append(str(reply.name))
        log.info("round %d: device %s (node %s) joined", server_round, reply.name, node)

    # --- planning -------------------------------------------------------------------------------
    def open_round(self, connected: set[str]) -> float:
        """A fresh round: nothing of the last one's replies is kept. Returns when it started (wall clock)."""
        self.state.replies = RoundReplies()
        self.state.replies.attendance.connected = len(connected)
        return time.perf_counter()

    def lap(self, key: str, started: float) -> float:
        """Record the server's wall seconds of one part of the round; returns the next part's start."""
        return self.state.replies.lap(key, started)

    def plan_round(self, server_round: int, eligible_nodes: list[str], connected: set[str]) -> PlannedRound:
        """Who of the eligible devices is online and sampled, the deadline, the bounds, the order; a FleetError
        when nobody could take part (every query refused or unanswered)."""
        state, att, fed = self.state, self.state.replies.attendance, self.cfg.federation
        roster = state.roster
        att.benched = [roster[n].name for n in benched(roster, connected, self.cfg.membership.max_missed)]
        if not eligible_nodes:
            reasons = "; ".join(sorted(set(self.refusals.values()))) or "none answered its query"
            raise FleetError(f"round {server_round}: no device could take part within {fed.timeout_s:.0f}s ({reasons})")
        online = self.online(server_round, eligible_nodes)
        att.offline = [roster[n].name for n in eligible_nodes if n not in online]
        att.online, att.sampled_at_s = len(online), state.sim_time_s
        nodes = sample(online, fed.devices_per_round, self.cfg.train.seed, server_round)
        att.sampled = [roster[n].name for n in nodes]
        log.info("round %d: sampled %d of %d online devices: %s", server_round, len(nodes), len(online), att.sampled)
        deadline = self.deadline(online)
        blend = fed.strategy == "fleet" and self.cfg.elastic.blend_beta is not None
        signal = dict(state.global_importance) if blend else {}
        order = TrainOrder(server_round, fed.strategy, deadline, state.run_tag, signal, state.held is not None)
        state.replies.sent = self.arrays
        return PlannedRound(server_round, nodes, order, *self.bounds(deadline, nodes))

    def outgoing(self) -> dict[str, np.ndarray]:
        """The global model as it crosses the network to the devices (``federation.transfer``)."""
        return encode(self.arrays, self.cfg.federation.transfer)

    def online(self, server_round: int, nodes: list[str]) -> list[str]:
        """The nodes online now. When every one is off its trace, the simulated clock moves on to the first
        coming back: idle time a real fleet would spend waiting, where a clock that stood still would wait
        forever."""
        state, roster = self.state, self.state.roster
        up = [n for n in nodes if self.classes.online(roster[n].name, server_round, state.sim_time_s)]
        wait = 0.0 if up else self.classes.wait_s([roster[n].name for n in nodes], state.sim_time_s)
        if 0 < wait < math.inf:
            log.info(
                "round %d: no device online at %.0fs simulated; waiting %.0fs for one",
                server_round,
                state.sim_time_s,
                wait,
            )
            state.sim_time_s += wait
            up = [n for n in nodes if self.classes.online(roster[n].name, server_round, state.sim_time_s)]
        return up

    def fixed_s(self, name: str | None) -> float:
        """A simulated device's round cost whatever it trains: its class's start and model download."""
        return self.classes.fixed_s(name, self.download_bytes)

    def full_upload_s(self, node: str) -> float:
        """Seconds the node's device takes to upload every shared tensor over its uplink (0 when the
        deadline bounds compute only)."""
        if not self.cfg.federation.deadline_includes_upload:
            return 0.0
        return self.full_bytes / self.classes.bandwidth(self.name_of(node))

    def deadline(self, nodes: Iterable[str]) -> float:
        """The round's deadline from the full rounds of ``nodes`` (the devices online now): each one's
        full-training time, held to a band around the fleet's median so that one device cannot set it
        alone, plus its full upload."""
        times = plausible_times(full_times(self.state.roster, nodes), self.cfg.robust.time_band)
        full_rounds = {n: t + self.full_upload_s(n) for n, t in times.items()}
        fed = self.cfg.federation
        return round_deadline(fed.strategy, fed.deadline_s, fed.deadline_factor, full_rounds)

    def bounds(self, deadline: float, nodes: list[str]) -> tuple[float, float]:
        """(train, evaluate) wall-time bounds of a round. Deployed: the deadline (a FedAvg round: the
        slowest sampled device's full round and upload), the largest round-trip overhead learned of the
        sampled devices (their ClientApp's start, the model's transfers, the polling: seconds a deadline
        on compute does not see), and ``grace_s``; evaluation: that overhead and ``grace_s``. Simulated
        devices share this machine's CPUs, so their wall time is not the deadline's: ``timeout_s``
        bounds both."""
        fed, grace = self.cfg.federation, self.cfg.membership.grace_s
        if self.simulated:
            return fed.timeout_s, fed.timeout_s
        expected = deadline
        if expected <= 0:
            full = full_times(self.state.roster, nodes)
            expected = max((t + self.full_upload_s(n) for n, t in full.items()), default=0.0)
        overhead = overhead_of(self.state.roster, nodes)
        return expected + overhead + grace, overhead + grace

    def fix_bound(self, plan: PlannedRound, started: float) -> float:
        """The round's whole wall-time bound, fixed once its train messages are out (fleet.federated.on_server.wall);
        returns when the round must end (``time.perf_counter()``)."""
        got = self.state.replies
        evaluating = self.evaluates(plan.server_round)
        got.expected_work = work = expected_work(self.state.server_work, got.timings.get(Lap.PUSH_TRAIN, 0.0))
        spent = time.perf_counter() - started
        got.round_bound_s = round_bound(spent, plan.train_bound_s, plan.eval_bound_s if evaluating else None, work)
        return started + got.round_bound_s

    def evaluation_wait(self, plan: PlannedRound, end: float) -> float:
        """The evaluation's wait: its bound, less what the server's own work overran (said so)."""
        work = self.state.replies.expected_work or expected_work(self.state.server_work, 0.0)
        wait = evaluation_wait(plan.eval_bound_s, end - time.perf_counter(), work)
        if wait < plan.eval_bound_s:
            log.warning(
                "round %d: evaluation waits %.1fs of its %.1fs: the server's own work took longer than allowed",
                plan.server_round,
                wait,
                plan.eval_bound_s,
            )
        return wait

    # --- training -------------------------------------------------------------------------------
    def close_train(self, plan: PlannedRound, replies: list[Reply]) -> None:
        """Count who answered, check every reply, defend, average: the new global model in ``arrays``."""
        got = self.state.replies
        got.attendance.missed = record_attendance(self.state.roster, plan.nodes, {str(r.node_id) for r in replies})
        waited = f"no reply within its bound of {plan.train_bound_s:.1f}s"
        for node in plan.nodes:
            name = self.name_of(node)
            if name in got.attendance.missed:
                reason = got.attendance.misses[name] = got.no_answer.get(node, waited)
                log.warning(
                    "round %d: device %s missed the round (%s); went on without it", plan.server_round, name, reason
                )
        got.answered = sorted({str(r.node_id) for r in replies if r.error is None})
        # by device name, not arrival: float sums then run in one order, whichever reply came first
        ordered = sorted(replies, key=lambda r: (self.device_of(r) or "", str(r.node_id)))
        checked = (self.accept.check(plan.server_round, r, self.device_of(r)) for r in ordered)
        new = self.accept.average(plan.server_round, [c for c in checked if c is not None])
        self.arrays = self.arrays if new is None else new
        got.round_time_s = round_time(got.train, self.classes.bandwidth, self.fixed_s)

    # --- evaluation and the close -----------------------------------------------------------------
    def evaluates(self, server_round: int) -> bool:
        return evaluates(self.cfg, server_round, self._sim_time_after())

    def rides(self, server_round: int) -> bool:
        """Whether this round's evaluation rides on the next round's training (``evaluation.pipelined``): it
        evaluates, and a round follows. Asked, like :meth:`evaluates`, before the round closes."""
        last = last_round(self.cfg, server_round, self._sim_time_after())
        return pipelined(self.cfg, self.simulated) and self.evaluates(server_round) and not last

    def _sim_time_after(self) -> float:
        """The simulated clock once this round's training is counted (before :meth:`close_round` counts it)."""
        return self.state.sim_time_s + self.state.replies.round_time_s

    def take_scores(self, server_round: int, replies: list[Reply]) -> None:
        """The held record's evaluation, from this round's train replies: each trainer scored the model it
        received, the held round's. A reply without a score adds none; one with a bad score is named and left out
        (its update is judged apart, by :meth:`close_train`)."""
        held = self.state.held
        if held is None:
            return
        scored = [
            Reply(r.node_id, EVALUATE, held.round, name=r.name, metrics=received_scores(r.metrics))
            for r in replies
            if r.error is None and r.by_device and keys.GLOBAL_ACCURACY in r.metrics
        ]
        rows = self.evaluation_rows(held.round, scored)
        self.state.held = with_evaluation(held, rows, self.classes, server_round)

    def release(self, record: RoundRecord, rides: bool) -> list[RoundRecord]:
        """The records to write now: the held one (scored by this round's trainers, or by none that answered),
        then this round's, unless its evaluation ``rides`` on the next round's training: then it is held."""
        out = [] if self.state.held is None else [self.state.held]
        self.state.held = record if rides else None
        return out if rides else [*out, record]

    def evaluation_nodes(self, server_round: int, connected: Iterable[str] = ()) -> list[str]:
        """A seeded sample (``evaluation.devices``, else all) of the devices that trained without failing, or
        with ``evaluation.all_devices`` of every connected member that is not benched, trained this round or not."""
        ev = self.cfg.evaluation
        pool = sorted(self.eligible(connected)) if ev.all_devices else self.state.replies.answered
        return sample(pool, ev.devices, self.cfg.train.seed, server_round, EVAL_STREAM)

    def close_evaluate(self, server_round: int, replies: list[Reply]) -> None:
        """Keep the evaluate replies that fit schema.EVALUATE (a line for each that does not) and weigh
        their accuracies into the round's."""
        rows = self.evaluation_rows(server_round, replies)
        self.state.replies.evaluation = rows
        self.state.replies.accuracy = Accuracy.of(rows)

    def evaluation_rows(self, server_round: int, replies: list[Reply]) -> list[EvaluateReply]:
        """The evaluate replies that fit schema.EVALUATE, typed; a line for each that does not."""
        rows = []
        for reply in replies:
            if reply.error is not None:
                reason = error_summary(reply.error)
            else:
                reason = reply.problem or schema.metric_problem(reply.metrics, schema.EVALUATE)
            if reason is not None:
                who = Rejection(server_round, reply.node_id, self.device_of(reply), reason).who()
                log.warning("round %d: evaluation from %s failed: %s", server_round, who, reason)
                continue
            rows.append(EvaluateReply.from_metrics(reply.node_id, self.device_of(reply), reply.metrics))
        return rows

    def close_round(self, plan: PlannedRound, started: float) -> RoundRecord:
        """Score the global model (``evaluation.server_test``), advance the clocks (fine-tuning before
        evaluation is on the devices' clock), learn the server's work and return the round's
        metrics.jsonl record."""
        state, got = self.state, self.state.replies
        scored = None
        if self.server_test is not None:
            t = time.perf_counter()
            scored = server_accuracy(self.cfg, self.arrays, self.server_test)
            self.lap(Lap.SERVER_EVAL, t)
        round_time_s = got.round_time_s + finetune_time(self.cfg, state)
        wall = time.perf_counter() - started
        state.finish_round(plan.server_round, round_time_s, wall)
        state.server_work = learn_work(state.server_work, work_of(got.timings, wall))
        bound = got.round_bound_s
        if bound is not None and wall > bound:
            log.warning("round %d took %.1fs of wall time, over its bound of %.1fs", plan.server_round, wall, bound)
        rows = device_rows(got.train, got.evaluation, self.classes, self.full_bytes, self.fixed_s)
        rec = round_record(state, self.cfg.federation.strategy, plan.deadline_s, round_time_s, self.names.params, rows)
        rec.round_wall_s, rec.round_bound_s, rec.train_bound_s = wall, bound, plan.train_bound_s
        rec.eval_bound_s, rec.server_accuracy = plan.eval_bound_s, scored
        with_attendance(rec, got.attendance)
        return rec


def received_scores(metrics: Mapping[str, object]) -> dict[str, object]:
    """A train reply's score of the model it received, as an evaluate reply says it (schema.EVALUATE): its sample
    weight is its held-out split's size. Its wall time stays with the train reply, in the round it was spent."""
    out = {keys.NUM_EXAMPLES: metrics.get(keys.TEST_EXAMPLES)}
    for key in (keys.GLOBAL_ACCURACY, keys.PERSONAL_ACCURACY, keys.PARTITION_ID):
        if key in metrics:
            out[key] = metrics[key]
    return out


def _query_problem(reply: Reply) -> str | None:
    """Why a query reply cannot admit its device, or None."""
    if reply.error is not None:
        return error_summary(reply.error)
    reason = schema.metric_problem(reply.metrics, schema.QUERY)
    if reason is None and (reply.name is None or not DEVICE_NAME.fullmatch(reply.name)):
        reason = f"query reply without a usable '{keys.DEVICE_NAME}' ({reply.name!r})"
    return reason

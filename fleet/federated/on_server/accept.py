"""A round's train replies on their way into the global model: each checked and typed, then the defense,
the robust average, the server's momentum and the next round's global importance.

The coordinator (:mod:`fleet.federated.on_server.coordinator`) decides who takes part and when a round
closes; this is what it does with the replies it closed on. Every reply is untrusted: a reply that fails a
check is rejected with a reason naming its device (``ServerState.replies.rejections`` and one log line),
never raised. The defense's policy is :mod:`~fleet.federated.on_server.defense`'s, the measures
:mod:`~fleet.federated.on_server.robust`'s; this module applies them in order.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import numpy as np

from fleet.data.datasets import ArrayDataset
from fleet.engine.experiment import make_model
from fleet.federated.on_server.aggregate import (
    Rejection,
    error_summary,
    global_importance,
    momentum_step,
    tensor_problem,
    weight_problem,
)
from fleet.federated.on_server.defense import Candidate, Judging, defend, loss_problems, sample_cap
from fleet.federated.on_server.robust import plausible, robust_average, round_key, scale_update, upload_problem
from fleet.federated.on_server.server_eval import reference_loss
from fleet.federated.on_server.similarity import similarity_weights
from fleet.federated.on_server.state import ServerState
from fleet.federated.on_server.trust import direction, server_step, trust_problems
from fleet.federated.shared import keys, schema
from fleet.federated.shared.config import FleetConfig
from fleet.federated.shared.personal import personal_names
from fleet.federated.shared.records import Reply, TrainReply
from fleet.federated.shared.transfer import decode

log = logging.getLogger("fleet.server")


@dataclass(frozen=True)
class ModelNames:
    """The model's tensor names the server needs: the trainable ones, and those devices keep."""

    params: list[str]
    personal: frozenset[str] = frozenset()  # personalization.policy: never sent, never averaged

    @classmethod
    def of(cls, cfg: FleetConfig) -> ModelNames:
        model = make_model(cfg.model, cfg.train.seed)
        return cls([n for n, _ in model.named_parameters()], personal_names(model, cfg.personalization.policy))

    @property
    def shared(self) -> list[str]:
        return [n for n in self.params if n not in self.personal]


@dataclass
class Acceptance:
    """The server's judge of train replies: the checks, the defense and the average, over ``state``."""

    cfg: FleetConfig
    state: ServerState  # the replies' round (``state.replies``) and what the defense keeps across rounds
    names: ModelNames
    sample_caps: dict[str, int] = field(default_factory=dict)  # device -> its data size, where known (simulated)
    reference: ArrayDataset | None = None  # robust.validate: the server's own clean data replies are judged on

    def check(self, server_round: int, reply: Reply, name: str | None) -> Candidate | None:
        """The reply typed, its weight capped and its times clamped, or None (rejected, with the reason). Its
        tensors are checked as they came, then as the values they stand for (``transfer.decode``)."""
        reason, values = self._problem(reply), {}
        if reason is None:
            values = decode(reply.arrays, self.state.replies.sent, self.cfg.federation.transfer)
            reason = upload_problem(values, reply.metrics[keys.SELECTED], self.names.params, self.names.personal)
        if reason is not None:
            self._reject(server_round, reply.node_id, name, reason)
            return None
        told = float(reply.metrics[keys.NUM_EXAMPLES])
        weight = min(told, sample_cap(self.cfg.robust, self.sample_caps, name))
        if weight < told:
            self.state.replies.defense.capped.append(name)
        counted = int(sum(a.nbytes for a in reply.arrays.values()))  # counted here, as they came, not told
        checked = TrainReply.from_metrics(
            reply.node_id, name, reply.metrics, num_examples=weight, bytes_uploaded=counted, wall_s=reply.wall_s
        )
        return Candidate(self._clamp_times(checked), values)

    def _problem(self, reply: Reply) -> str | None:
        """Why a train reply cannot be decoded, or None: the device failed, the message is malformed, its weight,
        a tensor as it came (name, shape, dtype, finite), a metric. What it uploads against what it says it
        trained is checked on the decoded values (:meth:`check`)."""
        if reply.error is not None:
            return f"device failed: {error_summary(reply.error)}"
        problem = reply.problem or weight_problem(reply.metrics.get(keys.NUM_EXAMPLES))
        for name, values in reply.arrays.items():
            problem = problem or tensor_problem(name, values, self.state.replies.sent, self.cfg.federation.transfer)
        return problem or schema.metric_problem(reply.metrics, schema.TRAIN)

    def _clamp_times(self, reply: TrainReply) -> TrainReply:
        """A device's reported full-round time and round time, held to a band around the full time it
        joined with: it may drift (a hot Pi slows down), not move the fleet's deadline or clock at will."""
        member = self.state.roster.get(str(reply.node_id))
        if member is None:
            return reply
        band = self.cfg.robust.time_band
        member.full_time_s = full = plausible(reply.full_time_s, member.profile_s, band)
        return dataclasses.replace(reply, full_time_s=full, predicted_time_s=min(reply.predicted_time_s, band * full))

    def average(self, server_round: int, candidates: list[Candidate]) -> dict[str, np.ndarray] | None:
        """The defense, then per tensor a robust average over the devices that sent it, server momentum
        and the next round's global importance: the new global arrays, or None when no reply is usable."""
        state, robust, fed = self.state, self.cfg.robust, self.cfg.federation
        current = state.replies.sent
        judging = Judging(
            server_round,
            current,
            self.names.params,
            robust,
            state.suspects,
            state.replies.defense,
            state.typical_norms,
            state.last_step,
            state.strikes,
            round_key(state.screen_secret, server_round),
        )
        kept, rejected = defend(judging, candidates)
        kept, rejected = self._validate(kept, rejected, server_round)
        kept = self._weigh_by_similarity(kept)
        for c, reason in rejected:
            self._reject(server_round, c.reply.node_id, c.reply.device, reason)
        if not kept:
            log.warning("round %d: no usable training replies; the global model is unchanged", server_round)
            return None
        updates = [(c.arrays, c.reply.num_examples) for c in kept]
        new, state.replies.senders = robust_average(current, updates, robust.aggregation, robust.trim_fraction)
        shared = self.names.shared
        if fed.server_momentum is not None:
            new, state.momentum = momentum_step(
                current, new, state.replies.senders, state.momentum, shared, fed.server_momentum, fed.server_lr
            )
        state.replies.train = [c.reply for c in kept]
        state.last_step = last_step(current, new, self.names.params)
        state.global_importance = global_importance(state.last_step, shared, self.cfg.train.lr)
        return new

    def _validate(self, kept: list[Candidate], rejected: list, server_round: int) -> tuple[list[Candidate], list]:
        """``robust.validate``: each kept reply judged on the server's own clean data, by the loss its update adds
        there (``start``: one far above the fleet's median rise is rejected) or by its direction against the
        server's own step over the rounds (``trust``)."""
        if self.reference is None or not kept:
            return kept, rejected
        if self.cfg.robust.validate == "trust":
            return self._trust(kept, rejected, server_round)
        current = self.state.replies.sent
        base = reference_loss(self.cfg, current, self.reference)
        rises = [reference_loss(self.cfg, probe_step(current, c.arrays), self.reference) - base for c in kept]
        for c, rise in zip(kept, rises):
            self.state.replies.defense.loss_rise[c.reply.device] = round(rise, 4)
        problems = loss_problems(rises, self.cfg.robust)
        late = [(kept[i], reason) for i, reason in problems.items()]
        return [c for i, c in enumerate(kept) if i not in problems], rejected + late

    def _trust(self, kept: list[Candidate], rejected: list, server_round: int) -> tuple[list[Candidate], list]:
        """``robust.validate: trust``: each kept reply's cosine with the server's own step added to its device's
        history; a device whose mean falls below the floor is rejected (:mod:`~fleet.federated.on_server.trust`)."""
        current, report = self.state.replies.sent, self.state.replies.defense
        step = server_step(self.cfg, current, self.reference, self.names.shared, server_round)
        devices = [c.reply.device or str(c.reply.node_id) for c in kept]
        cosines = {d: direction(current, c.arrays, step) for d, c in zip(devices, kept)}
        report.trust.update({d: round(v, 4) for d, v in cosines.items()})
        problems = trust_problems(self.state.trust, cosines)
        late = [(c, problems[d]) for d, c in zip(devices, kept) if d in problems]
        return [c for d, c in zip(devices, kept) if d not in problems], rejected + late

    def _weigh_by_similarity(self, kept: list[Candidate]) -> list[Candidate]:
        """``robust.similarity``: each kept update scaled by its FoolsGold weight; a weight of 0 leaves it out of
        the average (not a rejection: its device is not told it lied)."""
        if not self.cfg.robust.similarity or not kept:
            return kept
        current, report = self.state.replies.sent, self.state.replies.defense
        devices = [c.reply.device or str(c.reply.node_id) for c in kept]
        weights = similarity_weights(self.state.similarity, {d: c.arrays for d, c in zip(devices, kept)}, current)
        out = []
        for device, c in zip(devices, kept):  # every kept reply, even one whose name another reply also claims
            w = weights[device]
            if w < 1.0:
                report.similarity[device] = round(w, 3)
                c.arrays, c.norms = scale_update(current, c.arrays, w, self.names.params), None
            if w > 0.0:
                out.append(c)
        return out

    def _reject(self, server_round: int, node_id: int, device: str | None, reason: str) -> None:
        rejection = Rejection(server_round, node_id, device, reason)
        self.state.replies.rejections.append(rejection)
        log.warning("round %d: rejected reply from %s: %s", server_round, rejection.who(), reason)


def last_step(before: dict[str, np.ndarray], after: dict[str, np.ndarray], params: list[str]) -> dict[str, np.ndarray]:
    """The global model's step on every trainable tensor that moved: the direction next round's
    updates are judged against (robust.min_cos)."""
    steps = {n: after[n] - before[n] for n in params if n in after and after[n].dtype.kind == "f"}
    return {n: d for n, d in steps.items() if d.any()}


PROBE_STEP = 0.1  # robust.validate applies this share of an update: its direction's first-order effect on the loss


def probe_step(current: dict[str, np.ndarray], sent: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The global model moved ``PROBE_STEP`` of the way along a reply's update. A whole non-IID update
    applied alone overfits the balanced set (honest rises of 0.2 to 9 nats were measured); a short
    step keeps the direction's first-order effect, where a flipped head shows, and drops the rest."""
    return {**current, **scale_update(current, sent, PROBE_STEP, list(sent))}

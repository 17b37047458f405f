"""The server's policy against bad updates: which replies are scaled, clipped or rejected, and why.

:mod:`fleet.federated.on_server.robust` measures (update norms, a device's screen against the others, robust
means); this module decides, from ``robust`` (the config's RobustConfig section, read as it is) and
what earlier rounds learned (the suspects). It returns its verdicts rather than logging them, so the
coordinator reports every rejection of a round in one place and one wording.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleet.federated.on_server.robust import (
    Screen,
    bound_update,
    lower_medians,
    scale_update,
    screen_devices,
    trend_cosines,
    update_norms,
)
from fleet.federated.shared.config import RobustConfig
from fleet.federated.shared.records import TrainReply


@dataclass
class Candidate:
    """A train reply that passed its checks, on its way into the average (``reply.num_examples``: its
    capped weight)."""

    reply: TrainReply
    arrays: dict[str, np.ndarray]
    # its update's norm per float tensor (robust.update_norms), once :func:`norms_of` asked; reset when arrays change
    norms: dict[str, float] | None = None


def norms_of(c: Candidate, current: Mapping[str, np.ndarray]) -> dict[str, float]:
    """A candidate's update norms, taken once: the screen and the bound read the same ones, and each is a full
    pass over a model's worth of floats (a tenth of a second of every round with 8 replies, taken twice)."""
    if c.norms is None:
        c.norms = update_norms(current, [c.arrays])[0]
    return c.norms


Rejected = tuple[Candidate, str]  # a candidate the defense turned away, and why
# a forgiven reply's update is kept at this share of its length: it still counts, less, in the round it may be wrong
STRIKE_SCALE = 0.5
# a pull or a cosine past this multiple of its floor is rejected at once: no honest device was measured below 1.6x
FORGIVEN = 2.0


SKEWED = "skewed"  # metrics.jsonl's defense key: device -> tensors left out for their own sign skew


@dataclass
class DefenseReport:
    """What the defense did in one round (metrics.jsonl's ``defense``)."""

    capped: list[str] = field(default_factory=list)  # devices whose sample count was capped
    screen: dict[str, dict] = field(default_factory=dict)  # device -> its Screen (as_dict)
    scaled: dict[str, float] = field(default_factory=dict)  # device -> the factor its update was scaled down by
    clipped: dict[str, int] = field(default_factory=dict)  # device -> tensors clipped to the norm bound
    skewed: dict[str, int] = field(default_factory=dict)  # device -> tensors left out for their own sign skew
    trend: dict[str, float] = field(default_factory=dict)  # device -> its cosine with the global model's last step
    loss_rise: dict[str, float] = field(default_factory=dict)  # device -> the loss its update adds on the server's data
    trust: dict[str, float] = field(default_factory=dict)  # device -> its cosine with the server's own step
    # device -> the figure that failed (its pull or its cosine with the last step), where it was a strike within
    # robust.strike_window rounds: kept, its update scaled by STRIKE_SCALE (non-IID honest devices do this now and then)
    strikes: dict[str, str] = field(default_factory=dict)
    # device -> its FoolsGold weight (robust.similarity), where below 1: its update scaled by it (0: left out)
    similarity: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The screens always (what every device measured); the rest only when it happened."""
        out: dict[str, Any] = {"capped": self.capped} if self.capped else {}
        out["screen"] = self.screen
        extra = {"scaled": self.scaled, "clipped": self.clipped, SKEWED: self.skewed, "trend": self.trend}
        extra["loss_rise"], extra["trust"] = self.loss_rise, self.trust
        extra["strikes"], extra["similarity"] = self.strikes, self.similarity
        out.update({k: v for k, v in extra.items() if v})
        return out


def sample_cap(robust: RobustConfig, known: Mapping[str, int], name: str | None) -> float:
    """A reply's largest sample weight: the device's ``known`` data size (a simulation knows every
    device's), else ``max_samples_per_device``."""
    size = known.get(name or "")
    cap = robust.max_samples_per_device
    return float(min(size, cap) if size else cap)


@dataclass
class Judging:
    """What one round's defense judges replies by, and what it keeps across rounds."""

    server_round: int
    current: Mapping[str, np.ndarray]  # the global arrays the round started from: an update is reply - current
    param_names: list[str]  # the trainable tensors (normalization statistics are not steps)
    robust: RobustConfig
    suspects: dict[str, int]  # device -> the round the screen first rejected it (ServerState.suspects)
    report: DefenseReport  # what the defense did, for metrics.jsonl
    typical: dict[str, float] = field(default_factory=dict)  # tensor -> its typical update norm (ServerState)
    trend: Mapping[str, np.ndarray] = field(default_factory=dict)  # tensor -> the global model's last step
    # device -> the rounds its update pointed against the others or the last step (ServerState.strikes), pruned to
    # robust.strike_window
    strikes: dict[str, list[int]] = field(default_factory=dict)
    key: int = 0  # the round's key for the coordinates directions are judged on (robust.round_key): secret

    def recent_strikes(self, device: str) -> int:
        """How many rounds before this one, within ``strike_window``, the device's update pointed the wrong way."""
        since = self.server_round - self.robust.strike_window
        return sum(since < r < self.server_round for r in self.strikes.get(device, []))

    def strike(self, device: str) -> None:
        """This round counts against the device (once, whichever rule saw it)."""
        since = self.server_round - self.robust.strike_window
        kept = [r for r in self.strikes.get(device, []) if since < r < self.server_round]
        self.strikes[device] = [*kept, self.server_round]

    def forgivable(self, device: str, value: float, floor: float | None) -> bool:
        """Whether a direction figure below its ``floor`` (by at most ``FORGIVEN`` x it) is a strike rather than a
        rejection: fewer than ``robust.strikes`` such rounds within ``strike_window``, this one included. Under
        non-IID data an honest device's update points away from the others' and from the last step now and then
        (pulls of -0.64 and cosines of -0.47 were measured); an attacker's must do so round after round to harm."""
        if floor is None or value >= floor or value < FORGIVEN * floor:
            return False
        return self.recent_strikes(device) + 1 < self.robust.strikes

    def forgive(self, c: Candidate, figure: str) -> None:
        """A strike: the reply is kept at ``STRIKE_SCALE`` of its update (once a round, whichever rule forgave it)."""
        name = c.reply.device
        self.strike(name)
        if name not in self.report.strikes:
            c.arrays, c.norms = scale_update(self.current, c.arrays, STRIKE_SCALE, self.param_names), None
        self.report.strikes[name] = figure

    def note_strike(self, device: str) -> str:
        """A rejection's note of the device's earlier strikes; this round becomes one."""
        before = self.recent_strikes(device)
        self.strike(device)
        return f", and did in {before} of its last {self.robust.strike_window} rounds" if before else ""

    def reject(self, c: Candidate, reason: str, rejected: list[Rejected]) -> None:
        self.suspects.setdefault(c.reply.device, self.server_round)
        rejected.append((c, reason))


def defend(j: Judging, candidates: list[Candidate]) -> tuple[list[Candidate], list[Rejected]]:
    """Judge each device against the global model's last step, then against the others, then hold
    every update to ``norm_bound`` x the lower median norm per tensor (no more than its typical norm
    of earlier rounds allows, which this round updates); (kept, rejected with the reason), in the
    order they were decided."""
    pending, rejected = by_trend(j, candidates)
    kept, screened = screen(j, pending)
    kept, late = bound(kept, j.current, j.robust, j.report, j.typical)
    return kept, rejected + screened + late


def by_trend(j: Judging, candidates: list[Candidate]) -> tuple[list[Candidate], list[Rejected]]:
    """Every device against ``trend``, the global model's last step (``min_cos``), which no device of
    this round can drag, and which also judges the tensors a device alone trained."""
    arrays = [c.arrays for c in candidates]
    trends = trend_cosines(j.current, arrays, j.param_names, j.trend, j.key) if j.trend else {}
    pending, rejected = [], []
    for i, c in enumerate(candidates):
        if i in trends:
            j.report.trend[c.reply.device] = round(trends[i][0], 3)
        reason = trend_problem(trends.get(i), j.robust)
        if reason is None:
            pending.append(c)
        elif j.forgivable(c.reply.device, trends[i][0], j.robust.min_cos):
            j.forgive(c, f"cosine {trends[i][0]:.2f}")
            pending.append(c)
        else:
            j.reject(c, reason + j.note_strike(c.reply.device), rejected)
    return pending, rejected


def screen(j: Judging, candidates: list[Candidate]) -> tuple[list[Candidate], list[Rejected]]:
    """Each device judged on the tensors others trained too, the verdict applied to its whole
    reply: pulling against the fleet (``pull`` below ``min_pull``) or skewed in its signs is
    rejected; oversized (above ``norm_bound`` x the others') is scaled down as a whole to their
    size, or rejected, and always rejected from a device caught pulling back in an earlier round
    (a suspect).

    The suspects' memory is for late rounds: honest updates grow nearly orthogonal, so an
    amplified sign flip's pull, its size counted only up to the bound, can read small and pass,
    scaled down but still reversed. An honest device is never oversized, so it never meets it.

    A reply that shares no tensor with enough others to be judged is rejected while others are
    judged (with the screen on): a device picks the tensors it claims, and one that claims only
    those the fewest others trained (mask abuse) meets no majority. Honest devices all train the
    cheap tensors near the output, which everyone shares."""
    screens, rejected = worst_first(j, candidates)  # the survivors' screens passed there
    for c, sc in zip(candidates, screens):
        if sc is not None:
            j.report.screen[c.reply.device] = sc.as_dict()
    gone = {id(c) for c, _ in rejected}
    survivors = [(c, sc) for c, sc in zip(candidates, screens) if id(c) not in gone]
    judged = any(sc is not None for _, sc in survivors)
    kept = []
    for c, sc in survivors:
        name = c.reply.device
        if sc is None and judged and j.robust.min_pull is not None:
            rejected.append((c, "it trained no tensor that enough other devices trained too to be judged"))
            continue
        if sc is not None and oversized(sc, j.robust):
            # to a typical update's size, not to the bound: inflating an update past the bound buys nothing
            c.arrays, c.norms = scale_update(j.current, c.arrays, 1.0 / sc.norm_ratio, j.param_names), None
            j.report.scaled[name] = round(sc.norm_ratio, 3)
        elif sc is not None:
            j.suspects.pop(name, None)  # back to an ordinary size: trusted again
        if sc is not None and sc.skewed:  # poisoned where the median over its tensors could not see it
            c.arrays, c.norms = {k: v for k, v in c.arrays.items() if k not in sc.skewed}, None
            j.report.skewed[name] = len(sc.skewed)
        if pulls_back(sc, j.robust):  # forgiven there: a strike, and its pull weighs less
            j.forgive(c, f"pull {sc.pull:.2f}")
        kept.append(c)
    return kept, rejected


def trend_problem(trend: tuple[float, int] | None, robust: RobustConfig) -> str | None:
    """Why a device's cosine with the global model's last step rejects its reply, or None."""
    if trend is None or robust.min_cos is None or trend[0] >= robust.min_cos:
        return None
    return (
        f"its update points against the global model's last step (cosine {trend[0]:.2f} over {trend[1]} "
        f"tensors; floor {robust.min_cos:g})"
    )


def worst_first(j: Judging, candidates: list[Candidate]) -> tuple[list[Screen | None], list[Rejected]]:
    """Screen the candidates against each other, rejecting the worst offender and screening the rest
    again until none fails: two colluders drag the others' median, and an honest device judged
    against it can read as pulling back, which it no longer does once they are gone. Returns each
    candidate's last screen (None: not judged) and the rejected, in the order rejected."""
    cap = j.robust.norm_bound if j.robust.norm_bound is not None else math.inf
    skew = j.robust.max_sign_skew  # also each large weight's own (Screen.skewed, robust.held_alone)
    alive, rejected = list(range(len(candidates))), []
    screens: list[Screen | None] = [None] * len(candidates)
    while True:
        arrays, norms = [candidates[i].arrays for i in alive], [norms_of(candidates[i], j.current) for i in alive]
        found = screen_devices(j.current, arrays, j.param_names, size_cap=cap, norms=norms, key=j.key, skew_bound=skew)
        for k, i in enumerate(alive):
            screens[i] = found.get(k)
        failing = {}
        for i in alive:
            sc, device = screens[i], candidates[i].reply.device
            reason = None if sc is None else screen_problem(sc, j.robust, j.suspects.get(device))
            if reason is not None and not forgiven(j, device, sc):
                failing[i] = reason
        if not failing:
            return screens, rejected
        worst = max(failing, key=lambda i: severity(screens[i], j.robust))
        device, sc = candidates[worst].reply.device, screens[worst]
        note = j.note_strike(device) if pulls_back(sc, j.robust) else ""
        j.reject(candidates[worst], failing[worst] + note, rejected)
        alive.remove(worst)


def pulls_back(sc: Screen | None, robust: RobustConfig) -> bool:
    return sc is not None and robust.min_pull is not None and sc.pull < robust.min_pull


def forgiven(j: Judging, device: str, sc: Screen) -> bool:
    """Whether a screen that fails only on its pull is a strike, not a rejection (:meth:`Judging.forgivable`)."""
    if screen_problem(dataclasses.replace(sc, pull=0.0), j.robust, j.suspects.get(device)) is not None:
        return False
    return j.forgivable(device, sc.pull, j.robust.min_pull)


def severity(sc: Screen, robust: RobustConfig) -> float:
    """How far a screen is past the limit it fails, in units of that limit: who goes first."""
    parts = [sc.norm_ratio / robust.norm_bound if robust.norm_bound else 0.0]
    if robust.min_pull is not None:
        parts.append(sc.pull / robust.min_pull)
    if robust.max_sign_skew is not None:
        parts.append(abs(sc.sign_skew) / robust.max_sign_skew)
    return max(parts)


def bound(
    candidates: list[Candidate],
    current: Mapping[str, np.ndarray],
    robust: RobustConfig,
    report: DefenseReport,
    typical: dict[str, float],
) -> tuple[list[Candidate], list[Rejected]]:
    """Updates held to ``norm_bound`` x the lower median norm per tensor, and to ``norm_growth`` x its
    ``typical`` norm of earlier rounds: clipped, or rejected. ``typical`` then learns this round's."""
    if robust.norm_bound is None or not candidates:
        return candidates, []
    norms = [norms_of(c, current) for c in candidates]  # the limits and the clips read the same ones
    medians = lower_medians(norms)
    if robust.norm_growth is not None:
        medians = {n: min(m, robust.norm_growth * typical.get(n, math.inf)) for n, m in medians.items()}
    typical.update(medians)
    limits = {name: robust.norm_bound * m for name, m in medians.items()}
    kept, rejected = [], []
    for c, sent_norms in zip(candidates, norms):
        bounded, clipped = bound_update(current, c.arrays, limits, sent_norms)
        if clipped and robust.norm_action == "reject":
            reason = (
                f"update of {len(clipped)} tensors above {robust.norm_bound:g}x the median norm (first {clipped[0]!r})"
            )
            rejected.append((c, reason))
            continue
        if clipped:
            report.clipped[c.reply.device] = len(clipped)
        c.arrays = bounded
        kept.append(c)
    return kept, rejected


def oversized(sc: Screen, robust: RobustConfig) -> bool:
    return robust.norm_bound is not None and sc.norm_ratio > robust.norm_bound


def screen_problem(sc: Screen, robust: RobustConfig, suspect_since: int | None = None) -> str | None:
    """Why a device's screen rejects its reply, or None; ``suspect_since``: the round the screen first
    rejected it, while it has stayed a suspect."""
    shared = f"over {sc.tensors} tensors other devices trained too"
    if robust.min_pull is not None and sc.pull < robust.min_pull:
        return f"its update pulls against the other devices' ({sc.pull:.2f} typical updates {shared})"
    if robust.max_sign_skew is not None and abs(sc.sign_skew) > robust.max_sign_skew:
        return (
            f"its update rises on a share of coordinates {sc.sign_skew:+.2f} off the other devices' ({shared}; "
            f"allowed {robust.max_sign_skew:g})"
        )
    if oversized(sc, robust) and (robust.norm_action == "reject" or suspect_since is not None):
        bound = robust.norm_bound
        too_big = f"its update is {sc.norm_ratio:.1f}x the other devices' (median {shared}; bound {bound:g})"
        return too_big + ("" if suspect_since is None else f", and it pulled back in round {suspect_since}")
    return None


def loss_problems(rises: list[float], robust: RobustConfig) -> dict[int, str]:
    """Per reply (index into ``rises``, each the loss its update adds on the server's clean data), why it
    is rejected: a rise more than ``max_loss_rise`` above the fleet's median rise. Honest non-IID
    updates raise a balanced set's loss a little, each toward its own classes; a flipped head raises it
    far more (Zeno, Xie et al. 2019, judged against the fleet rather than a fixed threshold)."""
    if len(rises) < 3:
        return {}
    median = statistics.median(rises)
    return {
        i: f"its update raises the loss on the server's own data by {r:.2f} (the fleet's median {median:.2f}; "
        f"allowed {robust.max_loss_rise:g} more)"
        for i, r in enumerate(rises)
        if r - median > robust.max_loss_rise
    }

"""Attacks at the edge of the checks: each adaptive attack sent at the largest strength the server's own
defense accepts.

A fixed-strength attack tests a defense only where its authors guessed the line lies. fleet is open source,
so an attacker can run the server's defense itself: this module stands the honest updates it knows (the
previous round's, :mod:`fleet.bench.adversary_app`) in for this round's, adds its colluders' crafted replies,
and runs :func:`fleet.federated.on_server.defense.defend` on them as the server would, searching for the
largest strength that comes through. Every future defense then faces its own worst case.

Design notes:

* **Accepted** means every colluder's reply is kept whole: not rejected, not struck (a strike halves the
  update, and repeated strikes reject it), not scaled down as oversized, no tensor left out for its own sign
  skew. Clipping to the norm bound is allowed: it only shortens the tensors past it.
* **What the attacker cannot know.** The server judges directions on coordinates drawn from its secret; the
  dry run draws its own, GUESSES times, and a strength must pass on each: near the edge one sample's verdict
  is a coin toss. The server's typical norms of earlier rounds are unknown too, so the dry run's
  norm bound comes from this round's replies alone (a looser bound than the server's, never a tighter one).
* **The search** assumes a stronger attack is no easier to accept: from the attack's fixed strength it
  doubles while accepted, then bisects the bracket. About a dozen dry runs a round, each a fraction of a
  second on the bench's ResNet-18.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from fleet.federated.on_server.defense import Candidate, DefenseReport, Judging, defend
from fleet.federated.shared.config import RobustConfig
from fleet.federated.shared.records import TrainReply

MAX_DOUBLINGS = 6  # the search goes at most 2^6 = 64x past the fixed strength
BISECTIONS = 6  # then narrows the bracket to 1/64 of its width
ATTACKER = "adversary"  # the dry run's name prefix for a colluder's reply
DRY_ROUND = 2  # the dry run's round: past the first, so every rule that waits for history applies
# the dry run's guesses at the server's secret coordinates: a strength must pass on each, so that it passes on the
# server's too, which judges another sample of the same tensors
GUESSES = (1, 2, 3)


def edge_strength(accepts: Callable[[float], bool], start: float) -> float:
    """The largest strength ``accepts`` allows, found from ``start`` (the attack's fixed strength): doubling
    while accepted, at most MAX_DOUBLINGS times, then BISECTIONS halvings of the bracket; 0.0 when even the
    smallest tried is refused."""
    lo, hi = 0.0, start
    if accepts(start):
        lo, hi = start, None
        for _ in range(MAX_DOUBLINGS):
            if not accepts(2 * lo):
                hi = 2 * lo
                break
            lo *= 2
        if hi is None:
            return lo
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if accepts(mid) else (lo, mid)
    return lo


def _reply(index: int, name: str) -> TrainReply:
    """A stand-in reply's figures: the defense reads only its device name (weights are equal)."""
    return TrainReply(
        node_id=index,
        device=name,
        num_examples=1.0,
        tier=1.0,
        selected=1,
        num_tensors=1,
        trained_fraction=1.0,
        rho=1.0,
        predicted_time_s=1.0,
        measured_time_s=1.0,
        full_time_s=1.0,
        bytes_uploaded=0,
        steps=1,
    )


@dataclass(frozen=True)
class DryRun:
    """The server's defense as an attacker can run it in one round."""

    robust: RobustConfig  # the fleet's defenses, as its config says (the config is not secret)
    current: Mapping[str, np.ndarray]  # the global model the round started from
    params: list[str]  # the trainable tensors a device may claim
    honest: list[dict[str, np.ndarray]]  # stand-ins for this round's honest replies (values)
    colluders: int  # how many adversaries send the crafted reply
    trend: Mapping[str, np.ndarray]  # the global model's last step, where the attacker saw it ({}: unseen)
    keys: tuple[int, ...] = GUESSES  # its own keys for the judged coordinates: the server's is secret

    def accepts(self, crafted: Mapping[str, np.ndarray]) -> bool:
        """Whether every colluder sending ``crafted`` (values) would be kept whole (module notes), on each of
        the dry run's guesses at the server's coordinates."""
        return all(self._accepts(crafted, key) for key in self.keys)

    def _accepts(self, crafted: Mapping[str, np.ndarray], key: int) -> bool:
        names = [f"honest-{i}" for i in range(len(self.honest))] + [f"{ATTACKER}-{i}" for i in range(self.colluders)]
        replies = [*self.honest, *[crafted] * self.colluders]
        candidates = [Candidate(_reply(i, n), dict(a)) for i, (n, a) in enumerate(zip(names, replies))]
        report = DefenseReport()
        judging = Judging(DRY_ROUND, self.current, self.params, self.robust, {}, report, {}, self.trend, {}, key)
        kept, _ = defend(judging, candidates)
        whole = {c.reply.device for c in kept} - set(report.strikes) - set(report.scaled) - set(report.skewed)
        return all(f"{ATTACKER}-{i}" in whole for i in range(self.colluders))

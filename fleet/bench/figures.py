"""Figures the benches read off a run's rounds, each computed here once and each saying which clock it reads.

A bench on the simulator compares methods on the simulated clock (each device's profile times its tier, its
upload over its link); the testbed and a deployment compare them in the server's wall seconds. The same
figure on the two clocks is two different claims, so every helper here is told the clock.
"""

from __future__ import annotations

from fleet.federated.shared.round_record import RoundRecord

SIM_CLOCK = "sim_time_s"  # the simulated clock at a round's end (fleet simulate, the benches on it)
WALL_CLOCK = "wall_time_s"  # the server's wall seconds at a round's end (the testbed, a deployment)


def first_reaching(records: list[RoundRecord], target: float, key: str = "global_accuracy") -> RoundRecord | None:
    """The first round whose accuracy ``key`` (a :class:`RoundRecord` field) reaches ``target``; None if none does
    (a round not evaluated never does)."""
    return next((r for r in records if (v := getattr(r, key)) is not None and v >= target), None)


def time_to_target(
    records: list[RoundRecord], target: float, *, clock: str, key: str = "global_accuracy"
) -> float | None:
    """The ``clock`` reading when ``key`` first reached ``target``; None if it never did."""
    hit = first_reaching(records, target, key)
    return None if hit is None else getattr(hit, clock)


def speedup(baseline_s: float | None, method_s: float | None) -> float | None:
    """How many times sooner a method reached a target than the baseline did (on one clock); None unless both
    reached it."""
    return baseline_s / method_s if baseline_s and method_s else None

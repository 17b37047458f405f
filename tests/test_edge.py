"""Attacks at the edge of the checks (fleet/bench/edge.py): the search finds the largest strength a check
allows, and the dry run judges a crafted reply as the server's own defense does."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fleet.base.errors import ConfigError
from fleet.bench import attacks, edge
from fleet.bench.attack_names import ADAPTIVE, KNOWING
from fleet.bench.robustness import check_choices, edge_strengths, median_strength
from fleet.federated.on_server.defense import Candidate, DefenseReport, Judging, defend
from fleet.federated.shared.config import RobustConfig


@pytest.mark.parametrize("threshold", [0.3, 1.0, 2.5, 40.0])
def test_the_search_ends_just_under_the_threshold_of_a_monotone_check(threshold):
    tried = []

    def accepts(s: float) -> bool:
        tried.append(s)
        return s <= threshold

    found = edge.edge_strength(accepts, start=1.0)
    assert found <= threshold and accepts(found)
    width = 1.0 if threshold < 1.0 else 2 ** int(np.log2(threshold))  # the bracket the bisection narrowed
    assert threshold - found <= width / 2**edge.BISECTIONS
    assert len(tried) <= 1 + edge.MAX_DOUBLINGS + edge.BISECTIONS + 1


def test_the_search_stops_at_its_cap_and_reports_zero_when_nothing_passes():
    assert edge.edge_strength(lambda s: True, 1.5) == 1.5 * 2**edge.MAX_DOUBLINGS
    assert edge.edge_strength(lambda s: s == 0.0, 1.0) == 0.0


# a small fleet: tensors of several sizes, honest updates along one shared step plus their own noise
# two large weights held to the sign skew on their own, vectors, and a classifier last (robust.held_alone)
SHAPES = {f"t{i}": s for i, s in enumerate([(90, 100), (50, 100), 600, 64, 64, 64, 64, 32, 32, (1, 10)])}


def fleet(seed: int = 0):
    rng = np.random.default_rng(seed)
    current = {n: rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}
    step = {n: rng.normal(size=s) for n, s in SHAPES.items()}

    def update() -> attacks.Update:
        return {n: torch.from_numpy(0.1 * step[n] + 0.1 * rng.normal(size=SHAPES[n])) for n in SHAPES}

    trend = {n: (0.1 * step[n]).astype(np.float32) for n in SHAPES}
    return current, [update() for _ in range(6)], update(), trend


def values(current, update: attacks.Update) -> dict[str, np.ndarray]:
    return {n: (current[n] + u.numpy()).astype(np.float32) for n, u in update.items()}


def server_keeps_whole(current, honest, crafted, colluders: int, trend, key: int) -> bool:
    """The server's defense as the coordinator calls it (its own key), on honest replies and the colluders'."""
    names = [f"h{i}" for i in range(len(honest))] + [f"a{i}" for i in range(colluders)]
    arrays = [values(current, h) for h in honest] + [crafted] * colluders
    cands = [Candidate(edge._reply(i, n), dict(a)) for i, (n, a) in enumerate(zip(names, arrays))]
    report = DefenseReport()
    kept, _ = defend(Judging(5, current, list(SHAPES), RobustConfig(), {}, report, {}, trend, {}, key), cands)
    whole = {c.reply.device for c in kept} - set(report.strikes) - set(report.scaled) - set(report.skewed)
    return all(f"a{i}" in whole for i in range(colluders))


def test_the_dry_run_keeps_an_honest_reply_and_turns_away_a_reversed_one():
    current, honest, own, trend = fleet()
    dry = edge.DryRun(RobustConfig(), current, list(SHAPES), [values(current, h) for h in honest], 2, trend)
    assert dry.accepts(values(current, own))
    assert not dry.accepts(values(current, {n: -10 * u for n, u in own.items()}))
    assert not dry.accepts(values(current, attacks.ipm(own, honest, 1.0)))  # against the last step: never kept


@pytest.mark.parametrize("attack", ["alie", "backdoor"])
def test_the_strength_found_passes_the_servers_defense_and_a_fifth_more_does_not(attack):
    current, honest, own, trend = fleet()
    dry = edge.DryRun(RobustConfig(), current, list(SHAPES), [values(current, h) for h in honest], 2, trend)

    def crafted(s: float) -> dict[str, np.ndarray]:
        return values(current, attacks.craft(attack, own, honest, s))

    found = edge.edge_strength(lambda s: dry.accepts(crafted(s)), attacks.FIXED_STRENGTH[attack])
    assert 0 < found < attacks.FIXED_STRENGTH[attack] * 2**edge.MAX_DOUBLINGS
    # the server draws its own secret coordinates, and still judges as the dry run did
    for key in range(100, 105):
        assert server_keeps_whole(current, honest, crafted(found), 2, trend, key)
        assert not server_keeps_whole(current, honest, crafted(1.2 * found), 2, trend, key)


def test_min_max_on_the_large_tensors_alone_is_no_longer_kept_whole_at_any_strength_up_to_the_cap():
    current, honest, own, trend = fleet()
    dry = edge.DryRun(RobustConfig(), current, list(SHAPES), [values(current, h) for h in honest], 2, trend)
    cap = 2.0**edge.MAX_DOUBLINGS
    crafted = values(current, attacks.craft("min_max_unsampled", own, honest, cap))
    assert not dry.accepts(crafted)  # its large tensors are left out for their own sign skew
    for key in range(100, 105):  # ... by the server too: kept, but not whole
        assert not server_keeps_whole(current, honest, crafted, 2, trend, key)
    assert (
        edge.edge_strength(
            lambda s: dry.accepts(values(current, attacks.craft("min_max_unsampled", own, honest, s))), 1.0
        )
        < cap
    )


def test_every_knowing_attack_has_a_strength_and_its_fixed_one_is_the_bench_attack():
    assert set(attacks.FIXED_STRENGTH) == set(KNOWING) and set(ADAPTIVE) <= set(KNOWING)
    current, honest, own, _ = fleet()
    fixed = {
        "alie": attacks.alie(own, honest),
        "ipm_1": attacks.ipm(own, honest, 1.0),
        "min_max": attacks.min_max(own, honest),
        "backdoor": attacks.under_bound(own, honest),
        "mask_abuse": attacks.mask_abuse(own, honest, list(own)),
    }
    for attack, expected in fixed.items():
        got = attacks.craft(attack, own, honest)
        assert set(got) == set(expected) and all(torch.equal(got[n], expected[n]) for n in got), attack
    # at a searched strength Min-Max is ALIE: the honest mean along minus the honest spread
    same = attacks.craft("min_max", own, honest, 0.7), attacks.craft("alie", own, honest, 0.7)
    assert all(torch.allclose(same[0][n], same[1][n]) for n in own)


def test_adaptive_mode_refuses_an_attack_without_a_strength_in_one_line():
    with pytest.raises(ConfigError, match="'label_flip' has no strength to search in --adaptive mode"):
        check_choices(["label_flip"], [1], 8, adaptive=True)
    check_choices(list(ADAPTIVE), [1, 2], 8, adaptive=True)


def test_the_bench_reports_the_first_adversarys_strength_per_round(tmp_path):
    notes = tmp_path / "edge"
    notes.mkdir()
    for r, p, s in ((2, 0, 0.5), (2, 1, 0.5), (3, 0, 0.75), (10, 0, 1.0), (3, 1, 9.0)):
        (notes / f"{r}-{p}.json").write_text(json.dumps({"round": r, "partition": p, "strength": s}))
    found = edge_strengths(tmp_path)
    assert found == {"2": 0.5, "3": 0.75, "10": 1.0}
    assert median_strength({"edge_strengths": found}) == "0.75" and median_strength({}) == "-"
    assert edge_strengths(tmp_path / "none") == {}

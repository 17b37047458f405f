"""The screen against attackers who read its code: the coordinates it judges are a secret, per-round
sample. The attack is tuned to the check it defeats, and shown to pass that check first: a defense
tested only against attacks it was built for proves nothing."""

from __future__ import annotations

import numpy as np
import torch

from fleet.bench import attacks
from fleet.federated.on_server.defense import screen_problem
from fleet.federated.on_server.robust import round_key, sample_coordinates, screen_devices
from fleet.federated.on_server.server_run import screen_secret
from fleet.federated.shared.config import RobustConfig, load_fleet_config

BIG = 40_000  # a tensor the screen samples (more than SCREEN_COORDINATES values)


def honest_updates(rng: np.random.Generator, n: int, shapes: dict[str, int]) -> list[dict[str, np.ndarray]]:
    """``n`` honest non-IID updates: one shared direction per tensor plus each device's own noise."""
    common = {name: rng.normal(size=size) for name, size in shapes.items()}
    return [
        {name: (c + 0.8 * rng.normal(size=c.size)).astype(np.float32) for name, c in common.items()} for _ in range(n)
    ]


def test_min_max_outside_a_public_sample_passes_it_and_is_caught_by_a_secret_one():
    """The attacker runs Min-Max on every coordinate but the sample it can compute (key 0): judged on that
    sample its update is honest and passes every check; judged on the round's secret sample its signs
    give it away (Min-Max falls on nearly every coordinate it moves)."""
    rng = np.random.default_rng(0)
    ref = {"w": np.zeros(BIG, np.float32)}
    honest = honest_updates(rng, 7, {"w": BIG})
    own = {"w": torch.from_numpy(honest[0]["w"].astype(np.float64))}
    spied = [{"w": torch.from_numpy(u["w"].astype(np.float64))} for u in honest[1:]]
    attack = {"w": attacks.min_max_unsampled(own, spied)["w"].numpy().astype(np.float32)}
    sent = [*honest[1:], attack]
    public = screen_devices(ref, sent, ["w"], key=0)
    secret = screen_devices(ref, sent, ["w"], key=round_key(12345, 3))
    robust = RobustConfig()
    assert [screen_problem(public[i], robust) for i in range(7)] == [None] * 7, public
    assert [screen_problem(secret[i], robust) is None for i in range(7)] == [True] * 6 + [False], secret
    assert "rises on a share of coordinates" in screen_problem(secret[6], robust)


def test_alie_large_poisons_the_largest_tensors_holding_most_values_and_leaves_the_rest_honest():
    rng = np.random.default_rng(1)
    shapes = {"big": BIG, "mid": 9_000, **{f"small{i}": 64 for i in range(10)}}
    honest = [{k: torch.from_numpy(v.astype(np.float64)) for k, v in u.items()} for u in honest_updates(rng, 7, shapes)]
    assert attacks.largest(honest[0]) == ["big"]  # 40,000 of 49,640 values: past 80% alone
    assert attacks.largest(honest[0], share=0.9) == ["big", "mid"]
    out, alie = attacks.alie_large(honest[0], honest[1:]), attacks.alie(honest[0], honest[1:])
    assert torch.equal(out["big"], alie["big"]) and not torch.equal(out["big"], honest[0]["big"])
    assert all(torch.equal(out[n], honest[0][n]) for n in shapes if n != "big")


def test_the_judged_coordinates_change_every_round_and_with_the_secret():
    size = 1_000_000  # two random samples of 4,096 share about 17 coordinates
    a, b, c = (sample_coordinates(size, round_key(s, r)) for s, r in ((7, 1), (7, 2), (8, 1)))
    assert len(np.intersect1d(a, b)) < 0.02 * len(a) and len(np.intersect1d(a, c)) < 0.02 * len(a)
    assert np.array_equal(a, sample_coordinates(size, round_key(7, 1)))  # a round judges on one sample
    assert np.array_equal(sample_coordinates(100, round_key(7, 1)), np.arange(100))  # a small tensor: all


def test_a_simulation_repeats_its_secret_and_a_deployment_draws_one_from_the_os():
    cfg = load_fleet_config("simulations/fleet-tiny.yaml", {})
    assert screen_secret(cfg, simulated=True) == screen_secret(cfg, simulated=True)
    other = load_fleet_config("simulations/fleet-tiny.yaml", {"train.seed": cfg.train.seed + 1})
    assert screen_secret(other, simulated=True) != screen_secret(cfg, simulated=True)
    assert screen_secret(cfg, simulated=False) != screen_secret(cfg, simulated=False)

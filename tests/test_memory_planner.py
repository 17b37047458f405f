"""The memory planner on synthetic chains: exactness, feasibility, messages."""

from __future__ import annotations

import itertools
import math
import pickle
import random
import re
import time

import pytest
import yaml

from fleet.base.errors import BudgetError, ConfigError
from fleet.memory.planner import (
    FROZEN,
    KEEP,
    MB,
    PAGE,
    RECOMPUTE,
    BudgetValueError,
    InfeasibleBudgetError,
    MemoryPlan,
    evaluate_plan,
    min_feasible_budget,
    plan_memory,
    resolve_budget,
)
from fleet.memory.records import BlockCost, MemoryProfile, SavedItem, StorageProfile


def storage(write_bps=2e9, read_bps=1e9, watts=None) -> StorageProfile:
    return StorageProfile("/tmp", False, 1e-4, write_bps, 1e-4, read_bps, storage_watts=watts)


def chain(n: int, seed: int, *, page_min=1000, lingering=True) -> MemoryProfile:
    """A random chain shaped like a CNN: boundary storages shared by neighbours,
    interior storages, small stats, an in-place block, inputs referenced longer."""
    rng = random.Random(seed)
    blocks = [
        BlockCost(
            name=f"b{k}",
            kind="Block",
            forward_s=rng.uniform(0.001, 0.02),
            backward_s=rng.uniform(0.002, 0.04),
            params=rng.choice([0, 100]),
            can_recompute=rng.random() > 0.2,
        )
        for k in range(n)
    ]
    items = []
    for k in range(n):
        size = rng.choice([2000, 4000, 8000, 16000])
        if k > 0:  # the boundary storage between k-1 and k
            savers = sorted({k} | ({k - 1} if rng.random() < 0.5 else set()))
            until = k + rng.choice([0, 0, 1, 2]) if lingering else k
            items.append(SavedItem(size, savers, [k], alive_until=min(until, n - 1)))
        for _ in range(rng.randint(0, 3)):
            items.append(SavedItem(rng.choice([200, 3000, 6000, 12000]), [k], []))
    return MemoryProfile(
        model="toy",
        input_shape=[4, 3, 8, 8],
        blocks=blocks,
        items=items,
        pinned_bytes=100,
        measured_peak_bytes=0,
        step_s=0.1,
        page_min_bytes=page_min,
        storage=storage(),
    )


def all_plans(profile: MemoryProfile, frozen_below: int = 0) -> list[tuple[int, float]]:
    """(peak, added time) of every action list."""
    options = []
    for k, b in enumerate(profile.blocks):
        if k < frozen_below:
            options.append([FROZEN])
        else:
            options.append([KEEP, PAGE] + ([RECOMPUTE] if b.can_recompute else []))
    out = []
    for acts in itertools.product(*options):
        ev = evaluate_plan(profile, list(acts), frozen_below=frozen_below)
        out.append((ev["peak_bytes"], ev["recompute_s"] + ev["io_s"]))
    return out


def cheapest(plans: list[tuple[int, float]], budget: float) -> float:
    return min((cost for peak, cost in plans if peak <= budget), default=math.inf)


@pytest.mark.parametrize("seed", range(12))
def test_dp_matches_brute_force(seed):
    profile = chain(6, seed)
    full = evaluate_plan(profile, [KEEP] * 6)["peak_bytes"]
    assert full == profile.model_peak_bytes
    smallest = min_feasible_budget(profile)
    plans = all_plans(profile)
    assert smallest == min(peak for peak, _ in plans)
    for frac in (0.9, 0.6, 0.4):
        budget = max(int(frac * full), smallest)
        cost = cheapest(plans, budget)
        plan = plan_memory(profile, budget, overlap=True)
        assert plan.actions == plan_memory(profile, budget).actions
        assert not any(plan_memory(profile, budget).overlap)
        bare = evaluate_plan(profile, plan.actions)
        assert bare["peak_bytes"] <= budget
        assert bare["recompute_s"] + bare["io_s"] == pytest.approx(cost, rel=1e-9, abs=1e-12)
        # overlap is only switched on where the extra prefetch/pending bytes still fit
        assert plan.predicted_peak_bytes <= budget
        with_overlap = evaluate_plan(profile, plan.actions, overlap=plan.overlap)
        assert with_overlap["peak_bytes"] == plan.predicted_peak_bytes


@pytest.mark.parametrize("seed", range(6))
def test_dp_matches_brute_force_with_frozen_blocks(seed):
    profile = chain(6, 100 + seed)
    fb = 2
    smallest = min_feasible_budget(profile, frozen_below=fb)
    plans = all_plans(profile, frozen_below=fb)
    assert smallest == min(peak for peak, _ in plans)
    cost = cheapest(plans, smallest)
    plan = plan_memory(profile, smallest, frozen_below=fb)
    assert plan.actions[:fb] == [FROZEN] * fb
    ev = evaluate_plan(profile, plan.actions, frozen_below=fb)
    assert ev["recompute_s"] + ev["io_s"] == pytest.approx(cost, rel=1e-9, abs=1e-12)


def test_infeasible_budget_names_the_smallest_feasible_one():
    profile = chain(8, 3)
    smallest = min_feasible_budget(profile)
    with pytest.raises(InfeasibleBudgetError) as err:
        plan_memory(profile, smallest - 1)
    assert isinstance(err.value, BudgetError)
    msg = str(err.value)
    assert "\n" not in msg and "--" not in msg  # the solver names quantities, not flags
    assert msg.startswith("memory budget ") and "is infeasible for toy at batch 4" in msg
    m = re.search(r"smallest feasible budget is ([0-9.]+) MB \(([0-9.]+) of the unconstrained", msg)
    assert m
    suggested = float(m.group(1))
    assert suggested * MB >= smallest  # rounded up, so the suggestion works
    plan_memory(profile, resolve_budget(profile, budget_mb=suggested))
    plan_memory(profile, resolve_budget(profile, budget_fraction=float(m.group(2))))


def test_infeasible_budget_named_by_the_caller():
    profile = chain(8, 3)
    with pytest.raises(InfeasibleBudgetError) as err:
        plan_memory(profile, min_feasible_budget(profile) - 1)
    neutral = str(err.value)
    both = str(err.value.named("--budget-mb", "--budget-fraction"))
    m = re.search(
        r"smallest feasible budget is ([0-9.]+) MB \(--budget-mb ([0-9.]+), or --budget-fraction ([0-9.]+)", both
    )
    assert m and m.group(1) == m.group(2)
    assert both.split("; ")[0] == neutral.split("; ")[0]
    assert f"(memory-budget-mb {m.group(1)}, {m.group(3)} of the unconstrained" in str(
        err.value.named("memory-budget-mb")
    )
    only_fraction = str(err.value.named(None, "--budget-fraction"))
    assert (
        f"(--budget-fraction {m.group(3)} of the unconstrained" in only_fraction
        and "MB (--budget-mb" not in only_fraction
    )
    again = pickle.loads(pickle.dumps(err.value.named("memory-budget-mb")))  # crosses process boundaries
    assert str(again) == str(err.value.named("memory-budget-mb"))


def test_real_scale_message():
    profile = chain(8, 3)
    with pytest.raises(BudgetError, match=r"memory budget 1e-05 MB is infeasible"):
        plan_memory(profile, 10)


def test_frozen_blocks_lower_the_peak_and_the_cost():
    profile = chain(10, 7, lingering=False)
    full = evaluate_plan(profile, [KEEP] * 10)["peak_bytes"]
    fb = 5
    frozen = evaluate_plan(profile, [FROZEN] * fb + [KEEP] * 5, frozen_below=fb)["peak_bytes"]
    assert frozen < full
    assert min_feasible_budget(profile, frozen_below=fb) <= min_feasible_budget(profile)
    budget = int(0.5 * full)
    a = plan_memory(profile, budget)
    b = plan_memory(profile, budget, frozen_below=fb)
    assert b.predicted_peak_bytes <= budget and b.added_time_s <= a.added_time_s
    if frozen <= budget:
        assert b.added_time_s == 0 and set(b.actions[fb:]) == {KEEP}


def test_without_storage_only_keep_and_recompute():
    profile = chain(8, 11)
    profile.storage = None
    for b in profile.blocks:
        b.can_recompute = True
    budget = min_feasible_budget(profile)
    plan = plan_memory(profile, budget)
    assert PAGE not in plan.actions and plan.predicted_peak_bytes <= budget


def test_energy_objective_needs_power_and_trades_differently():
    profile = chain(8, 5)
    for b in profile.blocks:
        b.can_recompute = True
    budget = int(0.5 * profile.model_peak_bytes)
    with pytest.raises(ConfigError, match="objective: 'energy' needs power figures"):
        plan_memory(profile, max(budget, min_feasible_budget(profile)), objective="energy")
    budget = max(budget, min_feasible_budget(profile))
    cheap_io = plan_memory(profile, budget, objective="energy", compute_watts=5.0, storage_watts=0.001)
    dear_io = plan_memory(profile, budget, objective="energy", compute_watts=0.001, storage_watts=50.0)
    assert cheap_io.added_energy_j is not None and dear_io.added_energy_j is not None
    assert cheap_io.count(PAGE) >= dear_io.count(PAGE)
    assert cheap_io.count(RECOMPUTE) <= dear_io.count(RECOMPUTE)


def test_resolve_budget():
    profile = chain(4, 1)
    profile.measured_peak_bytes = 10_000_000
    assert resolve_budget(profile, budget_mb=2.5) == 2_500_000
    assert resolve_budget(profile, budget_fraction=0.3) == 3_000_000
    with pytest.raises(ConfigError, match="exactly one"):
        resolve_budget(profile)
    with pytest.raises(ConfigError, match="exactly one"):
        resolve_budget(profile, budget_mb=1, budget_fraction=0.5)
    with pytest.raises(ConfigError, match=r"budget_fraction: got -0.5; use a positive fraction, e\.g\. 0\.5$"):
        resolve_budget(profile, budget_fraction=-0.5)
    with pytest.raises(BudgetValueError, match=r"budget_mb: got 0; use a positive number of MB, e\.g\. 20$") as err:
        resolve_budget(profile, budget_mb=0)
    assert err.value.field == "budget_mb"
    assert str(err.value.named("--budget-mb")) == "budget_mb: got 0; use a positive number of MB, e.g. --budget-mb 20"
    assert str(pickle.loads(pickle.dumps(err.value))) == str(err.value)
    with pytest.raises(ConfigError, match="frozen_below: got 9"):
        plan_memory(profile, 10**9, frozen_below=9)
    with pytest.raises(ConfigError, match="objective: got 'speed'"):
        plan_memory(profile, 10**9, objective="speed")


def test_profile_and_plan_round_trip_through_yaml():
    profile = chain(6, 2)
    again = MemoryProfile.from_dict(yaml.safe_load(yaml.safe_dump(profile.to_dict())))
    assert again == profile
    plan = plan_memory(profile, min_feasible_budget(profile))
    text = yaml.safe_dump(plan.to_dict())
    assert len(text) < 2000
    assert MemoryPlan.from_dict(yaml.safe_load(text)) == plan


def test_solves_a_per_layer_sized_chain_quickly():
    profile = chain(160, 9)
    smallest = min_feasible_budget(profile)
    start = time.perf_counter()
    plan = plan_memory(profile, int(smallest * 1.3))
    assert time.perf_counter() - start < 10
    assert plan.predicted_peak_bytes <= int(smallest * 1.3)

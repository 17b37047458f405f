"""Memory budgets on the device: plan keep / recompute / page per block and run the plan.

* :func:`measure_block_costs` (:mod:`~fleet.memory.measure`), :func:`measure_storage`
  (:mod:`~fleet.memory.storage`) -> :class:`MemoryProfile`, :class:`StorageProfile`
  (:mod:`~fleet.memory.records`)
* :func:`plan_memory` -> :class:`MemoryPlan` (pure; raises :class:`InfeasibleBudgetError`
  with the smallest feasible budget)
* :func:`apply_plan` -> context manager that makes ``loss.backward()`` steps follow a plan
"""

from fleet.memory.executor import PlanRunner, apply_plan, first_trainable_block
from fleet.memory.measure import measure_block_costs
from fleet.memory.planner import (
    BudgetValueError,
    InfeasibleBudgetError,
    MemoryPlan,
    evaluate_plan,
    min_feasible_budget,
    plan_memory,
    resolve_budget,
)
from fleet.memory.records import BlockCost, MemoryProfile, SavedItem, StorageProfile
from fleet.memory.segment import segment_model
from fleet.memory.storage import measure_storage

__all__ = [
    "BlockCost",
    "BudgetValueError",
    "InfeasibleBudgetError",
    "MemoryPlan",
    "MemoryProfile",
    "PlanRunner",
    "SavedItem",
    "StorageProfile",
    "apply_plan",
    "evaluate_plan",
    "first_trainable_block",
    "measure_block_costs",
    "measure_storage",
    "min_feasible_budget",
    "plan_memory",
    "resolve_budget",
    "segment_model",
]

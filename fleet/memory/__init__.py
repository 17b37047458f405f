"""Memory budgets on the device: plan keep / recompute / page per block and run the plan.

* :func:`measure_block_costs`, :func:`measure_storage` -> :class:`MemoryProfile`, :class:`StorageProfile`
* :func:`plan_memory` -> :class:`MemoryPlan` (pure; raises BudgetError with the smallest feasible budget)
* :func:`apply_plan` -> context manager that makes ``loss.backward()`` steps follow a plan
"""

from fleet.memory.costs import (
    BlockCost,
    MemoryProfile,
    SavedItem,
    StorageProfile,
    measure_block_costs,
    measure_storage,
)
from fleet.memory.executor import PlanRunner, apply_plan, first_trainable_block
from fleet.memory.planner import (
    MemoryPlan,
    evaluate_plan,
    min_feasible_budget,
    plan_memory,
    resolve_budget,
)
from fleet.memory.segment import segment_model

__all__ = [
    "BlockCost",
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

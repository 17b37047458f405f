"""A memory budget attached to training: one plan per elastic selection.

Elastic selection changes what autograd stores (nothing below the input-most
trained tensor), so the cheapest plan changes with it. Plans are cached by
``frozen_below`` and re-solved only when a re-selection moves it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

from torch import nn

from fleet.memory.costs import MemoryProfile, measure_block_costs, measure_storage
from fleet.memory.executor import PlanRunner, apply_plan, first_trainable_block
from fleet.memory.planner import MB, MemoryPlan, plan_memory


@dataclass
class MemoryBudget:
    """Plans for ``model`` under ``budget_bytes``, made and cached as the selection changes."""

    profile: MemoryProfile
    budget_bytes: int
    spill_dir: str
    objective: str = "time"
    plans: dict[int, MemoryPlan] = field(default_factory=dict)
    _runners: dict[int, PlanRunner] = field(default_factory=dict)

    @classmethod
    def measure(
        cls, model: nn.Module, input_shape: tuple[int, ...], budget_mb: float, spill_dir: str | None = None,
        *, model_name: str | None = None,
    ) -> MemoryBudget:
        """Profile activation memory of one step and the storage behind ``spill_dir``."""
        spill = spill_dir or os.path.join(tempfile.gettempdir(), "fleet-spill")
        storage = measure_storage(spill)
        profile = measure_block_costs(model, input_shape, model_name=model_name, storage=storage)
        return cls(profile, int(budget_mb * MB), spill)

    def plan_for(self, model: nn.Module) -> MemoryPlan:
        """The plan for the current ``requires_grad`` flags (raises BudgetError if none fits)."""
        fb = first_trainable_block(model, [b.name for b in self.profile.blocks])
        if fb not in self.plans:
            self.plans[fb] = plan_memory(self.profile, self.budget_bytes, objective=self.objective, frozen_below=fb)
        return self.plans[fb]

    def runner(self, model: nn.Module) -> PlanRunner:
        """A context for one training step that follows the current plan."""
        plan = self.plan_for(model)
        if plan.frozen_below not in self._runners:
            self._runners[plan.frozen_below] = apply_plan(model, plan, self.spill_dir)
        return self._runners[plan.frozen_below]

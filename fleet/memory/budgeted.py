"""A memory budget attached to training: one plan per elastic selection.

Elastic selection changes what autograd stores (nothing below the input-most
trained tensor), so the cheapest plan changes with it. Plans are cached by
``frozen_below`` and re-solved only when a re-selection moves it.

On a CUDA GPU the profile is measured there: block times on the GPU, paging
priced by pinned-host copies (:func:`fleet.memory.storage.measure_paging`),
and the steps page to pinned host memory and count GPU memory.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from fleet.base.atomic import write_text_atomic
from fleet.base.errors import FleetError
from fleet.memory.executor import PlanRunner, apply_plan, first_trainable_block
from fleet.memory.measure import measure_block_costs
from fleet.memory.planner import MB, InfeasibleBudgetError, MemoryPlan, plan_memory
from fleet.memory.records import MemoryProfile
from fleet.memory.storage import measure_paging


@dataclass
class MemoryBudget:
    """Plans for ``model`` under ``budget_bytes``, made and cached as the selection changes."""

    profile: MemoryProfile
    budget_bytes: int
    spill_dir: str
    objective: str = "time"
    flag: str = "--memory-budget-mb"  # the user's name for the budget (CLI flag or config key), shown in errors
    plans: dict[int, MemoryPlan] = field(default_factory=dict)
    _runners: dict[int, PlanRunner] = field(default_factory=dict)

    @classmethod
    def measure(
        cls,
        model: nn.Module,
        input_shape: tuple[int, ...],
        budget_mb: float,
        spill_dir: str | None = None,
        *,
        model_name: str | None = None,
        cache: Path | None = None,
        flag: str = "--memory-budget-mb",
        device: torch.device | None = None,
    ) -> MemoryBudget:
        """Profile activation memory of one step and the storage behind ``spill_dir``.

        ``cache``: a JSON file holding an earlier measurement of the same model,
        input shape and thread count on this device, reused instead of measuring
        again (a deployed device starts a new process for every round).
        ``flag``: the user's name for the budget (a CLI flag or a config key), which
        an infeasible budget's error suggests a value for. ``device``: where training
        runs; a CUDA model is moved there first (training moves it there anyway), and
        a profile cached for the other kind of device is measured again."""
        spill = spill_dir or os.path.join(tempfile.gettempdir(), "fleet-spill")
        name = model_name or type(model).__name__
        device = torch.device("cpu") if device is None else torch.device(device)
        if device.type != "cpu":
            model.to(device)
        profile = _cached(cache, name, list(input_shape), device)
        if profile is None:
            storage = measure_paging(device, spill)
            profile = measure_block_costs(model, input_shape, model_name=model_name, storage=storage)
            if cache is not None:
                write_text_atomic(cache, json.dumps(profile.to_dict()))
        return cls(profile, int(budget_mb * MB), spill, flag=flag)

    def plan_for(self, model: nn.Module) -> MemoryPlan:
        """The plan for the current ``requires_grad`` flags (raises BudgetError naming ``flag`` if none fits)."""
        fb = first_trainable_block(model, [b.name for b in self.profile.blocks])
        if fb not in self.plans:
            try:
                self.plans[fb] = plan_memory(self.profile, self.budget_bytes, objective=self.objective, frozen_below=fb)
            except InfeasibleBudgetError as exc:
                raise exc.named(self.flag) from None
        return self.plans[fb]

    @property
    def peak_bytes(self) -> int:
        """The largest activation peak measured in steps run under these plans."""
        return max((r.peak_bytes or 0 for r in self._runners.values()), default=0)

    def added_time_s(self, model: nn.Module) -> float:
        """Predicted seconds the current selection's plan adds to a step (recompute, paging)."""
        return self.plan_for(model).added_time_s

    def runner(self, model: nn.Module) -> PlanRunner:
        """A context for one training step that follows the current plan."""
        plan = self.plan_for(model)
        if plan.frozen_below not in self._runners:
            self._runners[plan.frozen_below] = apply_plan(model, plan, self.spill_dir)
        return self._runners[plan.frozen_below]


def _on_gpu(profile: MemoryProfile) -> bool:
    """Whether ``profile`` was measured on a CUDA GPU: its paging was priced by pinned-host copies."""
    return profile.storage is not None and profile.storage.source == "pinned-host"


def _cached(
    path: Path | None, model_name: str, input_shape: list[int], device: torch.device | None = None
) -> MemoryProfile | None:
    """The cached profile if it was measured for this model, shape, thread count and kind of device."""
    if path is None or not Path(path).is_file():
        return None
    try:
        profile = MemoryProfile.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, FleetError):
        return None  # unreadable or from another version: measure again
    if (
        profile.model != model_name
        or list(profile.input_shape) != input_shape
        or profile.threads != torch.get_num_threads()
        or _on_gpu(profile) != (device is not None and device.type == "cuda")
    ):
        return None
    return profile

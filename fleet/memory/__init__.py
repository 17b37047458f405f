"""Memory budgets on the device: plan keep / recompute / page per block and run the plan.

* :func:`measure_block_costs` (:mod:`~fleet.memory.measure`), :func:`measure_storage`
  (:mod:`~fleet.memory.storage`) -> :class:`MemoryProfile`, :class:`StorageProfile`
  (:mod:`~fleet.memory.records`)
* :func:`plan_memory` -> :class:`MemoryPlan` (pure; raises :class:`InfeasibleBudgetError`
  with the smallest feasible budget)
* :func:`apply_plan` -> context manager that makes ``loss.backward()`` steps follow a plan
"""

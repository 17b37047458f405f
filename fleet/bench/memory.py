"""``fleet bench memory``: plan a memory budget, run it, and measure what it costs.

One call of :func:`run_memory_bench` profiles the model (blocks and spill
storage), plans for ``budget_fraction`` of the unconstrained activation peak,
then times training steps (zero_grad, forward, cross-entropy, backward; no
optimizer update) with and without the plan, interleaved (the order flips
every repeat) so drift on a shared machine hits both alike. It reports:

* ``unconstrained_peak_bytes``: activation peak of an unplanned step;
* ``budget_bytes``, ``predicted_peak_bytes`` (planner's model) and
  ``measured_peak_bytes``: the largest activation peak of planned steps run
  with :class:`~fleet.memory.meter.StorageMeter` (saved tensors, checkpoint
  inputs, recomputed and paged-in copies, while alive); the timed steps run
  without the meter;
* ``time_overhead``: median over repeats of planned / unplanned wall-clock
  step time, minus 1, with its interquartile range (and the median step
  times); ``cpu_time_overhead`` the
  same with the process's CPU time (all threads, I/O threads included),
  which is steadier when other jobs share the cores;
* ``process_hwm_bytes``: the process's RSS high-water mark (VmHWM), which
  includes weights, gradients, allocator caches and the profiling steps.

With ``rho`` it also runs the same budget with elastic selection: blocks below
the input-most trained one are frozen (``requires_grad=False``), chosen as the
input-most block such that training everything from it to the output fits
``rho`` of the full step by the profile's block times (ElasticTrainer picks a
subset above that block; the memory saved depends only on where it starts).
The overhead there is against an unplanned step with the same blocks frozen.

With ``device`` a CUDA GPU, the model and batch live there, paging is priced by
pinned-host copies and pages to pinned host memory, the measured peaks are the
activations' GPU memory (the budgeted quantity, as on the CPU), the allocator's
whole-step peaks are reported beside them (``measured_allocator_peak_bytes``,
``measured_unplanned_allocator_peak_bytes``: gradients and workspaces too), and
every timed step ends with a synchronize (so the host clock reads finished
work); the result names the device.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from fleet.base.errors import ConfigError
from fleet.engine.models import build_model
from fleet.memory.executor import apply_plan
from fleet.memory.measure import measure_block_costs
from fleet.memory.planner import MB, MemoryPlan, plan_memory, resolve_budget
from fleet.memory.records import MemoryProfile, StorageProfile
from fleet.memory.storage import measure_paging

# The allocator's whole-step peaks of the planned and the unplanned step, reported on CUDA beside the budgeted
# activation peaks (gradients and workspaces too).
ALLOCATOR_KEYS = ("measured_allocator_peak_bytes", "measured_unplanned_allocator_peak_bytes")


def bench_model(name: str, num_classes: int = 10, *, in_channels: int = 3, small_input: bool = False) -> nn.Module:
    """The zoo model (:func:`fleet.engine.models.build_model`, untrained) that ``fleet bench memory``
    and ``fleet plan-memory`` profile."""
    return build_model(name, num_classes, in_channels=in_channels, small_input=small_input)


def frozen_below_for_rho(profile: MemoryProfile, rho: float) -> int:
    """Input-most block k such that forward + backward of blocks >= k fits ``rho`` of a full step."""
    if not (isinstance(rho, (int, float)) and 0 < rho <= 1):
        raise ConfigError(f"rho: got {rho!r}; use a time fraction in (0, 1], e.g. --rho 0.5")
    fwd = sum(b.forward_s for b in profile.blocks)
    full = fwd + sum(b.backward_s for b in profile.blocks)
    with_params = [k for k, b in enumerate(profile.blocks) if b.params > 0]
    for k in with_params:
        if fwd + sum(b.backward_s for b in profile.blocks[k:]) <= rho * full:
            return k
    return with_params[-1] if with_params else len(profile.blocks)


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad(set_to_none=False)  # gradient buffers stay allocated in both variants
    F.cross_entropy(model(x), y).backward()
    if x.is_cuda:  # the kernels are queued: the step is done when they are
        torch.cuda.synchronize(x.device)


def _rss_hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of all this process's threads)."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def compare_steps(model, plan, x, y, spill_dir, *, repeats: int, sync: bool = False) -> dict:
    """Interleaved timing of unplanned and planned steps, then the measured activation peaks.

    Timed steps run without the meter (instrumentation is not the plan's cost);
    the peaks come from extra steps with it."""
    timed = apply_plan(model, plan, spill_dir, sync=sync, track=False)  # entered once per step

    def planned() -> None:
        with timed:
            _step(model, x, y)

    def unplanned() -> None:
        _step(model, x, y)

    unplanned()
    planned()  # warm-up
    t_plain, t_plan, ratios, cpu_ratios = [], [], [], []
    for r in range(repeats):
        if r % 2 == 0:
            a = _timed(unplanned)
            b = _timed(planned)
        else:
            b = _timed(planned)
            a = _timed(unplanned)
        t_plain.append(a[0])
        t_plan.append(b[0])
        ratios.append(b[0] / a[0])
        cpu_ratios.append(b[1] / a[1] if a[1] > 0 else float("nan"))
    measured = apply_plan(model, plan, spill_dir, sync=sync)
    peaks, allocator_peaks = [], []
    for _ in range(2):
        with measured:
            _step(model, x, y)
        peaks.append(measured.peak_bytes)
        allocator_peaks.append(measured.allocator_peak_bytes)
    with apply_plan(model, None) as run:
        _step(model, x, y)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    on_gpu = {}
    if run.allocator_peak_bytes is not None:  # on CUDA: the whole step's GPU memory, reported beside
        on_gpu = dict(zip(ALLOCATOR_KEYS, (max(allocator_peaks), run.allocator_peak_bytes)))
    return {
        **on_gpu,
        "measured_peak_bytes": max(peaks),
        "measured_unplanned_peak_bytes": run.peak_bytes,
        "time_overhead": statistics.median(ratios) - 1.0,
        "time_overhead_iqr": [quartiles[0] - 1.0, quartiles[2] - 1.0],
        "cpu_time_overhead": statistics.median(cpu_ratios) - 1.0,
        "planned_step_s": statistics.median(t_plan),
        "unplanned_step_s": statistics.median(t_plain),
        "repeats": repeats,
    }


def _check_args(repeats: int, batch_size: int, input_size: int) -> None:
    if repeats < 1:
        raise ConfigError(f"repeats: got {repeats}; use 1 or more")
    for field, value in (("batch_size", batch_size), ("input_size", input_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{field}: got {value!r}; use a positive integer")


@contextlib.contextmanager
def _spill_dir(spill_dir: str | os.PathLike | None) -> Iterator[str]:
    """``spill_dir``, or a temporary directory removed afterwards."""
    if spill_dir is not None:
        yield os.fspath(spill_dir)
        return
    spill = tempfile.mkdtemp(prefix="fleet-bench-")
    try:
        yield spill
    finally:
        shutil.rmtree(spill, ignore_errors=True)


@contextlib.contextmanager
def _frozen_below(model: nn.Module, names: list[str], fb: int) -> Iterator[None]:
    """Blocks ``names[:fb]`` frozen (``requires_grad=False``) inside the context."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for k in range(fb):
            m = model.get_submodule(names[k]) if names[k] else model
            for p in m.parameters():
                p.requires_grad_(False)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def _planned_run(plan: MemoryPlan, run: dict, budget: int) -> dict:
    """What a benchmark row reports about one plan and its steps."""
    return {
        "budget_bytes": budget,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "measured_peak_bytes": run["measured_peak_bytes"],
        "within_budget": run["measured_peak_bytes"] <= budget,
        **{k: run[k] for k in ALLOCATOR_KEYS if k in run},  # on CUDA only
        "time_overhead": run["time_overhead"],
        "time_overhead_iqr": run["time_overhead_iqr"],
        "cpu_time_overhead": run["cpu_time_overhead"],
        "planned_step_s": run["planned_step_s"],
        "unplanned_step_s": run["unplanned_step_s"],
        "predicted_added_s": plan.added_time_s,
        "plan": plan.summary(),
    }


def _storage_summary(storage: StorageProfile, probe: StorageProfile) -> dict:
    return {
        "write_MBps": storage.write_bytes_per_s / MB,
        "read_MBps": storage.read_bytes_per_s / MB,
        "write_latency_s": storage.write_latency_s,
        "read_latency_s": storage.read_latency_s,
        "source": storage.source,
        "probe_write_MBps": probe.write_bytes_per_s / MB,
        "probe_read_MBps": probe.read_bytes_per_s / MB,
    }


def _elastic(model, profile, budget, x, y, spill, *, rho, repeats, objective, sync, overlap) -> dict:
    """The same budget with the blocks below ``frozen_below_for_rho`` frozen, against
    an unplanned step with the same blocks frozen."""
    fb = frozen_below_for_rho(profile, rho)
    names = [b.name for b in profile.blocks]
    with _frozen_below(model, names, fb):
        plan = plan_memory(profile, budget, objective=objective, frozen_below=fb, overlap=overlap)
        run = compare_steps(model, plan, x, y, spill, repeats=repeats, sync=sync)
    out = {
        "rho": rho,
        "frozen_below": fb,
        "first_trained_block": names[fb] if fb < len(names) else None,
        "unconstrained_peak_bytes": run["measured_unplanned_peak_bytes"],
    }
    out.update(_planned_run(plan, run, budget))
    return out


def run_memory_bench(
    model_name: str,
    budget_fraction: float,
    batch_size: int = 32,
    input_size: int = 32,
    *,
    repeats: int = 15,
    profile_repeats: int = 5,
    rho: float | None = None,
    spill_dir: str | os.PathLike | None = None,
    num_classes: int = 10,
    in_channels: int = 3,
    small_input: bool = False,
    objective: str = "time",
    sync: bool = False,
    overlap: bool = False,
    seed: int = 0,
    device: torch.device | None = None,
) -> dict:
    """Profile, plan for ``budget_fraction`` of the unconstrained peak, run and measure (on ``device``:
    the CPU by default)."""
    _check_args(repeats, batch_size, input_size)
    torch.manual_seed(seed)
    device = torch.device("cpu") if device is None else torch.device(device)
    model = bench_model(model_name, num_classes, in_channels=in_channels, small_input=small_input)
    if device.type != "cpu":
        model.to(device)
    shape = (batch_size, in_channels, input_size, input_size)
    with _spill_dir(spill_dir) as spill:
        probe = measure_paging(device, spill, sync=sync)
        t0 = time.perf_counter()
        profile = measure_block_costs(
            model, shape, model_name=model_name, storage=probe, seed=seed, repeats=profile_repeats
        )
        profile_s = time.perf_counter() - t0
        budget = resolve_budget(profile, budget_fraction=budget_fraction)
        plan = plan_memory(profile, budget, objective=objective, overlap=overlap)
        gen = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(shape, generator=gen)
        y = torch.randint(0, num_classes, (batch_size,), generator=gen)
        if device.type != "cpu":
            x, y = x.to(device), y.to(device)
        run = compare_steps(model, plan, x, y, spill, repeats=repeats, sync=sync)
        out = {
            "model": model_name,
            "batch_size": batch_size,
            "input_size": input_size,
            "budget_fraction": budget_fraction,
            "unconstrained_peak_bytes": profile.unconstrained_peak_bytes,
            **_planned_run(plan, run, budget),
            "actions": dict(zip(plan.blocks, plan.actions)),
            "solve_time_s": plan.solve_time_s,
            "profile_s": profile_s,
            "repeats": repeats,
            "threads": torch.get_num_threads(),
            "spill_sync": sync,
            "overlap": overlap,
            "storage": _storage_summary(profile.storage, probe),
        }
        if device.type != "cpu":  # CPU results keep their keys
            out["device"] = device.type
        if rho is not None:
            out["elastic"] = _elastic(
                model,
                profile,
                budget,
                x,
                y,
                spill,
                rho=rho,
                repeats=repeats,
                objective=objective,
                sync=sync,
                overlap=overlap,
            )
            out["time_overhead_full"] = out["time_overhead"]
            out["time_overhead_elastic"] = out["elastic"]["time_overhead"]
        out["process_hwm_bytes"] = _rss_hwm()
        return out

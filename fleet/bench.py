"""Timing benchmarks: the timing model against the clock, and elastic speedup.

Every variant is measured interleaved with the others in one run (step by
step, round-robin), repeated, and summarized by medians, because a shared
machine can slow down by 2x for seconds at a time.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from fleet.device_profile import DeviceProfile
from fleet.importance import evaluate_importance
from fleet.models import build_model
from fleet.profiler import profile_device, tensor_order
from fleet.selection import select_tensors
from fleet.trainer import TrainerOptions, make_optimizer


class StepBench:
    """A model, its optimizer and one fixed batch: time steps that train a given mask."""

    def __init__(self, model: nn.Module, batch_size: int, input_size: int, num_classes: int, seed: int = 0):
        self.model = model.train()
        in_channels = next(m for m in model.modules() if isinstance(m, nn.Conv2d)).in_channels
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(batch_size, in_channels, input_size, input_size, generator=gen)
        self.y = torch.randint(0, num_classes, (batch_size,), generator=gen)
        order = tensor_order(model, self.x)
        self.names = [n for n, _, _ in order]
        self.params = [p for _, _, p in order]
        self.optimizer = make_optimizer(self.params, TrainerOptions())

    def step(self, mask: Sequence[bool]) -> float:
        for p, m in zip(self.params, mask):
            p.requires_grad_(m)
            if not m:
                p.grad = None
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(self.model(self.x), self.y)
        if loss.requires_grad:
            loss.backward()
        self.optimizer.step()
        return time.perf_counter() - start

    def interleaved(self, masks: Sequence[Sequence[bool]], repeats: int, warmup: int = 2) -> list[float]:
        """Median step time of each mask, measured round-robin."""
        for _ in range(warmup):
            for m in masks:
                self.step(m)
        times: list[list[float]] = [[] for _ in masks]
        for _ in range(repeats):
            for i, m in enumerate(masks):
                times[i].append(self.step(m))
        return [statistics.median(t) for t in times]


def random_masks(n: int, count: int, seed: int = 0) -> list[list[bool]]:
    """Random selections: a random input-most tensor, then each later one with probability 1/2."""
    rng = random.Random(seed)
    masks = []
    for _ in range(count):
        kmin = rng.randrange(n)
        masks.append([k == kmin or (k > kmin and rng.random() < 0.5) for k in range(n)])
    return masks


def _model_from_profile(profile: DeviceProfile) -> nn.Module:
    m = profile.model
    torch.manual_seed(0)
    return build_model(m["name"], int(m["num_classes"]), in_channels=int(m["in_channels"]), small_input=bool(m["small_input"]))


def timing_bench(profile: DeviceProfile, *, selections: int = 10, repeats: int = 7, seed: int = 0) -> dict:
    """Predicted against measured step time for full training and random selections."""
    model = _model_from_profile(profile)
    bench = StepBench(model, profile.batch_size, profile.input_size, int(profile.model["num_classes"]), seed)
    profile.check_matches(
        bench.names, [list(p.shape) for p in bench.params], source="the profile"
    )
    masks = [[True] * len(bench.names)] + random_masks(len(bench.names), selections, seed)
    measured = bench.interleaved(masks, repeats)
    rows = []
    for mask, m in zip(masks, measured):
        predicted = profile.step_time(mask)
        rows.append(
            {
                "selected": sum(mask),
                "kmin": mask.index(True),
                "predicted_s": predicted,
                "measured_s": m,
                "relative_error": abs(predicted - m) / m,
            }
        )
    errors = [r["relative_error"] for r in rows]
    # The machine's speed drifts between the profiling run and this one (a shared host can vary
    # by 20% within a minute). Rescaling predictions by the full step measured in *this* run
    # isolates the timing model's error on the part the selector relies on: T(S) / T_full.
    drift = rows[0]["measured_s"] / rows[0]["predicted_s"]
    corrected = [abs(r["predicted_s"] * drift - r["measured_s"]) / r["measured_s"] for r in rows[1:]]
    return {
        "model": profile.model["name"],
        "batch_size": profile.batch_size,
        "input_size": profile.input_size,
        "threads": torch.get_num_threads(),
        "median_abs_relative_error": statistics.median(errors),
        "max_abs_relative_error": max(errors),
        "machine_drift": drift,
        "median_abs_relative_error_drift_corrected": statistics.median(corrected),
        "full": rows[0],
        "selections": rows[1:],
    }


def speedup_bench(
    profile: DeviceProfile, rho: float, *, repeats: int = 15, seed: int = 0
) -> dict:
    """Measured elastic/full step-time ratio at ``rho`` against the predicted one."""
    model = _model_from_profile(profile)
    bench = StepBench(model, profile.batch_size, profile.input_size, int(profile.model["num_classes"]), seed)
    importance = evaluate_importance(model, bench.params, bench.optimizer, bench.x, bench.y)
    mask = select_tensors(importance, profile.t_dw, profile.t_dy, profile.backward_budget(rho))
    full = [True] * len(mask)
    t_full, t_elastic = bench.interleaved([full, mask], repeats)
    return {
        "model": profile.model["name"],
        "batch_size": profile.batch_size,
        "input_size": profile.input_size,
        "threads": torch.get_num_threads(),
        "rho": rho,
        "selected": sum(mask),
        "tensors": len(mask),
        "predicted_time_fraction": profile.step_time(mask) / profile.full_step_time,
        "measured_time_fraction": t_elastic / t_full,
        "measured_full_step_s": t_full,
        "measured_elastic_step_s": t_elastic,
        "predicted_full_step_s": profile.full_step_time,
        "min_rho": profile.min_rho,
    }


def measure_profile(
    model_name: str, batch_size: int, input_size: int, *, num_classes: int = 10, in_channels: int = 3,
    small_input: bool = False, repeats: int = 7,
) -> DeviceProfile:
    torch.manual_seed(0)
    model = build_model(model_name, num_classes, in_channels=in_channels, small_input=small_input)
    meta = {"name": model_name, "num_classes": num_classes, "in_channels": in_channels, "small_input": small_input}
    opts = TrainerOptions()
    return profile_device(
        model, meta, batch_size=batch_size, input_size=input_size,
        make_optimizer=lambda ps: make_optimizer(ps, opts), repeats=repeats,
    )

"""``fleet bench speedup``: measured elastic step time over full step time at ``rho``."""

from __future__ import annotations

import torch

from fleet.bench.steps import bench_for_profile
from fleet.engine.accelerator import device_name
from fleet.engine.device_profile import DeviceProfile
from fleet.engine.importance import evaluate_importance
from fleet.engine.selection import select_tensors


def speedup_bench(
    profile: DeviceProfile, rho: float, *, repeats: int = 15, seed: int = 0, device: torch.device | None = None
) -> dict:
    """Measured elastic/full step-time ratio at ``rho`` against the predicted one, on ``device`` (the CPU
    when None) and in the profile's precision."""
    bench = bench_for_profile(profile, seed, device)
    model = bench.model
    importance = evaluate_importance(model, bench.params, bench.optimizer, bench.x, bench.y)
    mask = select_tensors(importance, profile.t_dw, profile.t_dy, profile.backward_budget(rho))
    full = [True] * len(mask)
    t_full, t_elastic = bench.interleaved([full, mask], repeats)
    return {
        "model": profile.model["name"],
        "batch_size": profile.batch_size,
        "input_size": profile.input_size,
        "threads": torch.get_num_threads(),
        "device": device_name(bench.device),  # what ran the steps: cpu, or cuda with the GPU's name
        "dtype": profile.dtype,
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

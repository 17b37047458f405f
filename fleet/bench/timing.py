"""``fleet bench timing``: the timing model's predicted step time against the clock."""

from __future__ import annotations

import random
import statistics

import torch

from fleet.bench.steps import bench_for_profile
from fleet.engine.accelerator import device_name
from fleet.engine.device_profile import DeviceProfile


def random_masks(n: int, count: int, seed: int = 0) -> list[list[bool]]:
    """Random selections: a random input-most tensor, then each later one with probability 1/2."""
    rng = random.Random(seed)
    masks = []
    for _ in range(count):
        kmin = rng.randrange(n)
        masks.append([k == kmin or (k > kmin and rng.random() < 0.5) for k in range(n)])
    return masks


def timing_bench(
    profile: DeviceProfile,
    *,
    selections: int = 10,
    repeats: int = 7,
    seed: int = 0,
    device: torch.device | None = None,
) -> dict:
    """Predicted against measured step time for full training and random selections, on ``device`` (the
    CPU when None) and in the profile's precision."""
    bench = bench_for_profile(profile, seed, device)
    profile.check_matches(bench.names, [list(p.shape) for p in bench.params], source="the profile")
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
        "device": device_name(bench.device),  # what ran the steps: cpu, or cuda with the GPU's name
        "dtype": profile.dtype,
        "median_abs_relative_error": statistics.median(errors),
        "max_abs_relative_error": max(errors),
        "machine_drift": drift,
        "median_abs_relative_error_drift_corrected": statistics.median(corrected),
        "full": rows[0],
        "selections": rows[1:],
    }

"""A device class calibrated from a real device's profile: the CPU quota at which this machine's full
training step takes as long as the real device's.

Design notes:

* **Measured, not assumed.** Each try runs ``fleet profile`` for the fleet's own model, batch and input
  size inside a fresh cgroup with the candidate quota, so the step includes everything a quota does to
  torch (its threads waiting out their period), not a ratio of core counts.
* **The search.** Below a core, a one-thread step's time is close to inversely proportional to its
  quota, so each try corrects the quota by the measured step over the target; it starts from this
  machine's unlimited step, and stops within :data:`TOLERANCE`. The search is a pure function of a
  ``measure`` callable (:func:`search_quota`), tested without cgroups.
* **One thread.** A calibrated device runs one torch thread: the quota stands in for the real board's
  speed, whatever its core count. A board faster than one core of this machine cannot be emulated here,
  and the testbed says so rather than printing a quota it cannot give.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from fleet.base.errors import FleetError
from fleet.engine.device_profile import DeviceProfile
from fleet.engine.experiment import check_profile, make_model
from fleet.federated.shared.paths import resolve_path
from fleet.testbed import cgroup
from fleet.testbed.config import TestbedFleetConfig

TOLERANCE = 0.10  # a calibrated class's measured full step is within 10% of its profile's
TRIES = 6  # quotas tried before the search gives up and says how close it came
MIN_CPU = 0.05  # the least quota a class may have (testbed.classes[].cpu's own floor)
REPEATS = 5  # profiling repeats per try; the profile keeps medians


def measure_full_step(config: Path, cpu: float | None, work: Path, repeats: int = REPEATS) -> float:
    """This machine's full step for ``config``'s model at ``cpu`` cores (None: no limit), one torch thread,
    measured by ``fleet profile`` in a cgroup of its own that is removed afterwards."""
    group = cgroup.Cgroup("calibrate", cpu, None).create()
    out = work / f"calibrate-{'free' if cpu is None else f'{cpu:.3f}'}.yaml"
    cmd = [sys.executable, "-m", "fleet.cli", "profile", "--config", str(config), "--threads", "1"]
    cmd += ["--repeats", str(repeats), "--out", str(out)]
    try:
        done = subprocess.run(group.join_command() + cmd, capture_output=True, text=True, timeout=900)
    finally:
        group.remove()
    if done.returncode != 0:
        raise FleetError(f"calibration: fleet profile failed at cpu {cpu}: {(done.stdout + done.stderr)[-400:]}")
    return DeviceProfile.load(out).full_step_time


def search_quota(
    measure: Callable[[float | None], float], target_s: float, what: str, tolerance: float = TOLERANCE
) -> tuple[float, float]:
    """The quota (cores) whose measured full step is within ``tolerance`` of ``target_s``, and that step.

    ``measure(None)`` is the unlimited step; a one-line FleetError naming ``what`` when the target is
    faster than it or the search does not converge."""
    free = measure(None)
    if target_s < free * (1 - tolerance):
        raise FleetError(
            f"{what}: its full step {1000 * target_s:.0f} ms is faster than this machine's "
            f"{1000 * free:.0f} ms on one unlimited core; the testbed cannot emulate it here (give cpu instead)"
        )
    tried: list[tuple[float, float]] = []
    cpu = min(1.0, free / target_s)
    for _ in range(TRIES):
        step = measure(cpu)
        tried.append((cpu, step))
        if abs(step / target_s - 1) <= tolerance:
            return cpu, step
        cpu = next_quota(tried, target_s)
    best = min(tried, key=lambda t: abs(t[1] / target_s - 1))
    raise FleetError(
        f"{what}: no quota came within {100 * tolerance:.0f}% of its full step {1000 * target_s:.0f} ms "
        f"in {TRIES} tries (closest: {best[0]:.3f} core, {1000 * best[1]:.0f} ms); the machine may be too busy"
    )


def next_quota(tried: list[tuple[float, float]], target_s: float) -> float:
    """The next quota to try: along the line through the last two tries in log-log space (a step is
    close to a power of its quota; the first correction assumes the power -1), kept inside the bracket
    the tries have found. Small quotas slow a step more than in proportion (a conv longer than the
    quota waits out the period), so the power is measured rather than assumed."""
    cpu, step = tried[-1]
    slope = -1.0
    if len(tried) >= 2 and tried[-2][0] != cpu:
        slope = math.log(step / tried[-2][1]) / math.log(cpu / tried[-2][0])
        slope = min(-0.3, max(-3.0, slope))  # noise can give any sign; a quota always slows a step
    low = max((c for c, s in tried if s > target_s), default=MIN_CPU)  # too slow: the quota must grow
    high = min((c for c, s in tried if s < target_s), default=1.0)  # too fast: the quota must shrink
    guess = cpu * (target_s / step) ** (1 / slope)
    if not low < guess < high:
        guess = math.sqrt(low * high)
    return min(1.0, max(MIN_CPU, guess))


def class_profiles(cfg: TestbedFleetConfig) -> dict[str, DeviceProfile]:
    """Each class's ``profile`` read and checked against the fleet's model, batch and input size, by class
    name: a garbage file, another model's or another batch size's is a one-line error before anything starts."""
    out, given = {}, [c for c in cfg.testbed.classes if c.profile is not None]
    if not given:
        return out
    model, batch, size = make_model(cfg.model), cfg.train.batch_size, cfg.data.input_size  # one model for all
    for c in given:
        what = f"testbed.classes ({c.name}).profile"
        profile = DeviceProfile.load(resolve_path(c.profile), field=what)
        check_profile(profile, model, batch, size, f"profile {c.profile} ({what})")
        out[c.name] = profile
    return out


def calibrate_classes(
    cfg: TestbedFleetConfig, config: Path, work: Path, log: Callable[[str], None]
) -> TestbedFleetConfig:
    """``cfg`` with every class that gives a ``profile`` given the quota that matches it, each printed."""
    classes, profiles = [], class_profiles(cfg)
    for c in cfg.testbed.classes:
        if c.name in profiles:
            what, profile = f"testbed.classes ({c.name}).profile", profiles[c.name]
            cpu, step = search_quota(lambda q: measure_full_step(config, q, work), profile.full_step_time, what)
            log(
                f"testbed: class {c.name} calibrated to {c.profile}: {cpu:.3f} core "
                f"(full step {1000 * step:.0f} ms here, {1000 * profile.full_step_time:.0f} ms on the device)"
            )
            c = dataclasses.replace(c, cpu=round(cpu, 3))
        classes.append(c)
    return dataclasses.replace(cfg, testbed=dataclasses.replace(cfg.testbed, classes=classes))

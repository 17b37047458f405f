"""The ``devices.device_classes`` section: its fields, its checks and its trace files.

Kept apart from :mod:`fleet.federated.shared.classes` (what a class means for a device, a pure function
of the whole config) so that the config can check its classes when it is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from fleet.base.errors import ConfigError
from fleet.base.numbers import is_real
from fleet.engine.config import read_yaml_mapping, shown
from fleet.federated.shared.fedscale import FedScaleTrace
from fleet.federated.shared.online import Trace
from fleet.federated.shared.paths import resolve_path


@dataclass
class DeviceClassConfig:
    """One kind of device in a simulated fleet (``devices.device_classes``; fleet/federated/shared/classes.py)."""

    name: str = "device"  # names the class in metrics.jsonl, summary.json and classes.png; each class its own
    share: float = 1.0  # of the fleet; the classes' shares sum to 1
    tier: float = 1.0  # slow-down on hardware.profile: an assumption until someone profiles the hardware
    profile: str | None = None  # a profile measured on this hardware (`fleet profile --out`): replaces tier
    bandwidth_mbps: float = 100.0  # median uplink in Mbit/s
    bandwidth_sigma: float = 0.0  # lognormal spread of the uplink over the class's devices; 0: all at the median
    # downlink in Mbit/s: each round the device first downloads the whole global model; null: not on the clock
    downlink_mbps: float | None = None
    # seconds a device spends on every message before it trains: Flower starts a fresh ClientApp process for each
    # one (Python, imports, the device's data and model). Measured on the real device (`ready_s` in metrics.jsonl)
    start_s: float = 0.0
    availability: float = 1.0  # per-round probability that a device of the class is online
    trace: str | None = None  # online intervals instead (period_s, devices: [[[start, end], ...], ...])
    # FedScale's device files (pickle, or the same as .json; fleet/federated/shared/fedscale.py): each device draws a
    # client and takes its uplink, online intervals and speed (its ms/sample over the trace's median, on the class's
    # profile)
    fedscale_capacity: str | None = None  # client_device_capacity: {client: {computation, communication}}
    fedscale_behaviour: str | None = None  # client_behave_trace: {client: {active, inactive, finish_time}}

    @property
    def fedscale(self) -> FedScaleTrace | None:
        if self.fedscale_capacity is None or self.fedscale_behaviour is None:
            return None
        return FedScaleTrace(self.fedscale_capacity, self.fedscale_behaviour)


@lru_cache(maxsize=16)
def load_trace(path: str) -> Trace:
    """A trace file: ``period_s`` and ``devices``, a list of per-device lists of [start, end] pairs."""
    where = f"device_classes trace {path}"
    if not resolve_path(path).is_file():
        raise ConfigError(
            f"{where}: no such file; give a trace YAML (period_s, devices: per-device [[start, end], ...] lists), "
            "or drop trace and give the class an availability"
        )
    data = read_yaml_mapping(resolve_path(path), what=where)
    period = data.get("period_s")
    devices = data.get("devices")
    if not is_real(period) or not period > 0:
        raise ConfigError(
            f"{where}: period_s {shown(period)} is not allowed; use the trace's length in seconds (a finite number > 0)"
        )
    if not isinstance(devices, list) or not devices:
        raise ConfigError(f"{where}: devices must be a non-empty list of per-device [[start, end], ...] lists")
    parsed = []
    for i, intervals in enumerate(devices):
        try:
            pairs = tuple((float(a), float(b)) for a, b in intervals)
        except (TypeError, ValueError, OverflowError):  # OverflowError: an integer no float holds (10**400)
            raise ConfigError(f"{where}: devices[{i}] must be a list of [start, end] pairs in seconds") from None
        if any(not (0 <= a < b <= period) for a, b in pairs):
            raise ConfigError(f"{where}: devices[{i}] has an interval outside 0 <= start < end <= period_s")
        parsed.append(pairs)
    if not any(parsed):
        raise ConfigError(f"{where}: no device is ever online; give some device an online interval")
    return Trace(float(period), tuple(parsed))


def check_fedscale(c: DeviceClassConfig) -> None:
    """A FedScale class names both files, and they say everything its tier, uplink and availability would."""
    given = [f for f in ("fedscale_capacity", "fedscale_behaviour") if getattr(c, f) is not None]
    if not given:
        return
    if len(given) == 1:
        missing = "fedscale_behaviour" if given == ["fedscale_capacity"] else "fedscale_capacity"
        raise ConfigError(f"devices.device_classes ({c.name}): {given[0]} needs {missing} too; give both files")
    clash = [f for f, v in (("trace", c.trace is not None), ("availability", c.availability != 1.0)) if v]
    if clash:
        raise ConfigError(
            f"devices.device_classes ({c.name}): its FedScale trace says when its devices are online; drop {clash[0]}"
        )
    c.fedscale.table()  # read and checked now: a bad file is one line before anything runs


def check_classes(classes: list[DeviceClassConfig]) -> None:
    """One-line errors for classes that cannot describe a fleet."""
    if not classes:
        return
    for i, c in enumerate(classes):
        where = f"devices.device_classes[{i}] ({c.name})"
        for field_name, ok, use in (
            ("share", 0 < c.share <= 1, "a fraction of the fleet in (0, 1]"),
            ("tier", c.tier > 0, "a slow-down factor > 0 (1 = as profiled)"),
            ("bandwidth_mbps", c.bandwidth_mbps > 0, "a median uplink in Mbit/s > 0"),
            ("bandwidth_sigma", 0 <= c.bandwidth_sigma <= 3, "a lognormal spread in [0, 3]"),
            ("downlink_mbps", c.downlink_mbps is None or c.downlink_mbps > 0, "a downlink in Mbit/s > 0, or null"),
            ("start_s", 0 <= c.start_s <= 3600, "seconds in [0, 3600]"),
            ("availability", 0 <= c.availability <= 1, "a per-round probability in [0, 1]"),
        ):
            if not ok:
                raise ConfigError(f"{where}.{field_name}: {shown(getattr(c, field_name))} is not allowed; use {use}")
    total = sum(c.share for c in classes)
    if abs(total - 1) > 1e-6:
        shares = ", ".join(f"{c.name} {c.share:g}" for c in classes)
        raise ConfigError(f"devices.device_classes: the shares sum to {total:g} ({shares}); make them sum to 1")
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise ConfigError(f"devices.device_classes: class names repeat ({', '.join(names)}); name each once")
    for c in classes:
        if c.profile is not None and not resolve_path(c.profile).is_file():
            raise ConfigError(
                f"devices.device_classes ({c.name}): profile {c.profile} is not a file; measure one on that "
                f"hardware with `fleet profile --out {Path(c.profile).name}`, or give the class a tier instead"
            )
        if c.trace is not None and c.availability != 1.0:
            raise ConfigError(
                f"devices.device_classes ({c.name}): trace and availability {c.availability:g} both say when its "
                "devices are online; give one (a trace's online intervals, or a per-round probability)"
            )
        if c.trace is not None:
            load_trace(c.trace)
        check_fedscale(c)
    if all(c.trace is None and c.availability == 0 for c in classes):
        raise ConfigError(
            "devices.device_classes: every class has availability 0, so no device is ever online; "
            "give some class an availability > 0"
        )

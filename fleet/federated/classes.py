"""Device classes: a simulated fleet drawn from kinds of hardware, links and habits.

A fleet in the field is not one measured device slowed by a factor. ``federation.device_classes``
lists classes, each a share of the fleet with its own speed (a profile measured on that
hardware, or a tier factor on the fleet's profile), its own uplink (a median bandwidth and a
lognormal spread across its devices, as measured mobile uplinks are) and its own availability
(a per-round probability of being online, or a trace of online intervals in the style of
FedScale's device-behaviour traces). Everything here is a pure function of the config, the
device's partition, the round and the simulated clock, so the server and every device derive
the same answers and nothing about a device's class crosses the network.

Without classes, the fleet is what it was: ``tiers`` in turn, one bandwidth, always online.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from fleet.config import read_yaml_mapping
from fleet.errors import ConfigError
from fleet.federated.config import DeviceClassConfig, FleetConfig, resolve_path

CLASS_STREAM, BANDWIDTH_STREAM, ONLINE_STREAM = 19, 23, 29  # independent seeded draws


def class_counts(shares: Sequence[float], num_devices: int) -> list[int]:
    """Devices per class: ``shares`` of ``num_devices`` rounded by largest remainder (they sum to it)."""
    exact = [s * num_devices for s in shares]
    counts = [math.floor(e) for e in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: num_devices - sum(counts)]:
        counts[i] += 1
    return counts


@lru_cache(maxsize=16)
def _assignment(shares: tuple[float, ...], num_devices: int, seed: int) -> tuple[int, ...]:
    labels = np.repeat(np.arange(len(shares)), class_counts(shares, num_devices))
    return tuple(int(c) for c in np.random.default_rng([seed, CLASS_STREAM]).permutation(labels))


def class_of(cfg: FleetConfig, partition_id: int) -> DeviceClassConfig | None:
    """The class of simulated device ``partition_id`` (classes are spread over the fleet, seeded), or None."""
    classes = cfg.federation.device_classes
    if not classes:
        return None
    shares = tuple(c.share for c in classes)
    return classes[_assignment(shares, cfg.federation.num_devices, cfg.train.seed)[partition_id]]


def bandwidth_of(cfg: FleetConfig, partition_id: int | None) -> float:
    """The device's uplink in bytes/s: its class's median times a seeded lognormal draw, else the fleet's."""
    cls = None if partition_id is None else class_of(cfg, partition_id)
    if cls is None:
        return cfg.federation.bandwidth_bytes_per_s
    z = np.random.default_rng([cfg.train.seed, BANDWIDTH_STREAM, partition_id]).standard_normal()
    return cls.bandwidth_mbps * 1e6 / 8 * math.exp(cls.bandwidth_sigma * z)


@dataclass(frozen=True)
class Trace:
    """Online intervals [start, end) in seconds, per device, repeating every ``period_s``; the device
    with partition k follows ``devices[k % len]``."""

    period_s: float
    devices: tuple[tuple[tuple[float, float], ...], ...]

    def online(self, index: int, t: float) -> bool:
        intervals = self.devices[index % len(self.devices)]
        phase = t % self.period_s
        return any(start <= phase < end for start, end in intervals)


@lru_cache(maxsize=16)
def load_trace(path: str) -> Trace:
    """A trace file: ``period_s`` and ``devices``, a list of per-device lists of [start, end] pairs."""
    where = f"device_classes trace {path}"
    data = read_yaml_mapping(resolve_path(path), shown=path)
    period = data.get("period_s")
    devices = data.get("devices")
    if not isinstance(period, (int, float)) or isinstance(period, bool) or not period > 0:
        raise ConfigError(f"{where}: period_s {period!r} is not allowed; use the trace's length in seconds (> 0)")
    if not isinstance(devices, list) or not devices:
        raise ConfigError(f"{where}: devices must be a non-empty list of per-device [[start, end], ...] lists")
    parsed = []
    for i, intervals in enumerate(devices):
        try:
            pairs = tuple((float(a), float(b)) for a, b in intervals)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: devices[{i}] must be a list of [start, end] pairs in seconds") from None
        if any(not (0 <= a < b <= period) for a, b in pairs):
            raise ConfigError(f"{where}: devices[{i}] has an interval outside 0 <= start < end <= period_s")
        parsed.append(pairs)
    if not any(parsed):
        raise ConfigError(f"{where}: no device is ever online; give some device an online interval")
    return Trace(float(period), tuple(parsed))


def online(cfg: FleetConfig, partition_id: int, server_round: int, sim_time_s: float) -> bool:
    """Whether simulated device ``partition_id`` is online for this round (its class's trace at the
    simulated clock, else its per-round probability, seeded); always, without classes."""
    cls = class_of(cfg, partition_id)
    if cls is None:
        return True
    if cls.trace is not None:
        return load_trace(cls.trace).online(partition_id, sim_time_s)
    if cls.availability >= 1:
        return True
    draw = np.random.default_rng([cfg.train.seed, ONLINE_STREAM, server_round, partition_id]).random()
    return bool(draw < cls.availability)


def check_classes(cfg: FleetConfig) -> None:
    """One-line errors for classes that cannot describe a fleet (the fields' own ranges are RULES')."""
    classes = cfg.federation.device_classes
    if not classes:
        return
    for i, c in enumerate(classes):
        where = f"federation.device_classes[{i}] ({c.name})"
        for field_name, ok, use in (
            ("share", 0 < c.share <= 1, "a fraction of the fleet in (0, 1]"),
            ("tier", c.tier > 0, "a slow-down factor > 0 (1 = as profiled)"),
            ("bandwidth_mbps", c.bandwidth_mbps > 0, "a median uplink in Mbit/s > 0"),
            ("bandwidth_sigma", 0 <= c.bandwidth_sigma <= 3, "a lognormal spread in [0, 3]"),
            ("availability", 0 <= c.availability <= 1, "a per-round probability in [0, 1]"),
        ):
            if not ok:
                raise ConfigError(f"{where}.{field_name}: {getattr(c, field_name)!r} is not allowed; use {use}")
    total = sum(c.share for c in classes)
    if abs(total - 1) > 1e-6:
        shares = ", ".join(f"{c.name} {c.share:g}" for c in classes)
        raise ConfigError(f"federation.device_classes: the shares sum to {total:g} ({shares}); make them sum to 1")
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise ConfigError(f"federation.device_classes: class names repeat ({', '.join(names)}); name each once")
    for c in classes:
        if c.profile is not None and not resolve_path(c.profile).is_file():
            raise ConfigError(
                f"federation.device_classes ({c.name}): profile {c.profile} is not a file; measure one on that "
                f"hardware with `fleet profile --out {Path(c.profile).name}`, or give the class a tier instead"
            )
        if c.trace is not None:
            load_trace(c.trace)
    if all(c.trace is None and c.availability == 0 for c in classes):
        raise ConfigError(
            "federation.device_classes: every class has availability 0, so no device is ever online; "
            "give some class an availability > 0"
        )


@dataclass
class FleetClasses:
    """The server's view of a simulated fleet's classes, by device name (the roster's trusted names,
    not what a reply claims). In deployment ``partitions`` is empty: real devices have their own speed,
    uplink and habits, so every name gets the fleet's bandwidth and is taken as online."""

    cfg: FleetConfig
    partitions: dict[str, int]  # device name -> partition, for the simulated devices

    def class_name(self, name: str | None) -> str | None:
        pid = self.partitions.get(name or "")
        cls = None if pid is None else class_of(self.cfg, pid)
        return None if cls is None else cls.name

    def bandwidth(self, name: str | None) -> float:
        return bandwidth_of(self.cfg, self.partitions.get(name or ""))

    def online(self, name: str, server_round: int, sim_time_s: float) -> bool:
        pid = self.partitions.get(name)
        return True if pid is None else online(self.cfg, pid, server_round, sim_time_s)

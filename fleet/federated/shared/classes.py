"""Device classes: a simulated fleet drawn from kinds of hardware, links and habits.

A fleet in the field is not one measured device slowed by a factor. ``devices.device_classes``
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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from fleet.federated.shared.class_config import DeviceClassConfig, load_trace
from fleet.federated.shared.config import FleetConfig
from fleet.federated.shared.online import Trace

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
    classes = cfg.devices.device_classes
    if not classes:
        return None
    shares = tuple(c.share for c in classes)
    return classes[_assignment(shares, cfg.devices.num_devices, cfg.train.seed)[partition_id]]


def bandwidth_of(cfg: FleetConfig, partition_id: int | None) -> float:
    """The device's uplink in bytes/s: its class's median times a seeded lognormal draw, else the fleet's."""
    cls = None if partition_id is None else class_of(cfg, partition_id)
    if cls is None:
        return cfg.devices.bandwidth_bytes_per_s
    if cls.fedscale is not None:
        return cls.fedscale.bandwidth_bytes_per_s(cfg.train.seed, partition_id)
    z = np.random.default_rng([cfg.train.seed, BANDWIDTH_STREAM, partition_id]).standard_normal()
    return cls.bandwidth_mbps * 1e6 / 8 * math.exp(cls.bandwidth_sigma * z)


def trace_of(cfg: FleetConfig, cls: DeviceClassConfig, partition_id: int) -> tuple[Trace, int] | None:
    """The online intervals a traced device follows, and its index in them: its class's trace file (entry
    ``partition_id``), or its FedScale client's; None for a device online by chance."""
    if cls.trace is not None:
        return load_trace(cls.trace), partition_id
    if cls.fedscale is not None:
        return cls.fedscale.client(cfg.train.seed, partition_id).trace, 0
    return None


def online(cfg: FleetConfig, partition_id: int, server_round: int, sim_time_s: float) -> bool:
    """Whether simulated device ``partition_id`` is online for this round (its class's trace at the
    simulated clock, else its per-round probability, seeded); always, without classes."""
    cls = class_of(cfg, partition_id)
    if cls is None:
        return True
    traced = trace_of(cfg, cls, partition_id)
    if traced is not None:
        trace, index = traced
        return trace.online(index, sim_time_s)
    if cls.availability >= 1:
        return True
    draw = np.random.default_rng([cfg.train.seed, ONLINE_STREAM, server_round, partition_id]).random()
    return bool(draw < cls.availability)


@dataclass
class FleetClasses:
    """The server's view of a simulated fleet's classes, by device name (the roster's trusted names,
    not what a reply claims). In deployment ``partitions`` is empty: real devices have their own speed,
    uplink and habits, so every name gets the fleet's bandwidth and is taken as online."""

    cfg: FleetConfig
    partitions: dict[str, int]  # device name -> partition, for the simulated devices

    def device_class(self, name: str | None) -> DeviceClassConfig | None:
        """The class of the simulated device called ``name`` (None: a deployed device, or no classes)."""
        pid = self.partitions.get(name or "")
        return None if pid is None else class_of(self.cfg, pid)

    def class_name(self, name: str | None) -> str | None:
        cls = self.device_class(name)
        return None if cls is None else cls.name

    def bandwidth(self, name: str | None) -> float:
        return bandwidth_of(self.cfg, self.partitions.get(name or ""))

    def fixed_s(self, name: str | None, download_bytes: int) -> float:
        """What a round costs the device whatever it trains: its start (``start_s``) and its download of
        the global model (``download_bytes`` over ``downlink_mbps``); 0 without a class saying so."""
        cls = self.device_class(name)
        if cls is None:
            return 0.0
        download = 0.0 if cls.downlink_mbps is None else download_bytes * 8 / (cls.downlink_mbps * 1e6)
        return cls.start_s + download

    def online(self, name: str, server_round: int, sim_time_s: float) -> bool:
        pid = self.partitions.get(name)
        return True if pid is None else online(self.cfg, pid, server_round, sim_time_s)

    def wait_s(self, names: Iterable[str], sim_time_s: float) -> float:
        """Simulated seconds until the first of ``names`` follows its trace back online (0 when one is online
        now or is online by chance each round, which the next round draws again)."""
        waits = []
        for name in names:
            cls = self.device_class(name)
            traced = None if cls is None else trace_of(self.cfg, cls, self.partitions[name])
            waits.append(0.0 if traced is None else traced[0].wait_s(traced[1], sim_time_s))
        return min(waits, default=0.0)

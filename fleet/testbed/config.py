"""The ``testbed`` section: the emulated devices ``fleet testbed`` runs as real SuperNodes on one machine.

Each class is a kind of device with its own CPU share, memory limit and link; the testbed gives every
device of it a cgroup and a network namespace with exactly those. Pure dataclasses and checks, so the
config can refuse a bad class when it is loaded, before anything is started.

The section is the testbed's own: :class:`TestbedFleetConfig` is a fleet config with it, read by
:func:`load_testbed_config`. The core's loader leaves the section out (``config.SECTIONS_ABOVE``), so the
same YAML file also serves the server app the testbed submits, which needs none of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from fleet.base.errors import ConfigError
from fleet.engine.config import Rule
from fleet.federated.shared.config import FleetConfig, fleet_config_from_dict, load_fleet_config
from fleet.federated.shared.paths import resolve_path

NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-")


@dataclass
class TestbedClassConfig:
    """One kind of emulated device: how many, how much CPU and memory, and its link to the server."""

    __test__ = False  # not a pytest class

    name: str = "device"  # names the class and its devices (<name>-0, <name>-1, ...): lower-case letters, digits, '-'
    count: int = 1  # devices of this class
    # CPU cores it may use, a fraction of one for a small board (0.25: a quarter of a core, as a CFS quota);
    # null: no limit. Its torch threads follow it (one thread per whole core, at least one)
    cpu: float | None = None
    # its memory limit in MB (a cgroup limit on every process of the device); the device plans its activations
    # within this less testbed.runtime_mb, so it keeps, recomputes or pages rather than being OOM-killed; null: none
    memory_mb: float | None = None
    uplink_mbps: float = 100.0  # its uplink in Mbit/s: the rate of its end of the link (a token bucket)
    downlink_mbps: float = 100.0  # its downlink in Mbit/s: the rate of the server's end of its link
    latency_ms: float = 0.0  # one-way delay each way (netem); needs the kernel's sch_netem
    # a profile measured on the real device (`fleet profile` there, same model, batch and input size): the testbed
    # then finds the CPU quota at which this machine's full step matches it within 10%, and prints it; cpu stays null
    profile: str | None = None

    RULES: ClassVar[dict[str, Rule]] = {
        "name": (lambda v: 1 <= len(v) <= 20 and set(v) <= NAME_CHARS, "1-20 lower-case letters, digits or '-'"),
        "count": (lambda v: 1 <= v <= 64, "an integer from 1 to 64"),
        "cpu": (lambda v: v is None or 0.05 <= v <= 1024, "a number of cores >= 0.05 (e.g. 0.25), or null"),
        "memory_mb": (lambda v: v is None or v >= 64, "a number of MB >= 64, or null (no limit)"),
        "uplink_mbps": (lambda v: 0.01 <= v <= 100_000, "a rate in Mbit/s from 0.01 to 100000"),
        "downlink_mbps": (lambda v: 0.01 <= v <= 100_000, "a rate in Mbit/s from 0.01 to 100000"),
        "latency_ms": (lambda v: 0 <= v <= 10_000, "milliseconds from 0 to 10000"),
    }

    def threads(self) -> int:
        """Torch threads for its CPU share: one per whole core, at least one."""
        return max(1, int(self.cpu)) if self.cpu is not None else 1


RUNTIMES = ("warm", "subprocess")  # testbed.runtime's values


@dataclass
class TestbedConfig:
    """Emulated devices for `fleet testbed`: real SuperNodes with their own CPU, memory and links."""

    __test__ = False  # not a pytest class

    classes: list[TestbedClassConfig] = field(default_factory=list)  # the kinds of device; none: no testbed
    # what a device's processes hold besides activations (the SuperNode and its ClientApp: Python, torch and Flower,
    # the model with its gradients and optimizer state, its data), subtracted from its memory limit to give its
    # activation budget (docs/testbed.md has what the reference devices' processes peaked at)
    runtime_mb: float = 1200.0
    timeout_s: float = 3600.0  # the whole testbed run's bound in wall seconds; past it everything is stopped
    # how a device serves Flower's messages: "warm", a `fleet device runtime` beside the SuperNode (`fleet device
    # supernode`, Flower's without its idle sleeps) forks each task from a process that has imported torch and
    # Flower once (the default wherever a device runs: docs/pi.md); "subprocess", Flower's own flower-supernode
    # and SuperExec starting a fresh flwr-clientapp per message, to compare against
    runtime: str = "warm"

    RULES: ClassVar[dict[str, Rule]] = {
        "runtime_mb": (lambda v: v >= 0, "a number of MB >= 0"),
        "timeout_s": (lambda v: v > 0, "a number of seconds > 0"),
        "runtime": (lambda v: v in RUNTIMES, " or ".join(RUNTIMES)),
    }

    @property
    def num_devices(self) -> int:
        return sum(c.count for c in self.classes)


def check_testbed(testbed: TestbedConfig) -> None:
    """Checks across classes: distinct names, CPUs this machine has, memory above the runtime."""
    names = [c.name for c in testbed.classes]
    if len(set(names)) != len(names):
        raise ConfigError(f"testbed.classes: class names {names} repeat; give each class its own name")
    cores = os.cpu_count() or 1
    wanted = sum((c.cpu or 0.0) * c.count for c in testbed.classes)
    if wanted > cores:
        raise ConfigError(
            f"testbed.classes: the devices ask for {wanted:g} cores and this machine has {cores}; "
            "lower cpu or count, leaving some for the server"
        )
    for c in testbed.classes:
        if c.profile is not None and c.cpu is not None:
            raise ConfigError(
                f"testbed.classes ({c.name}): cpu {c.cpu:g} and profile {c.profile} both set the device's speed; "
                "give one (the profile's quota is found by calibration)"
            )
        if c.profile is not None and not resolve_path(c.profile).is_file():
            raise ConfigError(
                f"testbed.classes ({c.name}): profile {c.profile} is not a file; measure one on the real device "
                f"with `fleet profile --config CONFIG --out {Path(c.profile).name}`, or give the class a cpu instead"
            )
        if c.memory_mb is not None and c.memory_mb <= testbed.runtime_mb:
            raise ConfigError(
                f"testbed.classes ({c.name}): memory_mb {c.memory_mb:g} leaves nothing above testbed.runtime_mb "
                f"{testbed.runtime_mb:g} for activations; raise memory_mb or lower testbed.runtime_mb"
            )


@dataclass
class TestbedFleetConfig(FleetConfig):
    """A fleet config with the emulated devices ``fleet testbed`` and ``fleet bench testbed`` run it on."""

    __test__ = False  # not a pytest class

    testbed: TestbedConfig = field(default_factory=TestbedConfig)


def load_testbed_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> TestbedFleetConfig:
    """The fleet YAML at ``path`` with its ``testbed`` section, every field and the classes checked."""
    return _checked(load_fleet_config(path, overrides, TestbedFleetConfig))


def parse_testbed_config(data: dict | None, overrides: dict[str, Any] | None = None) -> TestbedFleetConfig:
    """The same from a raw mapping."""
    return _checked(fleet_config_from_dict(data, overrides, TestbedFleetConfig))


def _checked(cfg: TestbedFleetConfig) -> TestbedFleetConfig:
    check_testbed(cfg.testbed)
    return cfg

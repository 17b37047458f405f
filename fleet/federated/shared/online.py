"""Online intervals on the simulated clock: when a traced device is reachable.

Shared by the YAML traces of ``devices.device_classes[].trace`` and FedScale's behaviour files
(:mod:`fleet.federated.shared.fedscale`), so both answer "online now?" and "back when?" alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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

    def wait_s(self, index: int, t: float) -> float:
        """Seconds from ``t`` until the device is next online (0 when it is now; inf if never)."""
        phase = t % self.period_s
        waits = [
            0.0 if a <= phase < b else (a - phase) % self.period_s for a, b in self.devices[index % len(self.devices)]
        ]
        return min(waits, default=math.inf)

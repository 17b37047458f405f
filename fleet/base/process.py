"""How long this process has lived: what a message cost a device before its own code ran.

Flower's SuperNode starts a fresh ClientApp process for every message it is sent, so a deployed
device pays, each round, for Python's start, the imports, the app's loading and then its own data
and model, before training. That cost is real seconds on a slow board and no timer inside the app
can see its first part; the kernel's record of when the process started can.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def process_age_s() -> float | None:
    """Seconds since this process started (Linux's /proc), or None where the kernel does not say."""
    try:
        stat = Path("/proc/self/stat").read_text()
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5): start, in ticks after boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


# Set by ``fleet device runtime`` in each task's process: the seconds Flower spent pulling the task's message
# (its arrays) before the app ran, a transfer rather than start-up. Flower's own flwr-clientapp does not say.
PULL_ENV = "FLEET_TASK_PULL_S"
# Set to "1" by ``fleet device runtime`` in each task's process: the device's state is written once the reply has
# gone out, not before it (fleet.federated.on_device.state_lock, "Who defers").
HOLD_WRITES_ENV = "FLEET_HOLD_WRITES"


def task_pull_s() -> float:
    """Seconds this process spent receiving its message before the app ran, where the runtime measured it."""
    try:
        return max(0.0, float(os.environ.get(PULL_ENV, "0")))
    except ValueError:
        return 0.0

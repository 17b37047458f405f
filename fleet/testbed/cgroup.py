"""A device's CPU and memory, limited by a real cgroup (v1 controllers or the v2 unified tree).

Design notes:

* **Below our own cgroup.** A device's cgroup is made under the cgroup this process already lives in
  (per controller, from /proc/self/cgroup), so a testbed inside a container or a sandbox stays inside
  its own limits and never writes to the machine's root cgroup.
* **Named for the testbed.** Every cgroup the testbed makes is called ``fleettb-<name>``, so a testbed
  that crashed is cleared on the next start (:func:`remove_stale`).
* **The whole process tree.** A process joins by writing its pid before it execs the device's
  program (:meth:`Cgroup.join_command`), so every ClientApp the SuperNode spawns later is inside too.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from fleet.base.errors import FleetError

ROOT = Path("/sys/fs/cgroup")
PREFIX = "fleettb-"  # every cgroup the testbed makes, so leftovers of a crashed run can be found
# The CFS period a CPU quota is a share of. Not the kernel's 100 ms: a training step shorter than its quota (a
# quarter core's 25 ms) would run at full speed inside one period, so a fast step would not be slowed at all.
# Measured on a 9 ms conv step at 0.25 core: 100 ms gave 9.5 ms (no limit), 20 ms 39.8 ms (4.5x), 10 ms 43 ms
PERIOD_US = 20_000
V1_CONTROLLERS = ("cpu", "memory", "freezer")


def version(root: Path = ROOT) -> int:
    """2 for a unified hierarchy with the cpu and memory controllers, 1 for v1 controllers (also in a
    hybrid mount, where they are what limits a process)."""
    if (root / "cpu" / "cpu.cfs_quota_us").exists() and (root / "memory").is_dir():
        return 1
    controllers = root / "cgroup.controllers"
    if controllers.is_file() and {"cpu", "memory"} <= set(controllers.read_text().split()):
        return 2
    raise FleetError(
        f"the testbed needs a cgroup CPU and memory controller; none is mounted under {root} "
        "(mount cgroup v2 with the cpu and memory controllers, or the v1 cpu, memory and freezer hierarchies)"
    )


def own_path(controller: str, proc_cgroup: str | None = None) -> str:
    """The cgroup this process is in for ``controller`` (v1), or in the unified tree (``controller`` "")."""
    text = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
    for line in text.splitlines():
        _, names, path = line.split(":", 2)
        if (controller and controller in names.split(",")) or (not controller and names == ""):
            return path.lstrip("/")
    return ""


@dataclass
class Cgroup:
    """One device's cgroup: ``cpu`` cores (a fraction: 0.25 is a quarter of one core) and ``memory_mb``
    (None: no limit on either; the cgroup still holds the device's processes, to freeze and to kill)."""

    name: str
    cpu: float | None
    memory_mb: float | None
    root: Path = ROOT

    def __post_init__(self) -> None:
        self.version = version(self.root)

    def dirs(self) -> list[Path]:
        """Its folder in each hierarchy that limits it."""
        leaf = PREFIX + self.name
        if self.version == 2:
            return [self.root / own_path("") / leaf]
        return [self.root / c / own_path(c) / leaf for c in V1_CONTROLLERS]

    def create(self) -> Cgroup:
        quota = None if self.cpu is None else max(1000, int(self.cpu * PERIOD_US))  # the least quota is 1 ms
        limit = None if self.memory_mb is None else int(self.memory_mb * 2**20)
        for d in self.dirs():
            d.mkdir(exist_ok=True)
        if self.version == 2:
            d = self.dirs()[0]
            _write(d / "cpu.max", f"{quota or 'max'} {PERIOD_US}")
            _write(d / "memory.max", str(limit or "max"))
            _write(d / "memory.swap.max", "0", missing_ok=True)
        else:
            cpu, memory, _ = self.dirs()
            _write(cpu / "cpu.cfs_period_us", str(PERIOD_US))
            _write(cpu / "cpu.cfs_quota_us", str(quota or -1))
            if limit is not None:
                _write(memory / "memory.limit_in_bytes", str(limit))
                _write(memory / "memory.memsw.limit_in_bytes", str(limit), missing_ok=True)  # no swap past it
        return self

    def join_command(self) -> list[str]:
        """A shell prefix that moves itself into this cgroup and then execs the rest of the command line."""
        moves = "; ".join(f"echo $$ > {d / 'cgroup.procs'}" for d in self.dirs())
        return ["sh", "-c", f'{moves}; exec "$@"', "sh"]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs():
            procs = d / "cgroup.procs"
            if procs.is_file():
                found |= {int(p) for p in procs.read_text().split()}
        return found

    def freeze(self, frozen: bool) -> None:
        """Stop every process in it (a frozen device: alive, connected, silent), or let them run again."""
        if self.version == 2:
            _write(self.dirs()[0] / "cgroup.freeze", "1" if frozen else "0")
        else:
            _write(self.dirs()[2] / "freezer.state", "FROZEN" if frozen else "THAWED")

    def memory_peak_mb(self) -> float:
        """The most memory its processes held at once (0 when the kernel does not say)."""
        d = self.dirs()[0] if self.version == 2 else self.dirs()[1]
        path = d / ("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")
        return int(path.read_text()) / 2**20 if path.is_file() else 0.0

    def oom_kills(self) -> int:
        """How often the kernel killed a process of it for memory."""
        d = self.dirs()[0] if self.version == 2 else self.dirs()[1]
        events = d / ("memory.events" if self.version == 2 else "memory.oom_control")
        for line in events.read_text().splitlines() if events.is_file() else []:
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        """Kill whatever still runs in it, then remove it from every hierarchy."""
        _remove(self.dirs())


def _remove(dirs: list[Path]) -> None:
    for d in dirs:
        if d.name.endswith("freezer") or (d / "freezer.state").is_file():
            _write(d / "freezer.state", "THAWED", missing_ok=True)  # a frozen process cannot die
        if (d / "cgroup.freeze").is_file():
            _write(d / "cgroup.freeze", "0", missing_ok=True)
    for _ in range(50):
        pids = {
            int(p) for d in dirs if (d / "cgroup.procs").is_file() for p in (d / "cgroup.procs").read_text().split()
        }
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    for d in dirs:
        try:
            d.rmdir()
        except FileNotFoundError:
            pass


def stale(root: Path = ROOT) -> list[Path]:
    """Every cgroup a testbed made that is still there, in every hierarchy."""
    try:
        v = version(root)
    except FleetError:
        return []
    parents = [root / own_path("")] if v == 2 else [root / c / own_path(c) for c in V1_CONTROLLERS]
    return sorted({p for parent in parents if parent.is_dir() for p in parent.glob(PREFIX + "*") if p.is_dir()})


def remove_stale(root: Path = ROOT) -> list[str]:
    """Remove every cgroup a testbed left behind (a crash, a kill -9); the names removed."""
    left = stale(root)
    _remove(left)
    return sorted({p.name for p in left})


def _write(path: Path, value: str, missing_ok: bool = False) -> None:
    try:
        path.write_text(value)
    except FileNotFoundError:
        if not missing_ok:
            raise
    except OSError as exc:
        if not (missing_ok and exc.errno in (22, 13, 1)):  # EINVAL / EACCES / EPERM: an optional knob
            raise

"""One simulation in its own process group, bounded and always cleared, optionally watched for memory.

Benchmarks launch many simulations in a row. Each runs as ``fleet simulate`` would, but in a
subprocess with its own session, so that a hung or crashed one is a finding (the group, Ray's
workers included, is killed at the timeout) rather than the end of the bench, and so that a
:class:`MemoryWatch` can find every process of it: the driver (which runs the ServerApp), Ray's
ClientApp actors and Ray's own daemons.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.federated.launch.prepare import prepare
from fleet.federated.shared.config import FleetConfig, load_fleet_config

SIMULATE = "fleet.bench.simulate_main"  # one simulation, as `fleet simulate` runs it: python -m SIMULATE CONFIG APP
HONEST_APP = "client.client_app:app"
ACTOR = "ClientAppActor"  # Ray names an actor's process ray::<class>

Log = Callable[[str], None]


def progress_log(quiet: bool) -> Log:
    """Where a bench's progress lines go: stderr when stdout carries its one JSON object, else stdout."""
    if quiet:
        return lambda s: print(s, file=sys.stderr, flush=True)
    return lambda s: print(s, flush=True)


@dataclass
class MemoryWatch:
    """Peak resident memory of one process session, sampled from /proc every ``interval_s``.

    ``server``: the driver's own peak (VmHWM); ``worker``: the largest ClientApp actor's peak;
    ``total``: the largest sum over the session's processes of their proportional set size (PSS)
    at one sample. PSS splits a page shared by k processes (torch's libraries, Ray's object
    store) k ways, so the sum is the memory the simulation really holds; summing RSS would count
    every shared page once per process."""

    interval_s: float = 0.5
    server: int = 0
    worker: int = 0
    total: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self, session: int) -> threading.Thread:
        def loop() -> None:
            while not self._stop.is_set():
                self.sample(session)
                self._stop.wait(self.interval_s)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        return thread

    def stop(self, thread: threading.Thread) -> None:
        self._stop.set()
        thread.join(timeout=5)

    def sample(self, session: int) -> None:
        total = 0
        for pid, status, cmdline in _session_processes(session):
            hwm = _kib(status, "VmHWM:") * 1024
            total += _pss(pid)
            if pid == session:
                self.server = max(self.server, hwm)
            elif ACTOR in cmdline:
                self.worker = max(self.worker, hwm)
        self.total = max(self.total, total)

    def as_dict(self) -> dict[str, int]:
        return {"server": self.server, "worker": self.worker, "total": self.total}


def _session_processes(session: int):
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[3]) != session:  # field 6: the session id
                continue
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue  # gone between listing and reading
        yield int(entry.name), status, cmdline


def _pss(pid: int) -> int:
    """A process's proportional set size in bytes (0 when it is gone or unreadable)."""
    try:
        return _kib(Path(f"/proc/{pid}/smaps_rollup").read_text(), "Pss:") * 1024
    except (OSError, ValueError):
        return 0


def _kib(status: str, key: str) -> int:
    for line in status.splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    return 0


def launch(
    config_path: Path,
    client_app: str,
    timeout_s: float,
    echo: Log,
    watch: MemoryWatch | None = None,
    server_app: str | None = None,
) -> str | None:
    """Run one simulation in a new session (with ``server_app``, else fleet's); None when it exited 0, else why not.

    Its output is echoed line by line. On a timeout the whole group (Ray's workers included) is
    killed; it is also cleared after a normal exit, so no simulation outlives its turn."""
    cmd = [sys.executable, "-m", SIMULATE, str(config_path), client_app, *([server_app] if server_app else [])]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, **pipes)
    watcher = None if watch is None else watch.run(proc.pid)
    tail: deque[str] = deque(maxlen=5)

    def pump() -> None:
        for line in proc.stdout:
            tail.append(line.rstrip())
            echo(line.rstrip())

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    started = time.monotonic()
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if watcher is not None:
            watch.stop(watcher)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        reader.join(timeout=10)
    if code is None:
        return f"timed out after {time.monotonic() - started:.0f}s"
    if code != 0:
        return f"exit {code}" + (f": {tail[-1]}" if tail else "")
    return None


def shared_start(path: str, overrides: dict[str, Any], log: Log) -> FleetConfig:
    """Profile and pretrain once, in ``<name>-shared``; every run of a bench starts from these."""
    base = load_fleet_config(path, overrides)
    shared, _ = prepare(load_fleet_config(path, {**overrides, "name": f"{base.name}-shared"}), resume=False, log=log)
    return shared

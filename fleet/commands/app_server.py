"""A second fork server, for ``fleet device runtime``, that keeps one version of the app imported.

The runtime's fork server imports torch, torchvision and flwr once, but never the app (fleet, client, server):
a child must import the app from its run's FAB, so that a new version is picked up. That import is itself
0.2 CPU-seconds of every message, a second of a Raspberry Pi-class core at a fifth of its time. Once a task
has installed a FAB, the runtime starts this server for it: a child of the warm fork server (nothing imported
again) that imports the app from the FAB's directory, exactly as Flower's loader would, and then forks each
task of that FAB from itself, the app's modules already loaded.

Design notes:

* **Keyed by the FAB's hash.** A task forked here keeps the loaded modules only while its own FAB is the one
  this server loaded; a task of another FAB drops them and imports its own (as a child of the plain fork
  server does), and notes its FAB, and the runtime replaces this server once no task of it is running.
* **Only a task is lost to a crash, never the device.** A task that crashes or is killed ends alone, as
  before. This server dying, or not answering a launch within :data:`LAUNCH_S`, only sends the next tasks
  back to the plain fork server until a task notes its FAB again.
* **A plain, single-threaded loop.** The server waits on its pipe to the runtime, forks on a task, reaps its
  children and reports their ends; forking a process with no threads holds no lock by surprise.
* **The note is untrusted.** It is a small JSON file a task writes in the runtime's own temporary folder; a
  note that is not a hash and a directory with a ``pyproject.toml`` is ignored.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.base.atomic import write_text_atomic

LAUNCH_S = 10.0  # how long a launch waits for the server's fork before the task goes to the plain fork server
REAP_S = 0.05  # how often the server looks for ended tasks while no launch arrives
HASH = re.compile(r"[0-9a-f]{64}")  # a FAB's SHA-256, as Flower names it


@dataclass(frozen=True)
class AppNote:
    """The FAB a task installed, and where: what an app server would load."""

    fab_hash: str
    app_dir: str


def write_note(path: str, note: AppNote) -> None:
    """Tell the runtime which FAB this task installed (written whole, read whole)."""
    write_text_atomic(path, json.dumps({"fab_hash": note.fab_hash, "app_dir": note.app_dir}))


def read_note(path: str) -> AppNote | None:
    """The last note a task wrote, or None when there is none or it does not hold a hash and an app directory."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        note = AppNote(str(raw["fab_hash"]), str(raw["app_dir"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not HASH.fullmatch(note.fab_hash) or not (Path(note.app_dir) / "pyproject.toml").is_file():
        return None
    return note


def drop_app_modules(packages: tuple[str, ...]) -> None:
    """Forget every module of the app's ``packages``, so that the next import reads the FAB's files."""
    for name in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[name]


LOADED_MODULE: list[str] = []  # in an app server and its tasks: the ClientApp's module it imported


def load_app(app_dir: str, packages: tuple[str, ...]) -> None:
    """Import the ClientApp's module from ``app_dir`` as Flower's loader does: the directory first on the path."""
    from flwr.common.config import get_project_config

    drop_app_modules(packages)
    if app_dir not in sys.path:
        sys.path.insert(0, app_dir)
    ref = get_project_config(app_dir)["tool"]["flwr"]["app"]["components"]["clientapp"]
    module = str(ref).partition(":")[0]
    importlib.import_module(module)
    LOADED_MODULE[:] = [module]


def loaded_hook(name: str) -> Any:
    """The callable ``name`` of the ClientApp's module this process imported as an app server, or None."""
    module = sys.modules.get(LOADED_MODULE[0]) if LOADED_MODULE else None
    hook = getattr(module, name, None)
    return hook if callable(hook) else None


def serve_app(conn: Any, note: AppNote, packages: tuple[str, ...], task: Any, task_args: tuple) -> None:
    """The server's loop: load the app, then fork ``task(spec, *task_args)`` for each spec the runtime sends."""
    try:
        load_app(note.app_dir, packages)
    except Exception as exc:  # noqa: BLE001 - a FAB that cannot load here still runs as Flower runs it
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    gc.freeze()  # its children never scan what it loaded (device_runtime's design notes)
    conn.send(("ready", os.getpid()))
    running: set[int] = set()
    while True:
        if conn.poll(REAP_S):
            try:
                kind, spec = conn.recv()
            except (EOFError, OSError):
                return  # the runtime is gone: its tasks end by Flower's parent monitor
            if kind == "stop":
                return
            pid = os.fork()
            if pid == 0:
                conn.close()
                _run_forked(task, (spec, *task_args))
            running.add(pid)
            conn.send(("started", pid))
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                conn.send(("ended", (pid, os.waitstatus_to_exitcode(status))))


def _run_forked(task: Any, args: tuple) -> None:
    """The task in the forked child, which then exits with its code as a multiprocessing child would."""
    code = 1
    try:
        task(*args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:  # noqa: BLE001 - a task's crash ends the task alone
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


@dataclass
class AppServer:
    """The runtime's handle on one app server: its pipe, and its tasks' ends as it reports them."""

    note: AppNote
    process: Any
    conn: Any
    ended: dict[int, int] = field(default_factory=dict)  # pid -> exit code, as the server reaped it

    @classmethod
    def start(cls, context: Any, note: AppNote, packages: tuple[str, ...], task: Any, task_args: tuple) -> AppServer:
        """The server forked from ``context``'s warm fork server; ready once its :meth:`ready` says so."""
        ours, theirs = context.Pipe()
        process = context.Process(
            target=serve_app, args=(theirs, note, packages, task, task_args), name="app-server", daemon=True
        )
        process.start()
        theirs.close()
        return cls(note, process, ours)

    def ready(self, timeout: float) -> str | None:
        """None once the app is loaded; else why this server cannot serve (it failed, died or did not answer)."""
        reply = self._next(timeout)
        if reply is None or reply[0] != "ready":
            self.stop()
            return "it did not start in time" if reply is None else str(reply[1])
        return None

    def launch(self, spec: Any) -> int | None:
        """Fork ``spec``'s task here: its pid, or None when the server did not answer in time (it is stopped)."""
        try:
            self.conn.send(("task", spec))
        except (OSError, ValueError):
            self.stop()
            return None
        while (reply := self._next(LAUNCH_S)) is not None and reply[0] != "started":
            pass
        if reply is None:
            self.stop()
            return None
        return int(reply[1])

    def poll(self) -> None:
        """Take in every end the server has reported."""
        while self._next(0) is not None:
            pass

    def alive(self) -> bool:
        return self.process.is_alive() and not self.conn.closed

    def _next(self, timeout: float) -> tuple | None:
        """The server's next message within ``timeout`` (ends recorded as they come), None if none came."""
        try:
            if self.conn.closed or not self.conn.poll(timeout):
                return None
            reply = self.conn.recv()
        except (EOFError, OSError):
            self.conn.close()
            return None
        if reply[0] == "ended":
            pid, code = reply[1]
            self.ended[pid] = code
        return reply

    def stop(self) -> None:
        """End the server; tasks it forked finish on their own (Flower's heartbeat and parent monitor)."""
        with contextlib.suppress(OSError, ValueError):
            if not self.conn.closed:
                self.conn.send(("stop", None))
        self.process.join(timeout=2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=2)
        with contextlib.suppress(OSError):
            self.conn.close()


@dataclass
class ServedChild:
    """A task forked by an app server, seen by the runtime as multiprocessing's own children are."""

    server: AppServer
    pid: int

    def is_alive(self) -> bool:
        self.server.poll()
        if self.pid in self.server.ended:
            return False
        if not self.server.alive():  # its server is gone: the task's own liveness is all that is left
            return _pid_running(self.pid)
        return True

    def join(self) -> None:
        return None

    @property
    def exitcode(self) -> int | None:
        return self.server.ended.get(self.pid)


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

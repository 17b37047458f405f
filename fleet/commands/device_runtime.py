"""``fleet device runtime``: a warm process that serves a SuperNode's tasks without a fresh interpreter each.

Flower's SuperNode starts a new ``flwr-clientapp`` process for every message (its SuperExec's subprocess
executor), and that process ends after its one message. A device therefore pays Python's start and the
import of torch, torchvision and flwr on every message: about 3 CPU-seconds on this project's development
machine, 20 seconds of a Raspberry Pi-class core, before any of its own work.

This command is that SuperExec with one change: its executor forks each task from a warm process instead of
starting a new program. It runs beside ``flower-supernode --isolation process``, polls the SuperNode's
Runtime API for tasks (Flower's own loop, ``run_superexec``), and hands each task, with Flower's per-task
token, to a child forked from a Python standard-library fork server that has imported the heavy libraries
once. The child then does exactly what ``flwr-clientapp`` does (``run_clientapp``): pulls the message, installs
the FAB, loads the ClientApp from it, runs it and pushes the reply.

Design notes:

* **Fork server, not fork of the poller.** The poller holds threads and HTTP connections; forking a threaded
  process can inherit a held lock. ``multiprocessing``'s fork server is a separate single-threaded process that
  only imports (``PRELOAD``) and forks, and is restarted if it dies.
* **The fork server never preloads the app's own code.** Its child drops every module of the app's packages
  (``APP_PACKAGES``) before loading the ClientApp, so each task imports fleet from its run's FAB, as
  ``flwr-clientapp`` would: a new app version is picked up by the next task.
* **The app stays imported, per FAB.** Importing the app from the FAB is itself 0.2 CPU-seconds of every
  message. So each task notes the FAB it installed, and between tasks the runtime starts an app server for it
  (:mod:`fleet.commands.app_server`): a child of the fork server that imports that FAB's app once and forks
  the next tasks from itself. A task of another FAB drops those modules and imports its own, and the server
  is replaced once no task is running. A server that fails, dies or stops answering only sends tasks back to
  the fork server.
* **What the fork server loaded is never scanned again.** A child starts with every object of torch, flwr and
  numpy that the fork server imported, and Python's cyclic collector walks them all whenever its oldest
  generation is due: 0.15 of the 0.28 CPU-seconds a ResNet-18 device spent between loading its app and
  training went to such scans, on the development machine (0.75 s at a fifth of a core). The child freezes
  what it inherits (``gc.freeze``) as it starts, and the app's modules once loaded; the objects made after
  that (the task's own) are collected as usual, and the child ends with its one message. Freezing also keeps
  the collector from writing to the inherited pages, so they stay shared with the fork server.
* **A task takes each object as it lands.** ``fleet device supernode`` pulls a message's objects one at a
  time, in the order of Flower's object tree, and stores each as it lands; the child pulls them in the same
  order with one poller, looking for the next every ``READY_POLL_S`` (Flower's own retries would back off to
  10 s), so it copies and checks each chunk while the next downloads, and the wait costs a few requests a
  second. Under Flower's own SuperNode, which stores them all at once, the same pull simply waits for the
  first.
* **A child is only a task.** A child that crashes, is OOM-killed or hangs ends alone; Flower's task heartbeat
  tells the SuperNode, and the server counts the device as missed with its reason. The children are forked in
  the daemon's cgroup, so their memory counts within the device's limit.
* **A stopped task still replies.** Flower's SuperNode serves one message at a time and waits for its reply
  before it pulls the next. A ``flwr-clientapp`` stopped by a signal (SIGTERM when its service restarts,
  SIGINT from Flower's parent monitor when the runtime above it dies) reports its task failed but sends no
  reply, and the SuperNode then waits forever: the device is lost to the run. So here a task that ends without
  its reply sends an error reply naming why first (the server counts the device as missed, with that reason),
  and one stopped before it pulled its message reports nothing, so that Flower's heartbeat expiry hands the
  task back to the next runtime. A child killed outright (SIGKILL, the OOM killer) is Flower's expiry case:
  an error reply once its heartbeat lapses.
* **What the app freed goes back before its reply is copied out.** glibc keeps the pages of freed tensors in
  its heap, and Flower's push serializes the reply in the task while the SuperNode stores it: on a 1,202 MB
  pi4 that was the device's peak, and the kernel killed tasks that had just replied. The task trims its heap
  (:func:`fleet.base.malloc.release_freed`) right before the push: about 300 MB of a ResNet-18 train task's
  800-850 MB.
* **The state is written once the reply is out.** A task's device state (up to 22 MB, fsynced) was made and
  written before its reply, 0.44 s of a FedAvg pi4's round at a fifth of a core, while the same device's CPU
  idles as its reply crosses its uplink. The runtime marks each task (``HOLD_WRITES_ENV``): the app holds the
  write under its lock, and the task makes it right after its push. A next message that reads the state waits
  for that lock; a task killed between its reply and its write keeps the previous state
  (:mod:`fleet.federated.on_device.state_lock`).
* **A message is prepared while its bytes come.** A task learns its context (run and node config) before its
  message's bytes, which take seconds to cross a device's downlink while its core mostly waits; what the
  message then needs besides them (the device's data, its state from disk, its model's storage, its profile
  and memory plan) took a pi4 0.5 s after they were in. So a task of the app server's own FAB calls the
  ClientApp module's ``prepare(context)`` (``PREPARE_HOOK``) between the two, and the message finds it made.
  A hook that fails changes nothing: the message makes it all again and meets the same problem.
* **No polls while a task runs.** Flower's SuperExec asks the SuperNode for a task every ``--poll-s``, a
  request its HTTP server answers, whether or not a task runs: on a testbed pi4 the two processes spent 0.02
  CPU-seconds a second on it, a tenth of the device's core, through every task's training. A SuperNode serves
  one message at a time and takes the next only once the task has replied, so while a task runs the runtime
  asks at most every ``BUSY_POLL_S`` and looks at its children meanwhile; once the task ends it asks at once.
* **An installed FAB is not unpacked again.** A FAB whose SHA-256 names an app directory that already holds
  its ``pyproject.toml`` is that app: Flower's own install returns that directory without copying anything
  (``validate_and_install``), after unzipping and checking the whole FAB to a temporary folder first. The
  child skips the unzipping, and installs exactly as Flower does when the directory is not there.
* **Flower internals.** It uses flwr's ``run_superexec``, its ``Executor`` protocol, ``run_clientapp`` and its install
  (pinned: pyproject.toml); ``tests/test_device_runtime.py`` names the missing one if they change.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.base.malloc import release_freed
from fleet.base.process import HOLD_WRITES_ENV, PULL_ENV
from fleet.commands.app_server import (
    AppNote,
    AppServer,
    ServedChild,
    drop_app_modules,
    loaded_hook,
    read_note,
    write_note,
)
from server.inflate import lean_inflate

# What every task imports: loaded once in the fork server (torch alone is most of a ClientApp's start). The second
# line is what a task still imported on its own, found by listing a testbed task's new modules: Flower's HTTP
# client imports httpcore and h11 as it connects, numpy.unique imports numpy.ma, torch.load its serialization
# config, a data folder's first read PIL's PNG plugin (on a pi4, 0.2-0.4 s of a message's wall time).
PRELOAD = ("numpy", "yaml", "torch", "torchvision", "PIL.Image", "flwr.app", "flwr.supernode.runtime.run_clientapp")
PRELOAD += ("httpcore", "h11", "numpy.ma", "torch.utils.serialization", "PIL.PngImagePlugin")
APP_PACKAGES = ("fleet", "client", "server")  # the FAB's packages (pyproject's fab-include): loaded per FAB, not here
READY_POLL_S = 0.1  # how often a task looks whether its message is in: the SuperNode stores it all at once
APP_START_S = 120.0  # how long an app server may take to import the app (a second or two at a fifth of a core)
BUSY_POLL_S = 1.0  # while a task runs, the SuperNode is asked for the next at most this often (design note)
CHILD_CHECK_S = 0.05  # how often a running task is looked at meanwhile: a waitpid, no request
POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"  # Flower's SuperExec reads its poll interval from here
PREPARE_HOOK = "prepare"  # the ClientApp module's function that makes a message's needs while its bytes download
STATE_LOCK_MODULE = "fleet.federated.on_device.state_lock"  # where the app holds the device state's writes
log = logging.getLogger("fleet.device_runtime")


def serve_task(spec: Any, note: str | None = None, loaded: str | None = None) -> None:
    """One task in a child of the fork server or of an app server: ``flwr-clientapp``'s work, on the preloaded
    libraries. ``note``: where it tells the runtime which FAB it installed; ``loaded``: the hash of the FAB whose
    app its parent (an app server) has imported, which it keeps if its own FAB is that one."""
    gc.freeze()  # design note: what the fork server loaded is never scanned again
    os.environ[HOLD_WRITES_ENV] = "1"  # design note: the state is written once the reply is out
    if loaded is None:
        drop_app_modules(APP_PACKAGES)  # the FAB's copy of fleet is imported by the ClientApp, not the daemon's
    if spec.suppress_output:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    from flwr.supernode.runtime import run_clientapp as flower_task

    lean_inflate()  # the message's arrays rebuilt from their chunks with one copy, not three (server.inflate)
    owe_reply(flower_task)
    if loaded is not None:
        prepare_while_pulling(flower_task, loaded)
    pull_when_ready(flower_task)
    install_once(flower_task, note, loaded)
    frozen_once_loaded(flower_task)
    certificates = None
    if not spec.insecure and spec.root_certificates_path is not None:
        certificates = Path(spec.root_certificates_path).read_bytes()
    flower_task.run_clientapp(
        runtime_api_address=spec.runtime_api_address,
        token=spec.token,
        insecure=spec.insecure,
        certificates=certificates,
        parent_pid=spec.parent_pid,
        runtime_dependency_install=spec.runtime_dependency_install,
    )


STOPPED = "the device's runtime stopped this task before it replied ({details}); the device serves the next one"


def owe_reply(flower_task: Any) -> None:
    """Flower's task steps wrapped in this child: its pull timed (``ready_s`` leaves the download out), and a
    task that ends without its reply made to send one (design note: a stopped task still replies)."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common.constant import ErrorCode

    pull, push, output = flower_task.pull_task_input, flower_task.push_message, flower_task.push_task_output
    task: dict[str, Any] = {}  # the message once pulled; whether its reply went out

    def timed_pull(client: Any) -> Any:
        started = time.perf_counter()
        got = pull(client)
        os.environ[PULL_ENV] = f"{time.perf_counter() - started:.6f}"
        task["message"] = got[0]
        return got

    def noted_push(client: Any, message: Any, context: Any) -> None:
        release_freed()  # design note: what the app freed goes back before its reply is copied out
        push(client, message, context)
        task["replied"] = True
        write_held_state()

    def owed_output(client: Any, context: Any, sub_status: str, details: str) -> None:
        if not task.get("replied"):
            if "message" not in task:
                return  # not pulled: left to Flower's heartbeat expiry, which hands the task to the next runtime
            error = Error(ErrorCode.CLIENT_APP_CRASHED, STOPPED.format(details=details))
            try:
                noted_push(client, Message(error, reply_to=task["message"]), context)
            except Exception as exc:  # noqa: BLE001 - the SuperNode still learns of the end from the task's status
                log.warning("could not send the stopped task's error reply: %s", exc)
        output(client, context, sub_status, details)

    flower_task.pull_task_input, flower_task.push_message = timed_pull, noted_push
    flower_task.push_task_output = owed_output


def write_held_state() -> None:
    """The device state the task's app held back, written now that its reply is out (design note: the state is
    written once the reply is out). The app is the FAB's copy of fleet, so its module is found by name."""
    state_lock = sys.modules.get(STATE_LOCK_MODULE)
    write_held = getattr(state_lock, "write_held", None)
    if callable(write_held):
        write_held()


def prepare_while_pulling(flower_task: Any, loaded: str) -> None:
    """The app's ``prepare`` hook called with the task's context before its message's bytes are pulled, when
    the task's FAB is the one its app server imported (design note: a message is prepared while its bytes
    come). A hook that fails only leaves the work to the message, which reports what is wrong itself."""
    hook = loaded_hook(PREPARE_HOOK)
    if hook is None:
        return
    pull = flower_task.pull_task_input

    def prepare(task_input: Any) -> None:
        if task_input.fab.hash_str != loaded:
            return  # another version than its app server's: it imports its own app, which prepares nothing
        try:
            hook(flower_task.context_from_proto(task_input.context))
        except Exception as exc:  # noqa: BLE001 - the message meets the same problem and replies with it
            log.info("the device's next message was not prepared ahead: %s", exc)

    flower_task.pull_task_input = lambda client: pull(_PreparingClient(client, prepare))


class _PreparingClient:
    """A task's Runtime API client that, between the task's input (its context) and its message's bytes, calls
    ``prepare`` with that input; every other call is the client's."""

    def __init__(self, client: Any, prepare: Any) -> None:
        self._client, self._prepare, self._input = client, prepare, None

    def PullTaskInput(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - Flower's name
        self._input = self._client.PullTaskInput(*args, **kwargs)
        return self._input

    def PullMessages(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - Flower's name
        task_input, self._input = self._input, None
        if task_input is not None:
            self._prepare(task_input)
        return self._client.PullMessages(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def pull_when_ready(flower_task: Any) -> None:
    """The task's pull takes each object of its message as it lands, by one light poll (design note: a task
    takes each object as it lands). Flower hands a task out as soon as its message starts to arrive and pulls
    every object of it in parallel, each retried after 1, 2, 4 ... up to 10 s: the task then began its pull, on
    average, seconds after the SuperNode had the whole message (2.1 s of a pi4's 32 s round)."""
    pull_tree = flower_task.pull_and_inflate_object_from_tree

    def pulled_when_ready(object_tree: Any, pull_object_fn: Any, *args: Any, **kwargs: Any) -> Any:
        one_by_one = {"initial_backoff": READY_POLL_S, "backoff_cap": READY_POLL_S, "max_concurrent_pulls": 1}
        return pull_tree(object_tree, pull_object_fn, *args, **{**kwargs, **one_by_one})

    flower_task.pull_and_inflate_object_from_tree = pulled_when_ready


def install_once(flower_task: Any, note: str | None = None, loaded: str | None = None) -> None:
    """The task's FAB installed only when no app directory holds it yet (design note: an installed FAB is not
    unpacked again). Flower unzips and re-verifies the FAB on every message, then returns the directory an
    earlier message installed it to without copying anything: about 0.1 CPU-second of each message. The
    installed FAB is noted for the runtime (``note``), and an app loaded for another FAB (``loaded``) dropped."""
    import hashlib

    from flwr.common.config import get_project_dir

    pull, install = flower_task.pull_task_input, flower_task.install_from_fab
    pulled: dict[str, Any] = {}

    def noted_pull(client: Any) -> Any:
        got = pull(client)
        pulled["run"], pulled["fab"] = got[2], got[3]
        return got

    def installed_or_install(fab_file: Any, *args: Any, **kwargs: Any) -> Any:
        run, fab = pulled.get("run"), pulled.get("fab")
        vouched = (
            run is not None and isinstance(fab_file, bytes) and hashlib.sha256(fab_file).hexdigest() == fab.hash_str
        )
        path = get_project_dir(run.fab_id, run.fab_version, fab.hash_str) if vouched else None
        if path is None or not (path / "pyproject.toml").is_file():
            path = install(fab_file, *args, **kwargs)
        if loaded is not None and loaded != (fab.hash_str if vouched else None):
            drop_app_modules(APP_PACKAGES)  # another version than its app server's: imported from its own FAB
        if note is not None and vouched:
            with contextlib.suppress(OSError):
                write_note(note, AppNote(fab.hash_str, str(path)))
        return path

    flower_task.pull_task_input, flower_task.install_from_fab = noted_pull, installed_or_install


def frozen_once_loaded(flower_task: Any) -> None:
    """The ClientApp's modules, once loaded, left out of the collector's scans too (design note: what the fork
    server loaded is never scanned again)."""
    get_loader = flower_task.get_load_client_app_fn

    def frozen_loader(*args: Any, **kwargs: Any) -> Any:
        load = get_loader(*args, **kwargs)

        def load_and_freeze(*load_args: Any) -> Any:
            app = load(*load_args)
            gc.freeze()
            return app

        return load_and_freeze

    flower_task.get_load_client_app_fn = frozen_loader


@dataclass
class ForkExecutor:
    """Flower's SuperExec ``Executor`` protocol, launching each task as a child of a warm fork server."""

    context: Any = field(default_factory=lambda: multiprocessing.get_context("forkserver"))
    children: dict[int, Any] = field(default_factory=dict)  # task id -> its child process
    notes: str = ""  # the folder a task notes its installed FAB in (design note: the app stays imported)
    app: AppServer | None = None  # the server that keeps the last noted FAB's app imported, once started
    refused: set[str] = field(default_factory=set)  # FABs whose app server could not start: not tried again

    def start(self) -> ForkExecutor:
        """The fork server up and its imports done now, so the first task finds it warm."""
        self.context.set_forkserver_preload(list(PRELOAD))
        from multiprocessing import forkserver

        forkserver.ensure_running()
        self.notes = tempfile.mkdtemp(prefix="fleet-runtime-")
        return self

    @property
    def note(self) -> str:
        return os.path.join(self.notes, "installed.json")

    def get_eligible_capacity(self, supported_task_types: set, **_: Any) -> tuple[set, set[str]]:
        """Every task type: a fork has no capacity gate, like Flower's subprocess executor. Flower asks this
        before each poll for a task, so here the poll waits while a task runs (design note: no polls while
        a task runs)."""
        self.wait_while_busy()
        return supported_task_types, set()

    def wait_while_busy(self) -> None:
        """Return once no task runs, or after ``BUSY_POLL_S``, looking every ``CHILD_CHECK_S`` (a local check)."""
        end = time.monotonic() + BUSY_POLL_S
        while time.monotonic() < end and self.busy():
            time.sleep(CHILD_CHECK_S)

    def busy(self) -> bool:
        """Whether a task this runtime launched is still running."""
        if self.app is not None:
            self.app.poll()
        return any(child.is_alive() for child in self.children.values())

    def wait_for_capacity(self, *_: Any, **__: Any) -> None:
        return None

    def launch(self, spec: Any) -> Any:
        from flwr.supercore.superexec.executor.types import LaunchResult

        if self.app is not None:
            pid = self.app.launch(spec) if self.app.alive() else None
            if pid is not None:
                self.children[spec.task_id] = ServedChild(self.app, pid)
                return LaunchResult.accepted()
            log.warning("the app server stopped answering; tasks are forked from the plain fork server")
            self.refused.add(self.app.note.fab_hash)  # not started again for this FAB
            self.app.stop()
            self.app = None
        try:
            child = self.context.Process(target=serve_task, args=(spec, self.note), name=f"task-{spec.task_id}")
            child.start()
        except OSError as exc:  # the fork failed (out of memory, too many processes): Flower's expiry applies
            return LaunchResult.failed(f"could not fork the task: {exc}")
        self.children[spec.task_id] = child
        return LaunchResult.accepted()

    def refresh_app(self) -> None:
        """Between tasks, an app server for the FAB the last task installed, when it differs from the one
        running (design note: the app stays imported)."""
        note = read_note(self.note) if self.notes else None
        if note is None or note.fab_hash in self.refused or (self.app is not None and self.app.note == note):
            return
        if any(child.is_alive() for child in self.children.values()):
            return
        if self.app is not None:
            self.app.stop()
        self.app = AppServer.start(self.context, note, APP_PACKAGES, serve_task, (self.note, note.fab_hash))
        why = self.app.ready(APP_START_S)
        if why is None:
            log.info("the app of FAB %s is imported once: tasks are forked from its app server", note.fab_hash[:8])
        else:
            log.warning(
                "the app of FAB %s stays imported per task: its app server did not start (%s)", note.fab_hash[:8], why
            )
            self.refused.add(note.fab_hash)
            self.app = None

    def reconcile(self) -> None:
        """Reap finished children; one line for a child that died by a signal (a crash, the OOM killer). Only
        after a task has ended can there be a new note, so only then is the app server looked at: Flower calls
        this on every poll."""
        ended = [task_id for task_id, child in self.children.items() if not child.is_alive()]
        for task_id in ended:
            child = self.children.pop(task_id)
            child.join()
            if child.exitcode is not None and child.exitcode < 0:
                log.warning("task %d: its process was killed by signal %d", task_id, -child.exitcode)
        if ended:
            self.refresh_app()

    def close(self) -> None:
        """Children end with the daemon (Flower's parent monitor in each); reap what has ended."""
        self.reconcile()
        if self.app is not None:
            self.app.stop()
        shutil.rmtree(self.notes, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    """Flower's SuperExec loop with the fork executor in place of its subprocess one."""
    from flwr.supercore.address import parse_address
    from flwr.supercore.auth import load_superexec_auth_secret
    from flwr.supercore.superexec import run_superexec as superexec

    from fleet.base.errors import FleetError

    if parse_address(args.runtime_api_address) is None:  # unreachable is retried; malformed can never work
        raise FleetError(
            f"--runtime-api-address: {args.runtime_api_address!r} is not HOST:PORT; use the SuperNode's, "
            "e.g. 127.0.0.1:9094"
        )
    try:
        secret = load_superexec_auth_secret(args.superexec_auth_secret_file)
    except ValueError as exc:
        raise FleetError(f"--superexec-auth-secret-file: {exc}") from None
    if args.root_certificates is not None and not Path(args.root_certificates).is_file():
        raise FleetError(f"--root-certificates: no file at {args.root_certificates}")
    os.environ[POLL_ENV] = str(args.poll_s)
    executor = ForkExecutor().start()
    superexec.get_executor = lambda *_, **__: executor  # the one seam: which executor the loop launches with
    print(f"fleet device runtime: serving {args.runtime_api_address} (pid {os.getpid()})", flush=True)
    superexec.run_superexec(
        runtime_api_address=args.runtime_api_address,
        insecure=args.insecure,
        root_certificates_path=args.root_certificates,
        superexec_auth_secret=secret,
        parent_pid=args.parent_pid,
    )
    return 0


def poll_seconds(text: str) -> float:
    """--poll-s: a number of seconds Flower's SuperExec accepts (0.01 to 60)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (e.g. 0.2)") from None
    if not 0.01 <= value <= 60:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"{text} is outside 0.01 to 60 seconds")
    return value


def register(device_sub: argparse._SubParsersAction) -> None:
    p = device_sub.add_parser(
        "runtime",
        help="serve a SuperNode's tasks from a warm process (beside flower-supernode --isolation process)",
    )
    p.add_argument(
        "--runtime-api-address",
        default="127.0.0.1:9094",
        help="the SuperNode's Runtime API (flower-supernode --runtime-api-address; default %(default)s)",
    )
    tls = p.add_mutually_exclusive_group(required=True)
    tls.add_argument("--insecure", action="store_true", help="the Runtime API without TLS (it listens on loopback)")
    tls.add_argument("--root-certificates", help="the CA that signed the Runtime API's certificate")
    p.add_argument("--superexec-auth-secret-file", help="the secret the SuperNode checks SuperExec requests with")
    p.add_argument("--parent-pid", type=int, help="exit when this process (e.g. the SuperNode) exits")
    p.add_argument(
        "--poll-s",
        type=poll_seconds,
        default=0.2,
        help="seconds between task polls: Flower's default of 1 s delays every message by half of it on average",
    )
    p.set_defaults(func=run)

"""A device's state, written after its reply has gone, under a lock that every reader honours.

Design notes:

* **Why write later.** Writing a device's state (a few MB, fsynced so that a crash keeps it) took
  0.033 s of each train message, in the path of its reply. A simulation worker serves hundreds of
  devices a run, one after another: that time only delays the next device.
* **Lock first, write later.** The writer takes the exclusive lock on ``<state>.lock`` *before* the
  reply is handed back, and lets it go once the new file is in place. A reader (the device's next
  message, in this or any other worker process) takes the shared lock, so it waits for the write
  instead of reading the previous round's state. ``flock`` locks belong to an open file, so two opens
  in one process exclude each other as two processes do, and a dead process's lock is released.
* **Who defers.** A long-lived process: a simulation worker, on its writer thread. And a task of ``fleet device
  runtime``, which ends after its one message: the runtime marks its process (``HOLD_WRITES_ENV``), its writes
  are held, and the runtime makes them once the reply has gone out to the SuperNode (:func:`write_held`, by
  this module's name: the task runs the FAB's copy of fleet, not the runtime's), while the reply crosses the
  device's uplink. On a testbed pi4 at a fifth of a core, making and writing a FedAvg device's state was
  0.44 s of wall time before its reply, when every CPU-second is five; during the upload its CPU idles. A
  task of Flower's own ``flwr-clientapp`` holds nothing: its write stays in line.
* **One writer thread per process**, fed by a queue, for the process's life, and the bytes made before the
  reply (:func:`fleet.federated.on_device.device.save_state`). A thread per write, casting and serializing on its own,
  raised a worker's peak memory in the scale bench from 1.86 to 2.25 GiB at 8 devices; this way it is 1.97
  (and 0.3-0.5 GiB below a thread per write at 64 to 1,000 devices). The thread is a daemon, and an
  exiting process waits for its queue.
* **A held write is made whole after the reply.** Its bytes too, so the state's tensors stay the task's through
  its push (a FedAvg ResNet-18's momentum: 45 MB); on the testbed's 1,202 MB pi4s no task was killed for it
  (docs/testbed.md, "A pi4's CPU, sampled"). A task killed after its reply and before its write keeps the
  previous state, as one killed mid-write does.
* **A crash.** The write itself is atomic (:func:`fleet.base.atomic.write_atomic`): a process killed
  mid-write leaves the previous state, as before. A write that fails (a full disk) is logged with the
  state's path; the device then trains from its previous state next time.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from fleet.base.process import HOLD_WRITES_ENV

log = logging.getLogger(__name__)
_QUEUE: queue.Queue[tuple[Path, Callable[[], object], int]] = queue.Queue()  # writes this process deferred
_WRITER: list[threading.Thread] = []  # the process's writer thread, once started
_HELD: list[tuple[Path, Callable[[], object], int]] = []  # writes a runtime's task holds until its reply is out


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _open_lock(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(lock_path(path), os.O_RDWR | os.O_CREAT, 0o644)


@contextmanager
def reading(path: Path) -> Iterator[None]:
    """Hold the shared lock of ``path``'s state: no write of it is under way meanwhile."""
    if not path.parent.is_dir():  # nothing was ever written: nothing to wait for (and no folder to make)
        yield
        return
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def write_locked(path: Path, write: Callable[[], object], *, defer: bool) -> None:
    """Run ``write`` (which replaces ``path``) under the exclusive lock of ``path``: now, or with ``defer``
    on a thread (held for :func:`write_held` in a runtime's task), the lock taken before this returns."""
    fd = _open_lock(path)
    fcntl.flock(fd, fcntl.LOCK_EX)
    if not defer:
        try:
            write()
        finally:
            os.close(fd)
        return
    if writes_held():
        _HELD.append((path, write, fd))
        return
    _writer()
    _QUEUE.put((path, write, fd))


def writes_held() -> bool:
    """Whether this process's deferred writes wait for :func:`write_held` (design note: who defers)."""
    return os.environ.get(HOLD_WRITES_ENV) == "1"


def write_held() -> None:
    """Make every held write now, in this thread (a runtime's task, once its reply is out)."""
    while _HELD:
        _write_one(*_HELD.pop(0))


def _writer() -> None:
    """Start this process's writer thread, once (a forked child starts its own: it has no thread)."""
    if _WRITER and _WRITER[0].is_alive():
        return
    thread = threading.Thread(target=_write_forever, name="device-state-writer", daemon=True)
    _WRITER[:] = [thread]
    thread.start()


def _write_forever() -> None:
    while True:
        try:
            _write_one(*_QUEUE.get())
        finally:
            _QUEUE.task_done()


def _write_one(path: Path, write: Callable[[], object], fd: int) -> None:
    try:
        write()
    except Exception as exc:  # after the reply: nobody to raise to
        log.warning("device state %s was not written (%s: %s); the previous one stays", path, type(exc).__name__, exc)
    finally:
        os.close(fd)  # releases the lock


def wait_for_writes() -> None:
    """Return once every write this process deferred is done (held ones made here)."""
    write_held()
    _QUEUE.join()


atexit.register(wait_for_writes)  # the writer is a daemon: an exiting process finishes its writes first

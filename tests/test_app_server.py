"""The runtime's app server (fleet.commands.app_server): a warm process that keeps one FAB's app imported and
forks each task from itself. Real processes, a real fork server; the task here is a stand-in for Flower's."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
import types
from pathlib import Path

import pytest

from fleet.commands.app_server import AppNote, AppServer, ServedChild, read_note, write_note

HASH = "ab" * 32
PYPROJECT = """[project]
name = "demoapp"
version = "1.0.0"

[tool.flwr.app]
publisher = "fleet"

[tool.flwr.app.components]
serverapp = "demoapp.client:app"
clientapp = "demoapp.client:app"
"""


def record_task(spec, out: str, loaded: str) -> None:
    """What a task finds when forked: the app already imported, from the FAB's folder."""
    if spec.mode == "crash":
        os.abort()
    if spec.mode == "exit3":
        sys.exit(3)
    module = sys.modules.get("demoapp.client")
    found = {"loaded": module is not None, "file": getattr(module, "__file__", None), "hash": loaded}
    Path(out, f"{spec.task_id}.json").write_text(json.dumps(found))


def app_dir(tmp_path: Path, body: str = "app = 'the app'\n") -> Path:
    root = tmp_path / "fab"
    (root / "demoapp").mkdir(parents=True)
    (root / "demoapp" / "__init__.py").write_text("")
    (root / "demoapp" / "client.py").write_text(body)
    (root / "pyproject.toml").write_text(PYPROJECT)
    return root


def ended(child: ServedChild, within: float = 30) -> int | None:
    deadline = time.monotonic() + within
    while child.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    return child.exitcode


def test_tasks_forked_from_the_app_server_find_the_app_imported_and_a_crash_ends_only_its_task(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    note = AppNote(HASH, str(app_dir(tmp_path)))
    server = AppServer.start(
        multiprocessing.get_context("forkserver"), note, ("demoapp",), record_task, (str(out), HASH)
    )
    try:
        assert server.ready(60) is None
        pids = []
        for task_id, mode, code in ((1, "ok", 0), (2, "crash", -6), (3, "exit3", 3), (4, "ok", 0)):
            pid = server.launch(types.SimpleNamespace(task_id=task_id, mode=mode))
            assert pid is not None and pid != server.process.pid
            assert ended(ServedChild(server, pid)) == code, mode
            pids.append(pid)
        assert len(set(pids)) == 4 and server.alive()  # the crash ended its task alone
        for task_id in (1, 4):
            found = json.loads((out / f"{task_id}.json").read_text())
            assert found["loaded"] and found["file"].startswith(note.app_dir) and found["hash"] == HASH
    finally:
        server.stop()
    assert not server.process.is_alive() and server.launch(types.SimpleNamespace(task_id=5, mode="ok")) is None


def test_an_app_that_cannot_load_says_why_and_serves_nothing(tmp_path):
    note = AppNote(HASH, str(app_dir(tmp_path, body="raise ImportError('no such thing')\n")))
    server = AppServer.start(multiprocessing.get_context("forkserver"), note, ("demoapp",), record_task, ("", HASH))
    assert server.ready(60) == "ImportError: no such thing"
    assert not server.process.is_alive()


@pytest.mark.parametrize(
    "raw",
    ["", "not json", json.dumps({"fab_hash": "short", "app_dir": "."}), json.dumps({"app_dir": "."}), "[1, 2]"],
)
def test_a_note_that_is_not_a_hash_and_an_app_folder_is_ignored(tmp_path, raw):
    path = tmp_path / "installed.json"
    path.write_text(raw)
    assert read_note(str(path)) is None


def test_a_note_round_trips_only_for_an_installed_app(tmp_path):
    path, note = str(tmp_path / "installed.json"), AppNote(HASH, str(app_dir(tmp_path)))
    write_note(path, note)
    assert read_note(path) == note
    write_note(path, AppNote(HASH, str(tmp_path / "gone")))
    assert read_note(path) is None


class FakeServer:
    """An app server that records what the executor asks of it."""

    started: list = []

    def __init__(self, note, answers: bool = True) -> None:
        self.note, self.answers, self.stopped = note, answers, False

    @classmethod
    def start(cls, context, note, packages, task, task_args):
        server = cls(note)
        cls.started.append((note.fab_hash, task_args))
        return server

    def ready(self, timeout):
        return None

    def alive(self):
        return not self.stopped

    def launch(self, spec):
        return 4242 if self.answers else None

    def stop(self):
        self.stopped = True


def test_the_executor_starts_an_app_server_per_noted_fab_between_tasks_and_falls_back_when_it_fails(
    tmp_path, monkeypatch
):
    from fleet.commands import device_runtime

    monkeypatch.setattr(device_runtime, "AppServer", FakeServer)
    FakeServer.started = []
    executor = device_runtime.ForkExecutor(notes=str(tmp_path))
    executor.refresh_app()
    assert executor.app is None  # nothing noted yet: every task is forked from the plain fork server
    first, second = AppNote(HASH, str(app_dir(tmp_path / "a"))), AppNote("cd" * 32, str(app_dir(tmp_path / "b")))
    write_note(executor.note, first)
    executor.children[7] = types.SimpleNamespace(is_alive=lambda: True)
    executor.refresh_app()
    assert executor.app is None  # a task is running: replaced between tasks only
    executor.children[7] = types.SimpleNamespace(is_alive=lambda: False, join=lambda: None, exitcode=0)
    executor.reconcile()  # the task that noted its FAB has ended: its app server starts now
    assert executor.app.note == first and FakeServer.started == [(HASH, (executor.note, HASH))]
    assert not executor.children
    assert executor.launch(types.SimpleNamespace(task_id=8)).status == "accepted"
    assert executor.children[8].pid == 4242
    executor.children.clear()
    write_note(executor.note, second)  # a task of a new version noted its FAB
    old = executor.app
    executor.reconcile()
    assert executor.app is old  # no task ended since: the note is not read on every poll
    executor.refresh_app()
    assert old.stopped and executor.app.note == second
    executor.app.answers = False  # stops answering: the task goes to the fork server, this FAB is not retried
    monkeypatch.setattr(executor.context, "Process", lambda **kw: types.SimpleNamespace(start=lambda: None, **kw))
    assert executor.launch(types.SimpleNamespace(task_id=9)).status == "accepted"
    assert executor.app is None and executor.children[9].target is device_runtime.serve_task
    executor.refresh_app()
    assert executor.app is None and second.fab_hash in executor.refused

"""A device's state written after its reply: readers in any process wait for the write, never read the old."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fleet.base.atomic import write_text_atomic
from fleet.base.process import HOLD_WRITES_ENV
from fleet.federated.on_device.state_lock import reading, wait_for_writes, write_locked, writes_held

READER = """
import sys
from pathlib import Path
from fleet.federated.on_device.state_lock import reading
path = Path(sys.argv[1])
(path.parent / "reader-ready").touch()
with reading(path):
    print(path.read_text())
"""


def once_reader_waits(marker: Path, write):
    """``write``, once the reader process says it is about to read, and a moment later (it is then waiting)."""

    def delayed() -> None:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        write()

    return delayed


def slow_write(path: Path, text: str, started: threading.Event | None = None, delay_s: float = 0.6):
    def write() -> None:
        if started is not None:
            started.set()
        time.sleep(delay_s)  # a write under way while a reader arrives
        write_text_atomic(path, text)

    return write


def test_a_reader_in_another_process_waits_for_a_deferred_write_and_reads_the_new_state(tmp_path):
    path = tmp_path / "device-3" / "state.pt"
    write_text_atomic(path, "round 1")
    marker = path.parent / "reader-ready"
    write_locked(path, once_reader_waits(marker, slow_write(path, "round 2", delay_s=0)), defer=True)  # holds the lock
    assert path.read_text() == "round 1"  # the write is still under way: a reader without the lock sees the old
    out = subprocess.run([sys.executable, "-c", READER, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "round 2"
    wait_for_writes()


def test_a_reader_in_the_same_process_waits_too(tmp_path):
    path = tmp_path / "d" / "state.pt"
    write_text_atomic(path, "old")
    started = threading.Event()
    write_locked(path, slow_write(path, "new", started), defer=True)
    assert started.wait(10)
    with reading(path):  # another open of the lock file: flock excludes it as it would another process
        assert path.read_text() == "new"
    wait_for_writes()


def test_an_in_line_write_is_done_when_it_returns_and_a_first_read_needs_no_folder(tmp_path):
    path = tmp_path / "d" / "state.pt"
    with reading(path):  # the device never saved anything: nothing to wait for, no folder made
        assert not path.parent.exists()
    write_locked(path, slow_write(path, "now", delay_s=0.0), defer=False)
    assert path.read_text() == "now"


def test_a_failed_deferred_write_is_logged_keeps_the_old_state_and_releases_the_lock(tmp_path, caplog):
    path = tmp_path / "d" / "state.pt"
    write_text_atomic(path, "old")

    def fail() -> None:
        raise OSError(28, "No space left on device")

    with caplog.at_level(logging.WARNING, logger="fleet.federated.on_device.state_lock"):
        write_locked(path, fail, defer=True)
        wait_for_writes()
    assert f"device state {path} was not written (OSError" in caplog.text
    with reading(path):  # the lock is free again: this does not hang
        assert path.read_text() == "old"


def trained_once(tmp_path: Path, long_lived: bool):
    """A tiny fleet's device 0 after one train message of run "t": the device and its state file's path."""
    from fleet.engine.experiment import make_model
    from fleet.federated.on_device import tasks
    from fleet.federated.shared.config import load_fleet_config
    from fleet.federated.shared.records import TrainOrder

    cfg = load_fleet_config("simulations/fleet-tiny.yaml", {"output_dir": str(tmp_path)})
    device = tasks.Device.from_configs(cfg, {"partition-id": 0}, long_lived=long_lived)
    weights = {k: v.clone() for k, v in make_model(cfg.model, 0).state_dict().items()}
    config = TrainOrder(server_round=1, strategy="fleet", deadline_s=0.0, run_tag="t").to_config()
    tasks.train(device, weights, config)
    return device, device.state_dir / tasks.STATE_FILE


def test_a_device_of_a_simulation_worker_defers_and_its_next_message_reads_the_round(tmp_path):
    from fleet.federated.on_device import tasks

    device, state_path = trained_once(tmp_path, long_lived=True)
    assert device.long_lived and not tasks.Device.from_configs(device.cfg, {"partition-id": 0}).long_lived
    state = tasks.load_state(state_path, "t")  # waits for the write under way
    assert state is not None and state.round == 1 and state.rounds_trained == 1
    wait_for_writes()


def test_a_runtime_task_holds_its_write_until_its_reply_is_out_and_a_reader_waits_for_it(tmp_path, monkeypatch):
    """In a task of ``fleet device runtime`` (its process marked), no thread makes the write: it waits, under its
    lock, until the runtime makes it after the reply's push, and a reader in another process waits for it."""
    from fleet.commands.device_runtime import write_held_state

    monkeypatch.setenv(HOLD_WRITES_ENV, "1")
    path = tmp_path / "d" / "state.pt"
    write_text_atomic(path, "old")
    write_locked(path, slow_write(path, "new", delay_s=0.0), defer=True)
    time.sleep(0.3)
    assert writes_held() and path.read_text() == "old"  # held: nothing made it meanwhile
    marker = path.parent / "reader-ready"
    threading.Thread(target=once_reader_waits(marker, write_held_state)).start()  # the runtime, after its push
    out = subprocess.run([sys.executable, "-c", READER, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "new"


def test_a_runtime_tasks_device_state_is_made_after_its_reply(tmp_path, monkeypatch):
    from fleet.commands.device_runtime import write_held_state
    from fleet.federated.on_device import tasks

    monkeypatch.setenv(HOLD_WRITES_ENV, "1")
    _, state_path = trained_once(tmp_path, long_lived=False)
    assert not state_path.exists()  # the reply goes first
    write_held_state()
    state = tasks.load_state(state_path, "t")
    assert state is not None and state.round == 1 and state.rounds_trained == 1


@pytest.fixture(autouse=True)
def no_write_left_behind():
    yield
    wait_for_writes()

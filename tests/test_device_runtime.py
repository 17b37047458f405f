"""``fleet device runtime``: a SuperNode's tasks served by children of a warm fork server.

The fast tests pin the Flower internals the runtime stands on (each failure names the missing function in one
line) and its flags. The slow one runs a real deployment on loopback: a SuperLink, two SuperNodes in
``--isolation process`` each with its runtime, two rounds; then a task's child is killed mid-task and a
runtime is restarted, and the next rounds still count every device or name why it missed.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from fleet.base.process import PULL_ENV, task_pull_s
from fleet.commands import app_server, device_runtime
from fleet.federated.on_server.tracking import read_progress
from fleet.federated.shared.paths import APP_ROOT
from tests.conftest import cli_refusal
from tests.test_deploy_loopback import BIN, Loopback, free_port, tiny_deploy_config, wait_port
from tests.test_devices_loopback import trained

# module -> the names the runtime uses from it, with the parameters it passes
FLOWER_API = {
    "flwr.supercore.superexec.run_superexec": {
        "get_executor": (),
        "run_superexec": ("runtime_api_address", "insecure", "root_certificates_path", "superexec_auth_secret"),
    },
    "flwr.supernode.runtime.run_clientapp": {
        "run_clientapp": ("runtime_api_address", "token", "insecure", "certificates", "parent_pid"),
        "pull_task_input": ("client",),
        "context_from_proto": ("context_proto",),
        "push_message": ("client", "message", "context"),
        "push_task_output": ("client", "context", "sub_status", "details"),
        "pull_and_inflate_object_from_tree": ("object_tree", "pull_object_fn", "initial_backoff", "backoff_cap"),
        "install_from_fab": ("fab_file", "skip_prompt"),
        "get_load_client_app_fn": ("default_app_ref", "app_path", "multi_app"),
    },
    "flwr.common.config": {"get_project_dir": ("fab_id", "fab_version", "fab_hash")},
    "flwr.supercore.inflatable.inflatable_utils": {
        "pull_objects": ("object_ids", "pull_object_fn", "initial_backoff", "backoff_cap"),
    },
    "flwr.app.error": {"Error": ("code", "reason")},
    "flwr.supercore.superexec.executor.types": {"LaunchResult": (), "ExecutionSpec": ()},
    "flwr.supercore.auth": {"load_superexec_auth_secret": ("secret_file",)},
    "flwr.supercore.address": {"parse_address": ("address",)},
}
SPEC_FIELDS = ("runtime_api_address", "token", "insecure", "root_certificates_path", "parent_pid", "suppress_output")


def test_the_flower_internals_the_runtime_uses_are_there():
    import importlib

    for module_name, names in FLOWER_API.items():
        module = importlib.import_module(module_name)
        for name, params in names.items():
            assert hasattr(module, name), f"flwr changed: {module_name}.{name} is gone (fleet device runtime uses it)"
            missing = set(params) - set(inspect.signature(getattr(module, name)).parameters)
            assert not missing, f"flwr changed: {module_name}.{name} no longer takes {sorted(missing)}"
    from flwr.supercore.superexec.executor.types import ExecutionSpec

    missing = set(SPEC_FIELDS) - set(ExecutionSpec.__dataclass_fields__)
    assert not missing, f"flwr changed: ExecutionSpec no longer has {sorted(missing)}"
    from flwr.common.constant import ErrorCode

    assert hasattr(ErrorCode, "CLIENT_APP_CRASHED"), "flwr changed: ErrorCode.CLIENT_APP_CRASHED is gone"
    from flwr.supernode.runtime.run_clientapp import pull_task_input

    source = inspect.getsource(pull_task_input)
    first, then = source.find("client.PullTaskInput("), source.find("client.PullMessages(")
    assert 0 <= first < then, "flwr changed: pull_task_input no longer asks PullTaskInput, then PullMessages"


def fake_task(pull_fails: bool = False) -> tuple[types.SimpleNamespace, list]:
    """Flower's task steps as the child sees them, recording what reaches the SuperNode."""
    calls: list = []

    def pull(client):
        if pull_fails:
            raise RuntimeError("no message")
        return "message", "context", "run", "fab"

    return types.SimpleNamespace(
        pull_task_input=pull,
        push_message=lambda client, message, context: calls.append(("reply", message)),
        push_task_output=lambda client, context, sub_status, details: calls.append(("status", sub_status)),
    ), calls


class TaskInputClient:
    """Flower's Runtime API client as a task's pull uses it: its input (context, run, FAB), then its message."""

    def __init__(self, fab_hash: str, calls: list) -> None:
        self.fab_hash, self.calls = fab_hash, calls

    def PullTaskInput(self, request):  # noqa: N802 - Flower's name
        self.calls.append("input")
        fab = types.SimpleNamespace(hash_str=self.fab_hash)
        return types.SimpleNamespace(context="context proto", fab=fab)

    def PullMessages(self, request):  # noqa: N802 - Flower's name
        self.calls.append("messages")
        return "the message"

    def PullObject(self, request):  # noqa: N802 - Flower's name
        return "an object"


@pytest.mark.parametrize("hook_fails", [False, True])
def test_a_message_is_prepared_between_its_context_and_its_bytes_when_its_app_is_the_loaded_one(
    hook_fails, monkeypatch
):
    calls: list = []

    def prepare(context):
        calls.append(("prepare", context))
        if hook_fails:
            raise ValueError("no data here")

    monkeypatch.setitem(sys.modules, "a_client_app", types.SimpleNamespace(prepare=prepare))
    monkeypatch.setattr(app_server, "LOADED_MODULE", ["a_client_app"])

    def pull(client):  # Flower's pull_task_input, in the order it asks
        client.PullTaskInput("request")
        return client.PullMessages("request"), client.PullObject

    task = types.SimpleNamespace(pull_task_input=pull, context_from_proto=lambda proto: f"from {proto}")
    device_runtime.prepare_while_pulling(task, loaded="abc")
    message, pull_object = task.pull_task_input(TaskInputClient("abc", calls))
    assert calls == ["input", ("prepare", "from context proto"), "messages"]  # a failing hook: the pull goes on
    assert message == "the message" and pull_object("r") == "an object"  # every other call is the client's
    calls.clear()
    task.pull_task_input(TaskInputClient("another version", calls))
    assert calls == ["input", "messages"]  # a task of another FAB imports its own app: nothing prepared


def test_the_app_server_finds_the_clientapps_prepare_hook(monkeypatch):
    """The app server imports the ClientApp's module as the FAB's pyproject names it, and the hook the runtime
    calls is that module's ``prepare``."""
    monkeypatch.setattr(app_server, "LOADED_MODULE", [])
    monkeypatch.setattr(sys, "path", list(sys.path))
    app_server.load_app(str(APP_ROOT), ())  # no package dropped: the test's own imports stay as they are
    import client.client_app

    assert app_server.LOADED_MODULE == ["client.client_app"]
    assert app_server.loaded_hook(device_runtime.PREPARE_HOOK) is client.client_app.prepare
    assert app_server.loaded_hook("no_such_hook") is None


def test_a_task_stopped_before_its_reply_still_replies_so_the_supernode_serves_on(monkeypatch):
    monkeypatch.setenv(PULL_ENV, "0")  # restored afterwards: the fake pull sets it as a task's would
    monkeypatch.setattr("flwr.app.Message", lambda error, reply_to: ("error", error.code, error.reason, reply_to))
    task, calls = fake_task()
    device_runtime.owe_reply(task)
    assert task.pull_task_input("client")[0] == "message" and float(os.environ[PULL_ENV]) >= 0
    task.push_task_output("client", "context", "failed", "Task stopped.")  # a signal's exit: no reply went out
    (kind, reply), status = calls
    assert kind == "reply" and reply[0] == "error" and reply[3] == "message" and status == ("status", "failed")
    assert "runtime stopped this task before it replied (Task stopped.)" in reply[2]
    task, calls = fake_task()
    device_runtime.owe_reply(task)
    task.pull_task_input("client")
    task.push_message("client", "the reply", "context")
    task.push_task_output("client", "context", "completed", "")
    assert calls == [("reply", "the reply"), ("status", "completed")]  # a task that replied owes nothing more
    task, calls = fake_task(pull_fails=True)
    device_runtime.owe_reply(task)
    with pytest.raises(RuntimeError):
        task.pull_task_input("client")
    task.push_task_output("client", None, "failed", "unknown")
    assert calls == []  # never pulled: left to Flower's heartbeat expiry, which hands it to the next runtime


def test_a_task_gives_its_freed_memory_back_before_its_reply_is_copied_out(monkeypatch):
    """On a 1,202 MB pi4 the moment of the push was the device's peak: the task's freed training memory was still
    resident while Flower serialized the reply and the SuperNode stored it."""
    task, calls = fake_task()
    monkeypatch.setattr(device_runtime, "release_freed", lambda: calls.append(("released", None)))
    device_runtime.owe_reply(task)
    task.pull_task_input("client")
    task.push_message("client", "the reply", "context")
    assert calls == [("released", None), ("reply", "the reply")]


def test_the_state_is_written_once_the_reply_is_pushed(monkeypatch):
    """The app holds the device state's write (the task's process is marked); the runtime makes it right after
    the push, while the reply crosses the device's uplink."""
    task, calls = fake_task()
    monkeypatch.setattr(device_runtime, "release_freed", lambda: None)
    monkeypatch.setattr(device_runtime, "write_held_state", lambda: calls.append(("state written", None)))
    device_runtime.owe_reply(task)
    task.pull_task_input("client")
    task.push_message("client", "the reply", "context")
    assert calls == [("reply", "the reply"), ("state written", None)]


class Child:
    """A launched task that runs until ``ends_at`` (time.monotonic())."""

    def __init__(self, ends_at: float) -> None:
        self.ends_at = ends_at

    def is_alive(self) -> bool:
        return time.monotonic() < self.ends_at


def test_no_task_is_polled_for_while_a_task_runs_and_the_poll_comes_once_it_ends(monkeypatch):
    """Flower asks the executor before each poll: while a task runs, that waits up to BUSY_POLL_S, looking at the
    child, and returns as soon as the task has ended."""
    monkeypatch.setattr(device_runtime, "BUSY_POLL_S", 0.8)
    executor = device_runtime.ForkExecutor()
    started = time.monotonic()
    assert executor.get_eligible_capacity({"train"}) == ({"train"}, set())
    assert time.monotonic() - started < 0.05  # no task: Flower polls at its own pace
    executor.children = {1: Child(time.monotonic() + 0.2)}
    started = time.monotonic()
    executor.get_eligible_capacity({"train"})
    assert 0.2 <= time.monotonic() - started < 0.6  # returned once the task ended (within CHILD_CHECK_S), not at 0.8
    executor.children = {1: Child(time.monotonic() + 60)}
    started = time.monotonic()
    executor.get_eligible_capacity({"train"})
    assert 0.8 <= time.monotonic() - started < 1.5  # a long task: the SuperNode is still asked every BUSY_POLL_S


PRELOAD_COVERS = """
import importlib, io, sys, tempfile
from fleet.commands.device_runtime import APP_PACKAGES, PRELOAD
for name in PRELOAD:
    importlib.import_module(name)
before = set(sys.modules)
import httpx, numpy as np, torch
from PIL import Image
httpx.HTTPTransport()  # Flower's HTTP client, as each task connects to its SuperNode
np.unique(np.array([2, 1]))  # a device's split of its data
buffer = io.BytesIO(); torch.save({"w": torch.zeros(2)}, buffer); buffer.seek(0); torch.load(buffer)  # its state
with tempfile.NamedTemporaryFile(suffix=".png") as f:  # a data folder's first image
    Image.new("L", (4, 4)).save(f.name); Image.open(f.name).load()
print(sorted(m for m in set(sys.modules) - before if m.split(".")[0] not in APP_PACKAGES))
"""


def test_the_fork_server_preloads_what_every_task_imported_on_its_own():
    out = subprocess.run([sys.executable, "-c", PRELOAD_COVERS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"a task would import these itself: {out.stdout.strip()}"


def test_the_executor_answers_flowers_protocol():
    from flwr.supercore.superexec.executor.types import Executor

    for method in ("get_eligible_capacity", "wait_for_capacity", "launch", "reconcile", "close"):
        assert callable(getattr(device_runtime.ForkExecutor, method)), method
        assert method in Executor.__dict__, f"flwr changed: Executor.{method} is gone"
    # the app's packages are the FAB's, never preloaded: a new app version is imported by the next task
    assert not set(device_runtime.APP_PACKAGES) & {m.split(".")[0] for m in device_runtime.PRELOAD}


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "61", "soon"])
def test_a_bad_poll_interval_is_one_line_and_exit_2(bad, capsys):
    status, last = cli_refusal(capsys, ["device", "runtime", "--insecure", "--poll-s", bad])
    assert status == 2 and "--poll-s" in last, last


BAD_FLAGS = [  # each names a file that is not there, or an address that can never work
    ["--root-certificates", "/nonexistent/ca.crt"],
    ["--insecure", "--superexec-auth-secret-file", "/nonexistent"],
    ["--insecure", "--runtime-api-address", "nonsense"],
    ["--insecure", "--runtime-api-address", "127.0.0.1:99999"],
]


@pytest.mark.parametrize("flags", BAD_FLAGS)
def test_a_missing_file_or_a_malformed_address_is_one_line_and_exit_2(flags, capsys):
    status, last = cli_refusal(capsys, ["device", "runtime", *flags])
    assert status == 2 and last.startswith(f"error: {flags[-2]}"), last


def test_ready_s_leaves_out_the_messages_download(monkeypatch):
    monkeypatch.setenv(PULL_ENV, "1.5")
    assert task_pull_s() == 1.5
    for bad in ("-3", "x", "nan"):
        monkeypatch.setenv(PULL_ENV, bad)
        assert task_pull_s() == 0.0
    monkeypatch.delenv(PULL_ENV)
    assert task_pull_s() == 0.0


class WarmLoopback(Loopback):
    """Loopback's SuperNodes (``fleet device supernode``) in ``--isolation process``, each served by its own
    ``fleet device runtime``: a device as docs/pi.md sets it up."""

    def start_warm_node(self, i: int, node_config: str) -> tuple[subprocess.Popen, subprocess.Popen]:
        port = free_port()
        args = [str(BIN / "fleet"), "device", "supernode", "--", "--insecure", "--superlink", f"127.0.0.1:{self.port}"]
        node = self.start(
            f"supernode{i}", [*args, "--port", str(port), "--node-config", node_config, "--isolation", "process"]
        )
        wait_port(port, node, self.logs[f"supernode{i}"])
        return node, self.start_runtime(i, port, node.pid)

    def start_runtime(self, i: int, port: int, parent: int, name: str | None = None) -> subprocess.Popen:
        cmd = [str(BIN / "fleet"), "device", "runtime", "--insecure", "--runtime-api-address", f"127.0.0.1:{port}"]
        return self.start(name or f"runtime{i}", [*cmd, "--parent-pid", str(parent)])


def task_children(runtime: subprocess.Popen) -> list[int]:
    """The runtime's task processes: the fork server's children (the runtime's grandchildren)."""

    def children(pid: int) -> list[int]:
        path = Path(f"/proc/{pid}/task/{pid}/children")
        return [int(p) for p in path.read_text().split()] if path.is_file() else []

    return [g for c in children(runtime.pid) for g in children(c)]


@pytest.mark.slow
def test_warm_devices_train_every_round_and_survive_a_killed_task_and_a_restarted_runtime(tmp_path):
    link = WarmLoopback(tmp_path, False)
    config_path, profile = tiny_deploy_config(tmp_path, link.env)
    cfg = config_path.read_text().replace("rounds: 2", "rounds: 5")
    config_path.write_text(cfg)
    try:
        link.start_link()
        nodes = []
        for i in range(2):
            own = f"partition-id={i} tier={i + 1} profile='{profile}' state-dir='{tmp_path / f'device{i}'}'"
            nodes.append(link.start_warm_node(i, own))
        nodes[1] = (nodes[1][0], restart_runtime(link, *nodes[1]))
        link.submit(config_path)
        metrics = tmp_path / "runs" / "deploy" / "metrics.jsonl"
        killed = kill_a_task(nodes[0][1], metrics)
        stopped = restart_mid_task(link, *nodes[1], metrics)
        link.wait_finished()
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    finally:
        link.stop()
    assert [r["round"] for r in records] == [1, 2, 3, 4, 5], records
    for r in records:
        rows = {d["device"]: d for d in r["devices"]}
        missed = r.get("missed", [])
        assert set(rows) | set(missed) == {"device-0", "device-1"}, r  # counted, or missed with its reason
        assert all(r["miss_reasons"][m] for m in missed), r
        assert r["round_wall_s"] <= r["round_bound_s"], r
        for d in rows.values():
            assert d["ready_s"] < 2.0, d  # forked warm: no interpreter, no torch import, the download left out
    assert killed, "no task child was found to kill"
    assert all(not r["missed"] for r in records[:2]), records  # the restarted runtime served from the first round
    assert sum(len(r["missed"]) for r in records[2:]) <= 2, records  # each stopped task costs at most its round
    assert stopped, "no task child of the second runtime was found to stop"
    reasons = [why for r in records for name, why in r["miss_reasons"].items() if name == "device-1"]
    assert all("runtime stopped this task" in why or "no reply" in why for why in reasons), reasons
    assert {"device-0", "device-1"} <= set(trained(records[-1])), records[-1]  # both serve on, to the last round
    assert not leftovers(link.home), "processes of the deployment outlived it"


def leftovers(home: Path, settle_s: float = 10.0) -> list[int]:
    """Processes still running with this deployment's FLWR_HOME (a runtime, its fork server or a task)
    ``settle_s`` after it was stopped: a task child signalled with its process group may still be unwinding a
    step as the group's leader is reaped, which is no leak; one that lives on is."""
    mark, end = f"FLWR_HOME={home}".encode(), time.monotonic() + settle_s
    while True:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and mark in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
            except OSError:
                pass
        if not found or time.monotonic() > end:
            return found
        time.sleep(0.5)


def restart_runtime(
    link: WarmLoopback, node: subprocess.Popen, runtime: subprocess.Popen, name: str = "runtime1-restarted"
) -> subprocess.Popen:
    """A device's runtime stopped with its fork server and children and started again; its SuperNode stays."""
    os.killpg(runtime.pid, signal.SIGTERM)
    runtime.wait(timeout=30)
    port = int(node.args[node.args.index("--port") + 1])
    return link.start_runtime(1, port, node.pid, name=name)


def restart_mid_task(
    link: WarmLoopback, node: subprocess.Popen, runtime: subprocess.Popen, metrics: Path, timeout: float = 600
) -> bool:
    """Once three rounds have closed, the runtime restarted as its service's would be (SIGTERM to its whole
    group) while a task child of it runs; whether one was running then."""
    end = time.time() + timeout
    while time.time() < end and (read_progress(metrics.parent)[0] < 3 or not task_children(runtime)):
        time.sleep(0.05)
    if not task_children(runtime):
        return False
    restart_runtime(link, node, runtime, name="runtime1-restarted-mid-task")
    return True


def kill_a_task(runtime: subprocess.Popen, metrics: Path, timeout: float = 600) -> list[int]:
    """Once two rounds have closed, the first task child found under ``runtime`` killed while it runs."""
    end = time.time() + timeout
    while time.time() < end and read_progress(metrics.parent)[0] < 2:
        time.sleep(0.2)
    killed: list[int] = []
    while time.time() < end and not killed:
        for pid in task_children(runtime):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        time.sleep(0.05)
    return killed


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-m", "slow", "-x", "-q"]))


def test_a_task_takes_each_object_as_it_lands_in_tree_order_polling_one_at_a_time(monkeypatch):
    """Design note: a task takes each object as it lands. On Flower's own pull of a real message, the task asks
    for one object at a time, in the order of the object tree (the order the SuperNode stores them), every
    READY_POLL_S, not Flower's 1, 2, 4 ... 10 s per object; the message is whole as soon as its last is in."""
    from types import SimpleNamespace

    from flwr.app import ArrayRecord, Message, RecordDict
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree, iterate_object_tree
    from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError, pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity

    from fleet.commands.device_runtime import READY_POLL_S, pull_when_ready

    for name in ("_run_id", "_node_id", "_task_id"):  # a Message is made inside a task
        monkeypatch.setattr(TaskIdentity, name, 1)
    message = Message(RecordDict({"a": ArrayRecord([np.ones(3000, np.float32)])}), dst_node_id=1, message_type="train")
    tree = get_object_tree(message)
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()}
    order = [t.object_id for t in iterate_object_tree(tree)]
    started = time.monotonic()
    lands = {oid: started + 0.1 * (k + 1) for k, oid in enumerate(order)}  # stored one by one, 0.1 s apart
    calls: list[str] = []

    def pull_object(object_id: str) -> bytes:
        calls.append(object_id)
        if time.monotonic() < lands[object_id]:
            raise ObjectUnavailableError(object_id)
        return contents[object_id]

    task = SimpleNamespace(pull_and_inflate_object_from_tree=pull_and_inflate_object_from_tree)
    pull_when_ready(task)
    got = task.pull_and_inflate_object_from_tree(tree, pull_object, lambda _: None)
    waited = time.monotonic() - started
    assert got.object_id == message.object_id
    assert [order.index(c) for c in calls] == sorted(order.index(c) for c in calls)  # one at a time, in order
    assert len(calls) <= 3 * len(order)  # each asked about once a poll while it is on its way
    assert lands[order[-1]] - started <= waited < lands[order[-1]] - started + 2 * READY_POLL_S


def test_an_installed_fab_is_not_unpacked_again_and_a_new_one_is_installed(tmp_path, monkeypatch):
    """Flower's own install, on this project's real FAB: the first task installs it, the next finds the same
    directory without unpacking; a FAB its hash does not vouch for, or one whose directory is gone, is
    installed as Flower would."""
    from flwr.cli.build import build_fab_from_disk
    from flwr.cli.install import install_from_fab
    from flwr.common.config import get_project_dir

    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    fab = build_fab_from_disk(APP_ROOT)
    digest = hashlib.sha256(fab).hexdigest()
    run = types.SimpleNamespace(fab_id="fleet/fleet", fab_version="0.1.0")
    unpacked: list[int] = []

    def counted_install(fab_file, *args, **kwargs):
        unpacked.append(len(fab_file))
        return install_from_fab(fab_file, *args, **kwargs)

    def task_for(content: bytes, hash_str: str) -> types.SimpleNamespace:
        got = ("message", "context", run, types.SimpleNamespace(content=content, hash_str=hash_str))
        task = types.SimpleNamespace(pull_task_input=lambda client: got, install_from_fab=counted_install)
        device_runtime.install_once(task)
        task.pull_task_input("client")
        return task

    path = get_project_dir("fleet/fleet", "0.1.0", digest)
    assert task_for(fab, digest).install_from_fab(fab, skip_prompt=True) == path and unpacked == [len(fab)]
    assert (path / "client" / "client_app.py").is_file()
    assert task_for(fab, digest).install_from_fab(fab, skip_prompt=True) == path and len(unpacked) == 1
    assert task_for(fab, "0" * 64).install_from_fab(fab, skip_prompt=True) == path and len(unpacked) == 2  # unvouched
    shutil.rmtree(path)  # gone (or never installed on this device): installed as Flower does
    assert task_for(fab, digest).install_from_fab(fab, skip_prompt=True) == path and len(unpacked) == 3
    assert (path / "pyproject.toml").is_file()


def test_the_loaded_app_is_frozen_out_of_the_collectors_scans():
    import gc

    made: list = []
    task = types.SimpleNamespace(get_load_client_app_fn=lambda **kw: lambda *ids: made.append(ids) or "app")
    device_runtime.frozen_once_loaded(task)
    load = task.get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
    gc.unfreeze()
    try:
        assert gc.get_freeze_count() == 0
        assert load("fleet/fleet", "0.1.0", "hash") == "app" and made == [("fleet/fleet", "0.1.0", "hash")]
        assert gc.get_freeze_count() > 1000  # everything alive once the app is loaded
    finally:
        gc.unfreeze()


@pytest.mark.parametrize(
    "setup",
    ["import fleet.commands.device_runtime", "from fleet.cli import build_parser; build_parser()"],
    ids=["the poller's module", "the fleet command's parser"],
)
def test_a_devices_supernode_and_poller_do_not_hold_torch(setup):
    """The SuperNode and the poller are processes of their own in the device's memory limit: torch belongs to the
    fork server alone. Both start as ``fleet device ...``, so the whole parser is built in them too. An import of
    torch slipped into the poller once, and later one bench's help read its choices from the config module, which
    imports torch: a pi4's SuperNode then held 765 MB (320 without), and a 1,202 MB pi4 went out of memory at its
    first message, both times."""
    code = f"import sys; {setup}; print(sorted({{'torch', 'torchvision'}} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out

"""Real deployment on loopback: one flower-superlink, two flower-supernode processes, `flwr run`.

Own FLWR_HOME and free ports in a tmp dir, runtime dependency installation
disabled, bounded waits, every process killed at the end. `flwr run` exits 0
even when a run fails, so the verdict comes from `flwr ls` and the metrics written.

Two deployments: plain HTTP (`--insecure`), and a secure one with TLS from a throwaway CA,
SuperNode authentication with one registered key pair per device, a third SuperNode whose key
was never registered (refused), and a node-config memory budget on one device.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE
from flwr.supercore.exit import ExitCode

from fleet.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # the run may take up to 900 s of it on a busy machine

MEMORY_BUDGET_MB = 1.0  # about half of the 2.05 MB a full step of fleet-tiny stores: feasible, and binding
# What the supervisor adds to Flower's run patience before it resubmits: one --poll-s of 1 s, a `flwr ls`
# and a `flwr run` (each a fresh CLI process, 3-8 s on a loaded 2-core machine), and the SuperLink's restart.
RESUME_SLACK_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            pytest.fail(f"process exited early:\n{log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    pytest.fail(f"port {port} not open after {timeout}s:\n{log.read_text()[-2000:]}")


def flwr_try(args: list[str], env: dict, timeout: float = 120) -> tuple[int, dict | None, str]:
    """A `flwr ... --format json` command that may fail: exit status, its JSON (None if it printed
    none; it may print other lines before it) and everything it printed."""
    out = subprocess.run(
        [str(BIN / "flwr"), *args, "--format", "json"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    start = out.stdout.find("{")
    try:
        parsed = json.loads(out.stdout[start:]) if start >= 0 else None
    except json.JSONDecodeError:
        parsed = None
    return out.returncode, parsed, out.stdout + out.stderr


def flwr_json(args: list[str], env: dict, timeout: float = 60) -> dict:
    """A `flwr ... --format json` command's JSON, which it must print."""
    _, parsed, text = flwr_try(args, env, timeout)
    assert parsed is not None, text
    return parsed


def run_status(env: dict, timeout: float = 60) -> dict:
    return flwr_json(["ls", "loopback"], env, timeout)


def make_tls(d: Path, extra_ips: tuple[str, ...] = ()) -> tuple[Path, Path, Path]:
    """A CA and a server certificate it signed, for 127.0.0.1 and localhost (and ``extra_ips``), made by
    ``fleet certs`` as the docs tell a user to: the real SuperLink and proxy below serve them."""
    sans = ["--san", "DNS:localhost", *(a for ip in extra_ips for a in ("--san", f"IP:{ip}"))]
    assert cli_main(["certs", "--out", str(d), *sans]) == 0
    return d / "ca.crt", d / "server.pem", d / "server.key"


def make_node_key(path: Path) -> Path:
    """An ECDSA P-384 key pair in OpenSSH format (`path` private, `path`.pub public), made by ``fleet certs
    --device`` in ``path``'s grandparent's keys/ folder."""
    assert path.parent.name == "keys", path
    assert cli_main(["certs", "--out", str(path.parent.parent), "--device", path.name]) == 0
    return path


@dataclass
class Deployment:
    """What a finished deployment left behind for the test to check."""

    run: Path  # runs/<name> on the ServerApp's side
    records: list[dict]  # its metrics.jsonl
    logs: dict[str, Path]  # process name -> its stdout and stderr
    node_ids: list[int] = field(default_factory=list)  # ids `flwr supernode register` gave (secure only)
    nodes: list[dict] = field(default_factory=list)  # `flwr supernode ls` once the SuperNodes were up (secure only)
    unregistered_exit: int | None = None  # exit code of the SuperNode with an unregistered key


class Loopback:
    """One SuperLink and its SuperNodes on loopback, in ``tmp_path``, with their own FLWR_HOME.

    secure: TLS from a throwaway CA on the SuperLink (SuperNodes and `flwr` trust the CA) and
    `--enable-supernode-auth`; each SuperNode has its own key pair, registered with
    `flwr supernode register` before it starts (unless it is meant to be refused).
    database: the SuperLink's `--database` file (default: none, the state lives in memory).
    tls_ips (secure only): more IP addresses the server certificate is valid for, e.g. a proxy's.
    Secure SuperNodes run as ``fleet device supernode`` (Flower's SuperNode without its idle sleeps), so TLS,
    authentication and the proxy are tested through it; plain ones run Flower's ``flower-supernode`` itself.
    """

    def __init__(
        self, tmp_path: Path, secure: bool, *, database: Path | None = None, tls_ips: tuple[str, ...] = ()
    ) -> None:
        self.tmp, self.secure, self.database, self.tls_ips = tmp_path, secure, database, tls_ips
        self.home = tmp_path / "flwr-home"
        self.home.mkdir()
        self.port = free_port()
        # The SuperLink and SuperNodes start flower-superexec by name: the venv's bin must be on PATH
        # even when pytest runs as .venv/bin/python without an activated venv.
        path = os.pathsep.join([str(BIN), os.environ.get("PATH", "")])
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "FLWR_TELEMETRY_ENABLED": "0", "PATH": path}
        self.procs: list[subprocess.Popen] = []
        self.logs: dict[str, Path] = {}
        self.node_ids: list[int] = []
        self.node_tls = self._connection()

    def _connection(self) -> list[str]:
        """Writes `flwr`'s connection config; returns the SuperNodes' TLS flags."""
        connection = f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{self.port}"\n'
        if self.secure:
            self.ca, self.cert, self.key = make_tls(self.tmp / "certs", self.tls_ips)
            connection += f'root-certificates = "{self.ca}"\n'  # flwr accepts only an absolute path here
            (self.tmp / "keys").mkdir()
        else:
            connection += "insecure = true\n"
        (self.home / "config.toml").write_text(connection)
        return ["--root-certificates", str(self.ca)] if self.secure else ["--insecure"]

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        self.logs[name] = self.tmp / f"{name}.log"
        with self.logs[name].open("w") as fh:
            p = subprocess.Popen(
                args, env=self.env, cwd=self.tmp, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(p)
        return p

    def start_link(self, name: str = "superlink") -> subprocess.Popen:
        """Starts the SuperLink (logged as ``name``: a restarted SuperLink keeps the first one's log)
        and returns once its port is open."""
        # No --database by default: the SuperLink keeps its state in memory. With a SQLite file, a write
        # held up past SQLite's 5 s busy timeout on a loaded machine answers a SuperNode's pull-messages
        # with 500 "database is locked", and flower-supernode exits on it (it retries only 502/503/504).
        args = [str(BIN / "flower-superlink"), "--port", str(self.port), "--disable-runtime-dependency-installation"]
        if self.database is not None:
            args += ["--database", str(self.database)]
        if self.secure:
            tls = ["--ssl-ca-certfile", str(self.ca), "--ssl-certfile", str(self.cert), "--ssl-keyfile", str(self.key)]
            args += [*tls, "--enable-supernode-auth"]
        else:
            args.append("--insecure")
        proc = self.start(name, args)
        wait_port(self.port, proc, self.logs[name])
        return proc

    def start_node(
        self, i: int, node_config: str, register: bool, name: str | None = None, superlink: str | None = None
    ) -> subprocess.Popen:
        """A flower-supernode for device ``i``, logged as ``name`` (default supernode<i>): a device
        restarted under a new name keeps its first process's log. Secure: device ``i`` keeps its key
        pair (made on its first start). superlink: the address it dials (default: the SuperLink's)."""
        auth: list[str] = []
        if self.secure:
            key_path = self.tmp / "keys" / f"device{i}"
            if not key_path.is_file():
                make_node_key(key_path)
            if register:
                reg = flwr_json(["supernode", "register", f"{key_path}.pub", "loopback"], self.env)
                assert reg.get("success") is True, reg
                self.node_ids.append(int(reg["node-id"]))
            auth = ["--auth-supernode-private-key", str(key_path)]
        link = ["--superlink", superlink or f"127.0.0.1:{self.port}", "--port", str(free_port())]
        node = [str(BIN / "fleet"), "device", "supernode", "--"] if self.secure else [str(BIN / "flower-supernode")]
        args = [*node, *self.node_tls, *auth, *link, "--node-config", node_config]
        return self.start(name or f"supernode{i}", args)

    def online_nodes(self, want: int, timeout: float = 60) -> list[dict]:
        """`flwr supernode ls` once ``want`` SuperNodes are online (or after ``timeout``)."""
        deadline, nodes = time.time() + timeout, []
        while time.time() < deadline:
            nodes = flwr_json(["supernode", "ls", "loopback"], self.env)["nodes"]
            if sum(n["status"] == "online" for n in nodes) >= want:
                break
            time.sleep(1)
        return nodes

    def submit(self, config_path: Path) -> None:
        """`flwr run` the app with ``config_path``; returns once the SuperLink accepted the run."""
        res = subprocess.run(
            [str(BIN / "flwr"), "run", str(ROOT), "loopback", "--run-config", f"config='{config_path}'"],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0 and "Successfully started run" in res.stdout, res.stdout + res.stderr

    def wait_finished(self, timeout: float = 900) -> None:
        """Waits until the one run finished, and asserts it completed (`flwr run` exits 0 either way)."""
        deadline, status = time.time() + timeout, {}
        while time.time() < deadline:
            runs = run_status(self.env)["runs"]
            assert len(runs) == 1
            status = runs[0]
            if status["status"].startswith("finished"):
                break
            time.sleep(5)
        assert status.get("status") == "finished:completed", f"{status}\n{self.logs['superlink'].read_text()[-3000:]}"

    def run_to_end(self, config_path: Path, timeout: float = 900) -> None:
        """`flwr run` the app with ``config_path`` and wait until the run finished, completed."""
        self.submit(config_path)
        self.wait_finished(timeout)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(self.home, ignore_errors=True)


def measure_profile(config_path: Path, env: dict, out: Path) -> Path:
    """`fleet profile` of ``config_path``'s model, batch and input size, written to ``out``."""
    prof = subprocess.run(
        [str(BIN / "fleet"), "profile", "--config", str(config_path), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert prof.returncode == 0 and out.is_file(), prof.stdout + prof.stderr
    return out


def tiny_deploy_config(tmp_path: Path, env: dict) -> tuple[Path, Path]:
    """fleet-tiny for two devices, and one profile measured for both, as on identical boards: their
    budgets then differ by their tiers alone. (Each device timing itself, both at once on a busy
    machine, once made the tier-1 device's step twice the tier-2 device's: rho 0.67 vs 1.0.)"""
    cfg = yaml.safe_load((ROOT / "simulations/fleet-tiny.yaml").read_text())
    cfg["name"] = "deploy"
    cfg["output_dir"] = str(tmp_path / "runs")
    cfg["devices"]["num_devices"] = 2
    config_path = tmp_path / "deploy.yaml"
    config_path.write_text(yaml.safe_dump(cfg))
    return config_path, measure_profile(config_path, env, tmp_path / "profile.yaml")


def deploy(
    tmp_path: Path, *, secure: bool, node_extra: dict[int, str] | None = None, unregistered: bool = False
) -> Deployment:
    """Starts a SuperLink and two SuperNodes (partitions 0 and 1, tiers 1 and 2) on loopback, runs
    2 rounds of fleet-tiny with `flwr run`, waits for the run to finish and returns its metrics.

    secure: see :class:`Loopback`. node_extra: more node config for SuperNode i.
    unregistered (secure only): a third SuperNode (partition 2) with a key pair nobody registered
    is started before the run is submitted; its exit code lands in `unregistered_exit` (None: still
    running after 90 s). Every process is stopped on return.
    """
    node_extra = node_extra or {}
    link = Loopback(tmp_path, secure)
    config_path, profile = tiny_deploy_config(tmp_path, link.env)

    def node_config(i: int) -> str:
        own = f"partition-id={i} tier={i % 2 + 1} profile='{profile}' state-dir='{tmp_path / f'device{i}'}'"
        return f"{own} {node_extra.get(i, '')}".strip()

    try:
        link.start_link()
        for i in range(2):
            node = link.start_node(i, node_config(i), register=True)
            wait_port(int(node.args[node.args.index("--port") + 1]), node, link.logs[f"supernode{i}"])
        unregistered_exit = None
        if unregistered:
            assert secure, "every SuperNode is welcome without --enable-supernode-auth"
            rogue = link.start_node(2, node_config(2), register=False)
            try:
                unregistered_exit = rogue.wait(timeout=90)
            except subprocess.TimeoutExpired:
                pass  # still running: the test's assertions say what that means
        nodes = link.online_nodes(2) if secure else []  # both registered SuperNodes online before the run
        link.run_to_end(config_path)
        run = tmp_path / "runs" / "deploy"
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return Deployment(run, records, dict(link.logs), link.node_ids, nodes, unregistered_exit)
    finally:
        link.stop()


def check_two_device_run(tmp_path: Path, dep: Deployment) -> None:
    """Both devices trained both rounds; state, checkpoint and summary written; the slower one
    (tier 2) got a smaller budget and uploaded less."""
    assert [r["round"] for r in dep.records] == [1, 2]
    for r in dep.records:
        assert r["rejections"] == []
        devs = {d["partition_id"]: d for d in r["devices"]}
        assert set(devs) == {0, 1}
        assert devs[0]["tier"] == 1.0 and devs[1]["tier"] == 2.0
        assert devs[0]["rho"] == 1.0 and devs[1]["rho"] < 1.0  # the slower node got a smaller budget
        assert devs[1]["bytes_uploaded"] < devs[0]["bytes_uploaded"]  # and uploaded only what it trained
    summary = json.loads((dep.run / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["final_accuracy"] is not None
    assert (dep.run / "checkpoint.pt").is_file()
    for i in range(2):  # device state outlived each ClientApp process
        assert (tmp_path / f"device{i}" / "deploy" / "state.pt").is_file()


def test_two_supernodes_on_loopback_run_two_rounds(tmp_path):
    dep = deploy(tmp_path, secure=False)
    check_two_device_run(tmp_path, dep)
    for r in dep.records:
        assert all("memory_budget_bytes" not in d for d in r["devices"])


def test_secure_supernodes_tls_auth_and_memory_budget(tmp_path):
    """TLS from a throwaway CA, SuperNode authentication with a registered key pair per device, a
    SuperNode with an unregistered key refused, and device 1 under a node-config memory budget."""
    dep = deploy(tmp_path, secure=True, node_extra={1: f"memory-budget-mb={MEMORY_BUDGET_MB}"}, unregistered=True)
    check_two_device_run(tmp_path, dep)
    # The unregistered SuperNode: its ActivateNode is answered 412 "Failed to activate SuperNode"
    # (the SuperLink knows no node with its public key, and with --enable-supernode-auth a SuperNode
    # cannot register itself), so flower-supernode gives up at once: it logs Flower's exit code
    # SUPERNODE_CONNECTION_ERROR (305) and exits with status 1, as flwr_exit does for every error code.
    rogue_log = dep.logs["supernode2"].read_text()
    assert dep.unregistered_exit == 1, rogue_log[-3000:]
    assert f"Exit Code: {ExitCode.SUPERNODE_CONNECTION_ERROR}" in rogue_log, rogue_log[-3000:]
    assert "Failed to initialize the connection to the SuperLink" in rogue_log, rogue_log[-3000:]
    assert "Failed to activate SuperNode" in rogue_log, rogue_log[-3000:]
    # The SuperLink knows exactly the two registered nodes, both online when the run was submitted,
    # and only their partitions took part in the run.
    assert len(set(dep.node_ids)) == 2
    assert sorted(int(n["node-id"]) for n in dep.nodes) == sorted(dep.node_ids), dep.nodes
    assert all(n["status"] == "online" for n in dep.nodes), dep.nodes
    budget = int(MEMORY_BUDGET_MB * 1_000_000)
    for r in dep.records:
        assert sorted(d["partition_id"] for d in r["devices"]) == [0, 1]
        devs = {d["partition_id"]: d for d in r["devices"]}
        # device 1 trained under its node-config budget on a real SuperNode; device 0 had none
        assert devs[1]["memory_budget_bytes"] == budget and 0 < devs[1]["memory_peak_bytes"] <= budget, devs[1]
        assert "memory_budget_bytes" not in devs[0]


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_a_supervised_run_resumes_by_itself_after_a_superlink_crash(tmp_path):
    """`fleet supervise` submits 6 rounds; the SuperLink (and the ServerApp with it) is killed after round 2
    and started again on its --database. The SuperNodes reconnect by themselves; the supervisor sees the
    run failed and resubmits it with resume=true, and the run ends with every round, none twice.

    Flower, not the supervisor, says when the run failed: once its ServerApp has sent no heartbeat for
    HEARTBEAT_PATIENCE x HEARTBEAT_DEFAULT_INTERVAL (60 s in flwr 1.42) since the last one, which came up
    to that long before the crash. So the bound counts from the crash: that patience, plus the
    supervisor's poll and its two flwr calls (RESUME_SLACK_S; CI once measured 63.5 s from the restart)."""
    link = Loopback(tmp_path, secure=False, database=tmp_path / "superlink.db")
    config_path, profile = tiny_deploy_config(tmp_path, link.env)
    cfg = yaml.safe_load(config_path.read_text())
    cfg["federation"]["rounds"] = 6
    config_path.write_text(yaml.safe_dump(cfg))
    metrics = tmp_path / "runs" / "deploy" / "metrics.jsonl"
    try:
        superlink = link.start_link()
        for i in range(2):
            node = link.start_node(i, f"partition-id={i} profile='{profile}' state-dir='{tmp_path / f'd{i}'}'", False)
            wait_port(int(node.args[node.args.index("--port") + 1]), node, link.logs[f"supernode{i}"])
        argv = [str(BIN / "fleet"), "supervise", "loopback", "--config", str(config_path), "--app", str(ROOT)]
        supervisor = link.start("supervise", [*argv, "--poll-s", "1"])
        deadline = time.time() + 600
        while len(read_records(metrics)) < 2 and time.time() < deadline and supervisor.poll() is None:
            time.sleep(0.5)
        assert len(read_records(metrics)) >= 2, link.logs["supervise"].read_text()[-2000:]
        os.killpg(superlink.pid, signal.SIGKILL)  # a crash: the SuperLink, its executor and the ServerApp
        crashed = time.time()
        superlink.wait()
        link.start_link("superlink-2")
        bound_s = HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL + RESUME_SLACK_S
        while "(resume=true)" not in link.logs["supervise"].read_text() and time.time() < crashed + 2 * bound_s:
            time.sleep(0.5)
        resumed_after = time.time() - crashed
        assert supervisor.wait(timeout=900) == 0, link.logs["supervise"].read_text()[-3000:]
    finally:
        link.stop()
    log = link.logs["supervise"].read_text()
    assert "finished:failed" in log and "(resume=true)" in log and resumed_after <= bound_s, (resumed_after, log)
    assert [r["round"] for r in read_records(metrics)] == [1, 2, 3, 4, 5, 6], log

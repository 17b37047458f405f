"""Real deployment on loopback: one flower-superlink, two flower-supernode processes, `flwr run`.

Own FLWR_HOME and free ports in a tmp dir, runtime dependency installation
disabled, bounded waits, every process killed at the end. `flwr run` exits 0
even when a run fails, so the verdict comes from `flwr ls` and the metrics written.
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
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.slow


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


def run_status(env: dict, timeout: float = 60) -> dict:
    out = subprocess.run([str(BIN / "flwr"), "ls", "loopback", "--format", "json"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    start = out.stdout.find("{")
    assert start >= 0, out.stdout + out.stderr
    return json.loads(out.stdout[start:])


def test_two_supernodes_on_loopback_run_two_rounds(tmp_path):
    home = tmp_path / "flwr-home"
    home.mkdir()
    port = free_port()
    # The SuperLink and SuperNodes start flower-superexec by name: the venv's bin must be on PATH
    # even when pytest runs as .venv/bin/python without an activated venv.
    path = os.pathsep.join([str(BIN), os.environ.get("PATH", "")])
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "PATH": path}
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    cfg = yaml.safe_load((ROOT / "simulations/fleet-tiny.yaml").read_text())
    cfg["name"] = "deploy"
    cfg["output_dir"] = str(tmp_path / "runs")
    cfg["federation"]["num_devices"] = 2
    config_path = tmp_path / "deploy.yaml"
    config_path.write_text(yaml.safe_dump(cfg))

    procs: list[subprocess.Popen] = []

    def start(args: list[str], log: Path) -> subprocess.Popen:
        fh = log.open("w")
        p = subprocess.Popen(args, env=env, cwd=tmp_path, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    try:
        link_log = tmp_path / "superlink.log"
        link = start(
            [str(BIN / "flower-superlink"), "--insecure", "--port", str(port), "--disable-runtime-dependency-installation",
             "--database", str(home / "state.db")],
            link_log,
        )
        wait_port(port, link, link_log)
        for i in range(2):
            node_port = free_port()
            node_cfg = f"partition-id={i} tier={i + 1} state-dir='{tmp_path / f'device{i}'}'"
            log = tmp_path / f"supernode{i}.log"
            node = start(
                [str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}", "--port", str(node_port),
                 "--node-config", node_cfg],
                log,
            )
            wait_port(node_port, node, log)
        res = subprocess.run(
            [str(BIN / "flwr"), "run", str(ROOT), "loopback", "--run-config", f"config='{config_path}'"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
        assert res.returncode == 0 and "Successfully started run" in res.stdout, res.stdout + res.stderr
        deadline = time.time() + 900
        status = {}
        while time.time() < deadline:
            runs = run_status(env)["runs"]
            assert len(runs) == 1
            status = runs[0]
            if status["status"].startswith("finished"):
                break
            time.sleep(5)
        assert status.get("status") == "finished:completed", f"{status}\n{link_log.read_text()[-3000:]}"
        run = tmp_path / "runs" / "deploy"
        recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in recs] == [1, 2]
        for r in recs:
            assert r["rejections"] == []
            devs = {d["partition_id"]: d for d in r["devices"]}
            assert set(devs) == {0, 1}
            assert devs[0]["tier"] == 1.0 and devs[1]["tier"] == 2.0
            assert devs[0]["rho"] == 1.0 and devs[1]["rho"] < 1.0  # the slower node got a smaller budget
            assert devs[1]["bytes_uploaded"] < devs[0]["bytes_uploaded"]  # and uploaded only what it trained
        summary = json.loads((run / "summary.json").read_text())
        assert summary["rounds"] == 2 and summary["final_accuracy"] is not None
        assert (run / "checkpoint.pt").is_file()
        for i in range(2):  # device state outlived each ClientApp process
            assert (tmp_path / f"device{i}" / "deploy" / "state.pt").is_file()
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(home, ignore_errors=True)

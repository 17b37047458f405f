"""`fleet simulate --ray-address`: the same simulation on an existing Ray cluster.

The slow test starts a real two-node Ray cluster on loopback (`ray start --head` and
`ray start --address`, each with one CPU, so that Flower's Ray backend places one
ClientApp actor on each node), runs two rounds against it and stops both nodes. Each
node runs in its own process group, killed whole afterwards, so the test never touches
another Ray on this machine (`ray stop` would stop every one).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_fleet_simulation import ROOT, TINY, run_bounded, run_fleet

RAY = str(Path(sys.executable).parent / "ray")
SIMULATE_ON = (  # `fleet simulate` with the node-noting test ClientApp
    "import json, sys\n"
    "from fleet.commands.simulation import simulate\n"
    "summary = simulate(sys.argv[1], json.loads(sys.argv[2]), client_app='tests.ray_node_client_app:app')\n"
    "print('rounds', summary.rounds)\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(args: list[str], log: Path) -> subprocess.Popen:
    """A Ray node kept in the foreground (--block) in its own process group."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    with log.open("w") as out:
        return subprocess.Popen(
            [RAY, "start", "--block", "--num-cpus", "1", "--disable-usage-stats", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=ROOT,
        )


def stop_node(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            continue


def wait_for_nodes(address: str, count: int, timeout_s: float = 90) -> None:
    """Until ``ray status`` at ``address`` lists ``count`` active nodes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        res = subprocess.run([RAY, "status", "--address", address], capture_output=True, text=True, timeout=60)
        active = res.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
        if res.returncode == 0 and active.count("node_") >= count:
            return
        time.sleep(2)
    raise AssertionError(f"the Ray cluster at {address} did not reach {count} nodes: {res.stdout}{res.stderr}")


def test_an_unreachable_ray_address_is_one_line_naming_it(tmp_path):
    port = free_port()  # nothing listens there
    res = run_fleet(["simulate", TINY, "--output-dir", str(tmp_path), "--ray-address", f"127.0.0.1:{port}"], 120)
    assert res.returncode == 2, res.stdout[-2000:]
    assert f"error: simulation.ray_address: no Ray cluster answers at 127.0.0.1:{port}" in res.stdout
    assert "ray start --head" in res.stdout and "Traceback" not in res.stdout
    assert not (tmp_path / "fleet-tiny" / "device-profile.yaml").exists()  # refused before anything was measured
    res = run_fleet(["simulate", TINY, "--output-dir", str(tmp_path), "--ray-address", "http://head"], 120)
    assert res.returncode == 2 and "error: simulation.ray_address: 'http://head' is not allowed" in res.stdout


@pytest.mark.slow
def test_a_simulation_runs_on_a_two_node_ray_cluster(tmp_path):
    port = free_port()
    address = f"127.0.0.1:{port}"
    head = start_node(["--head", "--port", str(port), "--include-dashboard=false"], tmp_path / "head.log")
    worker = None
    try:
        wait_for_nodes(address, 1)
        worker = start_node(["--address", address], tmp_path / "worker.log")
        wait_for_nodes(address, 2)
        overrides = {"output_dir": str(tmp_path / "runs"), "simulation.ray_address": address}
        res = run_bounded([sys.executable, "-c", SIMULATE_ON, TINY, json.dumps(overrides)], 420)
        assert res.returncode == 0 and "rounds 2" in res.stdout, res.stdout[-3000:]
        nodes = (tmp_path / "runs" / "ray-nodes.txt").read_text().split()
        assert len(nodes) == 8  # 4 devices x 2 rounds
        assert len(set(nodes)) == 2, f"ClientApps ran on {set(nodes)}; both nodes should have run some"
        log = (tmp_path / "runs" / "fleet-tiny" / "flower.log").read_text()
        assert "Connecting to existing Ray cluster" in log or address in log
    finally:
        for proc in (worker, head):
            if proc is not None:
                stop_node(proc)
        forget_cluster(port)


def forget_cluster(port: int) -> None:
    """Drop Ray's note of this cluster (`ray stop` would; killing the nodes does not), so that a later
    `ray.init()` without an address on this machine does not try to join the dead cluster."""
    note = Path("/tmp/ray/ray_current_cluster")
    try:
        if note.read_text().strip().endswith(f":{port}"):
            note.unlink()
    except OSError:
        pass

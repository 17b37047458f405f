"""The fleet end to end in Flower's real simulation engine (Ray), through the real CLI.

Each run is a subprocess in its own process group, bounded by a timeout and
always killed, so a hung simulation never outlives its test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = "simulations/fleet-tiny.yaml"


def fleet_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from fleet.cli import main; sys.exit(main())", *args]


def run_bounded(cmd: list[str], timeout: float = 420) -> subprocess.CompletedProcess:
    """``cmd`` in its own process group, output merged, killed with its children if it outlives ``timeout``."""
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, **pipes)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def run_fleet(args: list[str], timeout: float = 420) -> subprocess.CompletedProcess:
    return run_bounded(fleet_cmd(*args), timeout)


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# `fleet simulate`, with tests/failing_client_app.py as the ClientApp: device 1 raises in round 1.
FAILING_SIMULATE = (
    "import json, sys\n"
    "from fleet.commands.fleet import summary_table\n"
    "from fleet.commands.simulation import simulate\n"
    "summary = simulate(sys.argv[1], json.loads(sys.argv[2]), client_app='tests.failing_client_app:app')\n"
    "print(summary_table(summary))\n"
)


def run_failing(config: str, overrides: dict, timeout: float = 420) -> subprocess.CompletedProcess:
    return run_bounded([sys.executable, "-c", FAILING_SIMULATE, config, json.dumps(overrides)], timeout)


def test_device_failing_mid_round_does_not_stop_the_fleet(tmp_path):
    # odd devices: about half a full step's activations
    overrides = {"output_dir": str(tmp_path), "devices.memory_budgets_mb": [0, 1.0], "evaluation.server_test": True}
    res = run_failing(TINY, overrides)
    assert res.returncode == 0, res.stdout[-3000:]
    run = tmp_path / "fleet-tiny"
    recs = read_metrics(run)
    assert [r["round"] for r in recs] == [1, 2]
    r1, r2 = recs
    # round 1: device 1 raised inside its ClientApp; the other three were aggregated
    assert len(r1["rejections"]) == 1 and "failed on purpose" in r1["rejections"][0]["reason"]
    assert sorted(d["partition_id"] for d in r1["devices"] if "speedup" in d) == [0, 2, 3]
    assert sorted(d["partition_id"] for d in r2["devices"] if "speedup" in d) == [0, 1, 2, 3]
    assert r2["rejections"] == []
    # membership: all four joined in round 1 and every one was sampled in both rounds, by name
    names = [f"device-{i}" for i in range(4)]
    assert sorted(r1["joined"]) == names and r2["joined"] == [] and r1["refused"] == []
    assert r1["sampled"] == r2["sampled"] == names and r1["missed"] == r2["missed"] == []
    assert sorted(d["device"] for d in r2["devices"]) == names
    assert [d["rounds_trained"] for d in r2["devices"]] == [2, 1, 2, 2]  # device 1 failed round 1
    # per-device tracking and the simulated clock
    for d in r2["devices"]:
        assert 0 <= d["global_accuracy"] <= 1 and 0 <= d["personal_accuracy"] <= 1
        assert d["bytes_uploaded"] > 0 and 0 < d["trained_fraction"] <= 1
    # devices 1 and 3 trained under a 1 MB activation budget, the others without one
    for d in r2["devices"]:
        if d["partition_id"] % 2:
            assert d["memory_budget_bytes"] == 1_000_000 and 0 < d["memory_peak_bytes"] <= 1_000_000
        else:
            assert "memory_budget_bytes" not in d
    slow = [d for d in r2["devices"] if d["tier"] == 2.0]
    assert slow and all(d["rho"] < 1 and d["selected"] < d["num_tensors"] for d in slow)
    fast = [d for d in r2["devices"] if d["tier"] == 1.0]
    assert all(d["rho"] == 1.0 and d["selected"] == d["num_tensors"] for d in fast)
    bw = 12.5e6
    assert r2["round_time_s"] == pytest.approx(
        max(d["predicted_time_s"] + d["bytes_uploaded"] / bw for d in r2["devices"])
    )
    assert r2["sim_time_s"] == pytest.approx(r1["sim_time_s"] + r2["round_time_s"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["rejections"] == 1
    assert summary["final_accuracy"] == pytest.approx(r2["global_accuracy"])
    assert (run / "accuracy.png").stat().st_size > 1000 and (run / "devices.png").stat().st_size > 1000
    # evaluation.server_test: the global model scored on the server's test set, the figure the checkpoint gives
    from fleet.federated.on_server.server_eval import server_accuracy, server_test_set
    from fleet.federated.on_server.state import load_checkpoint
    from fleet.federated.shared.config import load_fleet_config

    cfg = load_fleet_config(run / "fleet-config.yaml")
    arrays = {k: v.numpy() for k, v in load_checkpoint(run)[0].items()}
    assert r2["server_accuracy"] == pytest.approx(server_accuracy(cfg, arrays, server_test_set(cfg)))
    assert 0 <= r1["server_accuracy"] <= 1 and summary["final_server_accuracy"] == r2["server_accuracy"]
    assert "server " in res.stdout
    assert "round   2/2" in res.stdout and "speedup" in res.stdout  # progress lines and summary table
    out = res.stdout
    assert (
        "configure_train" not in out and "Started a local Ray instance" not in out
    )  # Flower/Ray INFO off the terminal
    assert "Started a local Ray instance" in (run / "flower.log").read_text()  # ... and in the run's log
    assert "rejected reply from device device-1 (node" in out and "failed on purpose" in out  # fleet's warnings

    assert "a ClientApp raised; Flower's tracebacks go to" in out and "Traceback" not in out
    assert len(re.findall(r"^round +\d+/2 ", out, re.M)) == 2  # one progress line per round


@pytest.mark.parametrize(
    "setting, error",
    [
        ("devices.tiers=[0]", "error: devices.tiers: [0.0] is not allowed"),
        ("federation.devices_per_round=5", "error: federation.devices_per_round: 5 is more than the 4 simulated"),
        ("data.device_roots=/nonexistent/roots", "error: data.device_roots: "),
    ],
)
def test_bad_config_is_one_line_error(tmp_path, setting, error):
    args = ["simulate", TINY, "--output-dir", str(tmp_path), "--set", setting]
    if "device_roots" in setting:
        args += ["--set", "data.class_names=[a,b,c,d,e,f,g,h,i,j]"]
    res = run_fleet(args, timeout=120)
    assert res.returncode == 2
    assert res.stdout.strip().splitlines()[-1].startswith(error), res.stdout[-500:]
    assert "Traceback" not in res.stdout and not (tmp_path / "fleet-tiny").exists()  # nothing started


def test_profile_of_another_batch_size_stops_the_launch_in_one_line(tmp_path):
    """Regression: a mismatched hardware.profile used to fail every ClientApp inside Flower (a Ray
    traceback per device) and end a 'finished' run with no device trained."""
    profile = tmp_path / "p8.yaml"
    made = run_fleet(["profile", "--config", TINY, "--batch-size", "8", "--out", str(profile)], timeout=120)
    assert made.returncode == 0, made.stdout
    res = run_fleet(
        ["simulate", TINY, "--output-dir", str(tmp_path / "runs"), "--set", f"hardware.profile={profile}"], timeout=120
    )
    assert res.returncode == 2
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith(
        f"error: profile {profile} (hardware.profile) was measured at batch size 8, training uses 16"
    )
    assert "Traceback" not in res.stdout
    assert not (tmp_path / "runs").exists()  # nothing started, nothing moved aside


def test_flwr_without_the_simulation_internals_is_named_in_one_line(tmp_path, monkeypatch):
    """`fleet simulate` leans on flwr 1.42's simulation internals; another flwr must say so, not crash."""
    from fleet.base.errors import FleetError
    from fleet.commands.simulation import run_simulation
    from fleet.federated.shared.config import fleet_config_from_dict

    monkeypatch.setitem(sys.modules, "flwr.simulation.run_simulation", None)  # what a release without it looks like
    with pytest.raises(
        FleetError, match=r"fleet simulate needs flwr 1\.42\.x, found .*pip install 'flwr\[simulation\]>=1\.42,<1\.43'"
    ):
        run_simulation(fleet_config_from_dict({"output_dir": str(tmp_path)}), tmp_path / "cfg.yaml", resume=False)
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_resume_after_killed_server_loses_nothing(tmp_path):
    args = ["simulate", TINY, "--output-dir", str(tmp_path), "--rounds", "4"]
    run = tmp_path / "fleet-tiny"
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    proc = subprocess.Popen(
        fleet_cmd(*args),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 400
        while time.time() < deadline:
            if (run / "metrics.jsonl").is_file() and len(read_metrics(run)) >= 2:
                break
            assert proc.poll() is None, "the simulation ended before it could be killed"
            time.sleep(0.5)
        else:
            pytest.fail("no round completed in time")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the server dies mid-run, Ray and all
        proc.wait()
    done = read_metrics(run)
    assert 2 <= len(done) < 4
    before = {r["round"]: r for r in done}
    res = run_fleet([*args, "--resume"])
    assert res.returncode == 0, res.stdout[-3000:]
    assert "resuming fleet-tiny after round" in res.stdout
    recs = read_metrics(run)
    assert [r["round"] for r in recs] == [1, 2, 3, 4]  # every round exactly once
    for r in recs:
        if r["round"] in before and r["round"] <= len(done) - 1:
            assert r == before[r["round"]]  # completed rounds are kept as they were
    assert all(b["sim_time_s"] > a["sim_time_s"] for a, b in zip(recs, recs[1:]))  # the clock continues
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds"] == 4
    import torch

    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    assert ckpt["meta"]["round"] == 4


def test_eval_every_and_eval_devices_ask_fewer_devices_less_often(tmp_path):
    """evaluation.every=2 over 3 rounds: rounds 2 and 3 (the last) evaluate; eval_devices=2: a seeded
    2 of the 3 devices trained that round are asked, and only they carry accuracies."""
    args = ["simulate", TINY, "--output-dir", str(tmp_path), "--rounds", "3"]
    for s in ("federation.devices_per_round=3", "evaluation.every=2", "evaluation.devices=2"):
        args += ["--set", s]
    res = run_fleet(args)
    assert res.returncode == 0, res.stdout[-3000:]
    r1, r2, r3 = read_metrics(tmp_path / "fleet-tiny")
    assert r1["global_accuracy"] is None and r1["personal_accuracy"] is None
    assert not any("global_accuracy" in d for d in r1["devices"]) and len(r1["devices"]) == 3
    for r in (r2, r3):
        scored = [d["device"] for d in r["devices"] if "global_accuracy" in d]
        assert len(scored) == 2 and set(scored) <= set(r["sampled"]) and len(r["sampled"]) == 3
        assert 0 <= r["global_accuracy"] <= 1
    summary = json.loads((tmp_path / "fleet-tiny" / "summary.json").read_text())
    assert summary["final_accuracy"] == r3["global_accuracy"]
    assert "round   1/3" in res.stdout and "global   n/a" in res.stdout
    assert (tmp_path / "fleet-tiny" / "accuracy.png").stat().st_size > 1000


def test_device_classes_set_each_devices_speed_uplink_and_availability(tmp_path):
    """Two classes over 6 devices: "slow" (tier 2, 20 Mbit/s, online by a trace) and "fast" (tier 1, a
    lognormal uplink, online half the rounds). Offline devices are never sampled, each device's upload
    counts at its own uplink, and rows, summary.json and classes.png break results down per class."""
    import yaml

    from fleet.federated.shared.classes import bandwidth_of, online
    from fleet.federated.shared.config import load_fleet_config

    (tmp_path / "trace.yaml").write_text("period_s: 1000000\ndevices:\n  - [[0, 1000000]]\n  - [[0, 1]]\n")
    classes = [
        {"name": "slow", "share": 0.5, "tier": 2, "bandwidth_mbps": 20, "trace": str(tmp_path / "trace.yaml")},
        {"name": "fast", "share": 0.5, "bandwidth_mbps": 100, "bandwidth_sigma": 0.5, "availability": 0.5},
    ]
    cfg = yaml.safe_load((ROOT / TINY).read_text())
    cfg["federation"].update(rounds=3, devices_per_round=3)
    cfg["devices"].update(num_devices=6, device_classes=classes)
    cfg["output_dir"] = str(tmp_path / "runs")
    (tmp_path / "classes.yaml").write_text(yaml.safe_dump(cfg))
    res = run_fleet(["simulate", str(tmp_path / "classes.yaml")])
    assert res.returncode == 0, res.stdout[-3000:]
    run = tmp_path / "runs" / "fleet-tiny"
    eff = load_fleet_config(run / "fleet-config.yaml")
    for r in read_metrics(run):
        for d in r["devices"]:
            pid = d["partition_id"]
            assert online(eff, pid, r["round"], r["sim_time_s"] - r["round_time_s"]), (r["round"], d["device"])
            assert d["class"] == ("slow" if d["tier"] == 2.0 else "fast")
        offline = {
            f"device-{p}" for p in range(6) if not online(eff, p, r["round"], r["sim_time_s"] - r["round_time_s"])
        }
        assert set(r["offline"]) == offline and not offline & set(r["sampled"])
        assert r["round_time_s"] == pytest.approx(
            max(
                d["predicted_time_s"] + d["bytes_uploaded"] / bandwidth_of(eff, d["partition_id"]) for d in r["devices"]
            )
        )
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["classes"]) <= {"slow", "fast"} and summary["classes"]
    for name, c in summary["classes"].items():
        assert c["devices_trained"] >= 1 and c["speedup_mean"] > 0 and c["bytes_uploaded"] > 0, name
    assert {d.get("class") for d in summary["devices"].values()} <= {"slow", "fast"}
    assert (run / "classes.png").stat().st_size > 1000


def test_device_roots_train_each_device_on_exactly_its_own_files(tmp_path):
    """data.device_roots: one folder per device, named for it (a natural split, as LEAF's per-writer
    FEMNIST); 2 of the 4 sampled per round, seeded; each trains and is evaluated on its own PNGs only."""
    import yaml

    from fleet.data.datasets import load_dataset
    from tests.test_devices_loopback import CLASS_NAMES, write_trees

    trees = {
        "alice": {"tshirt": 10, "bag": 6},
        "bob": {"dress": 8, "coat": 8, "sneaker": 5},
        "carol": {"sandal": 12},
        "dave": {"boot": 7, "trouser": 7, "shirt": 1},
    }
    fmnist = load_dataset("fashion-mnist", "train")
    files = write_trees(tmp_path / "roots", trees, fmnist.images.numpy(), fmnist.labels.numpy())
    cfg = yaml.safe_load((ROOT / TINY).read_text())
    cfg["data"].update(class_names=CLASS_NAMES, device_roots=str(tmp_path / "roots"))
    cfg["federation"].update(rounds=3, devices_per_round=2)
    cfg["devices"].update(num_devices=9)  # num_devices: set from the folders
    cfg["output_dir"] = str(tmp_path / "runs")
    (tmp_path / "roots.yaml").write_text(yaml.safe_dump(cfg))
    res = run_fleet(["simulate", str(tmp_path / "roots.yaml")])
    assert res.returncode == 0, res.stdout[-3000:]
    assert "data.device_roots holds 4 devices: devices.num_devices = 4" in res.stdout
    recs = read_metrics(tmp_path / "runs" / "fleet-tiny")
    assert [r["round"] for r in recs] == [1, 2, 3]
    assert sorted(recs[0]["joined"]) == sorted(trees)
    sampled = [r["sampled"] for r in recs]
    assert all(len(s) == 2 for s in sampled) and len({tuple(s) for s in sampled}) > 1, sampled
    for r in recs:
        rows = {d["device"]: d for d in r["devices"]}
        assert set(rows) == set(r["sampled"]) and r["missed"] == []  # only the sampled devices trained
        for name, d in rows.items():
            assert d["train_examples"] + d["test_examples"] == files[name], (name, d)
            assert d["test_examples"] >= sum(n >= 2 for n in trees[name].values())  # each class held out
    summary = json.loads((tmp_path / "runs" / "fleet-tiny" / "summary.json").read_text())
    assert set(summary["devices"]) == {n for s in sampled for n in s}


@pytest.mark.parametrize("checkpoint", [b"not a checkpoint", None])
def test_resume_without_a_readable_checkpoint_stops_and_keeps_every_file(tmp_path, checkpoint):
    """Starting over would rewrite metrics.jsonl from round 1: a resume that cannot read its
    checkpoint (cut short, or missing beside the metrics) is one line, and nothing is touched."""
    run = tmp_path / "fleet-tiny"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"round": 1}\n{"round": 2}\n')
    if checkpoint is not None:
        (run / "checkpoint.pt").write_bytes(checkpoint)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    res = run_fleet(["simulate", TINY, "--output-dir", str(tmp_path), "--resume"], timeout=120)
    assert res.returncode == 2, res.stdout[-2000:]
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("error: resume: ") and "nothing was changed" in last
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet-tiny"]  # nothing moved aside

"""Open membership on loopback: named devices with their own image folders join, die, stall and come back.

Real `flower-superlink` and `flower-supernode` processes (insecure), as in test_deploy_loopback.
Each device is a SuperNode whose node config names its own ImageFolder tree of real Fashion-MNIST
PNGs (`data-root`), its name (`device-name`) and a state dir; there is no partition id. The test
drives the fleet between rounds by polling `<run>/metrics.jsonl`:

1. pi-a, pi-b, pi-c (good) and pi-x (a folder "unicorn" the fleet does not know) are up; the run is submitted;
2. after round 1, pi-d starts (joins mid-run), and pi-twin, whose node config claims the live pi-c's name (refused);
3. after round 2, pi-a is SIGKILLed and pi-b SIGSTOPped (one dead, one hung: the round must not wait
   past its deadline + grace for either);
4. after round 3, pi-a restarts (a new process and node id, the same state dir): it must continue
   from its saved state, not start over;
5. the run must finish (6 rounds) and say who trained, joined, missed and was refused, by name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from fleet.data.datasets import load_dataset
from fleet.federated.on_server.tracking import read_progress, read_records
from tests.test_deploy_loopback import ROOT, Loopback, measure_profile, run_status, wait_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

NAME = "devices"  # the fleet config's name: runs/devices/ and <state-dir>/devices/state.pt
ROUNDS = 6
# grace_s covers a ClientApp's start, data, training and 45 MB reply: with six SuperNodes, a SuperLink and
# the ServerApp on 2 shared cores a healthy device's reply once took more than 20 s.
GRACE_S = 40.0
PULL_SLACK_S = 1.0  # the train wait stops pulling when a pull would end past its bound, as far as recent pulls tell
HEALTHY = ("pi-c", "pi-d")  # never killed, stopped or refused: never missed, never benched
ROUND_WAIT_S = 300.0  # the longest the test waits for one round's line (round 1 includes ClientApp cold starts)
# Fashion-MNIST's label order: the fleet's class names, so a folder name is a label on every device
CLASS_NAMES = ["tshirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"]
# Images per class folder on each device: different subsets (non-IID), and uneven counts (a class of
# 7, one of a single image) so a held-out split that is not stratified per class shows in the counts.
TREES: dict[str, dict[str, int]] = {
    "pi-a": {"tshirt": 12, "trouser": 12, "bag": 12},
    "pi-b": {"dress": 12, "coat": 12, "sneaker": 12, "bag": 7},
    "pi-c": {"sandal": 12, "shirt": 12, "boot": 12, "trouser": 1},
    "pi-d": {"pullover": 12, "boot": 12, "tshirt": 12},
    "pi-x": {"shirt": 12, "unicorn": 12},  # "unicorn" is no class of the fleet's: the device is refused
    "pi-twin": {"coat": 4},  # claims pi-c's name while pi-c is alive: refused, never merged with pi-c
}
CLAIMS = {"pi-twin": "pi-c"}  # device -> the name its node config gives it (default: its own)
FIRST = ("pi-a", "pi-b", "pi-c")  # the good devices up before the run starts


def write_trees(root: Path, trees: dict[str, dict[str, int]], images: np.ndarray, labels: np.ndarray) -> dict[str, int]:
    """root/<device>/<class>/<i>.png from real Fashion-MNIST images (uint8, (N, 1, 28, 28)), as a
    device's camera would leave them; no image is on two devices. Folders of unknown classes get
    label-0 images. Returns each device's number of PNGs (what its train + test must add up to)."""
    from PIL import Image

    by_label = {k: np.flatnonzero(labels == k) for k in range(len(CLASS_NAMES))}
    used = dict.fromkeys(by_label, 0)
    for device, classes in trees.items():
        for cls, n in classes.items():
            label = CLASS_NAMES.index(cls) if cls in CLASS_NAMES else 0
            folder = root / device / cls
            folder.mkdir(parents=True)
            for i, idx in enumerate(by_label[label][used[label] : used[label] + n]):
                Image.fromarray(images[idx][0]).save(folder / f"{i}.png")
            used[label] += n
    return {device: len(list((root / device).rglob("*.png"))) for device in trees}


def devices_config(tmp_path: Path, env: dict) -> tuple[Path, Path]:
    """fleet-tiny on the devices' own 16x16 ImageFolder data, 6 rounds of open membership, and one
    profile measured for all devices (identical boards: budgets do not depend on who timed itself when)."""
    cfg = yaml.safe_load((ROOT / "simulations/fleet-tiny.yaml").read_text())
    cfg["name"] = NAME
    cfg["output_dir"] = str(tmp_path / "runs")
    cfg["model"].update(num_classes=len(CLASS_NAMES), in_channels=1)
    cfg["data"].update(dataset="imagefolder", input_size=16, class_names=CLASS_NAMES)
    cfg["federation"].update(rounds=ROUNDS, devices_per_round=None, local_steps=2, timeout_s=300)
    cfg["membership"] = {"min_devices": 3, "grace_s": GRACE_S, "max_missed": 1}
    cfg["devices"].update(test_fraction=0.25)
    config_path = tmp_path / f"{NAME}.yaml"
    config_path.write_text(yaml.safe_dump(cfg))
    return config_path, measure_profile(config_path, env, tmp_path / "profile.yaml")


def start_device(link: Loopback, tmp_path: Path, profile: Path, device: str, log: str) -> subprocess.Popen:
    """A SuperNode for ``device``: its own tree, name, profile and state dir (the same on a restart,
    which is what lets it resume). Returns once its ClientAppIo port is open, as deploy() waits."""
    data, state = tmp_path / "data" / device, tmp_path / "state" / device
    name = CLAIMS.get(device, device)
    config = f"data-root='{data}' device-name='{name}' profile='{profile}' state-dir='{state}'"
    node = link.start_node(list(TREES).index(device), config, register=False, name=log)
    wait_port(int(node.args[node.args.index("--port") + 1]), node, link.logs[log])
    return node


def link_tail(link: Loopback) -> str:
    return link.logs["superlink"].read_text()[-3000:]


def wait_round(link: Loopback, run: Path, n: int, timeout: float = ROUND_WAIT_S) -> None:
    """Blocks until round ``n`` has closed (its line in metrics.jsonl may wait on the next round's scores):
    the test changes the fleet between rounds.
    Polls the file often (acting late would shift the change into the next round) and `flwr ls`
    rarely, to fail at once when the run ended early instead of waiting out ``timeout``."""
    deadline, status_at = time.time() + timeout, time.time() + 10
    while time.time() < deadline:
        if read_progress(run)[0] >= n:
            return
        if time.time() >= status_at:
            runs = run_status(link.env)["runs"]
            if runs and runs[0]["status"].startswith("finished"):
                pytest.fail(f"run ended before round {n}: {runs[0]}\n{link_tail(link)}")
            status_at = time.time() + 10
        time.sleep(0.25)
    pytest.fail(f"round {n} not closed after {timeout}s\n{link_tail(link)}")


def drive(link: Loopback, tmp_path: Path, config_path: Path, profile: Path, nodes: dict[str, subprocess.Popen]) -> None:
    """The fleet's life, steps 1-5 of the module docstring. ``nodes`` (device -> its SuperNode) is
    the caller's, so that its cleanup can resume the stopped pi-b whatever step failed."""
    run = tmp_path / "runs" / NAME
    for device in (*FIRST, "pi-x"):
        nodes[device] = start_device(link, tmp_path, profile, device, device)
    link.submit(config_path)
    wait_round(link, run, 1)
    nodes["pi-d"] = start_device(link, tmp_path, profile, "pi-d", "pi-d")
    nodes["pi-twin"] = start_device(link, tmp_path, profile, "pi-twin", "pi-twin")
    wait_round(link, run, 2)
    os.killpg(nodes["pi-a"].pid, signal.SIGKILL)  # dead: its connection and ClientApp gone at once
    os.killpg(nodes["pi-b"].pid, signal.SIGSTOP)  # hung: connected as far as the SuperLink knows, never answers
    nodes["pi-a"].wait(timeout=30)
    wait_round(link, run, 3)
    nodes["pi-a"] = start_device(link, tmp_path, profile, "pi-a", "pi-a-restarted")
    link.wait_finished(timeout=600)


def trained(record: dict) -> dict[str, dict]:
    """The rows of the devices that trained in ``record``'s round (they report a speedup), by name."""
    return {d["device"]: d for d in record["devices"] if "speedup" in d}


def names(entries: list) -> set[str]:
    """Device names of a `joined`/`missed` list (names, or rows that carry one under "device")."""
    return {e if isinstance(e, str) else e["device"] for e in entries}


def check_rounds(records: list[dict]) -> None:
    """Six rounds, each within its whole bound (evaluation and pushes included) and its train wait
    within the train bound, though one device is dead and one hung; their loss noticed as misses in
    round 3 or 4, with the reason; no healthy device missed or benched."""
    assert [r["round"] for r in records] == list(range(1, ROUNDS + 1)), [r.get("round") for r in records]
    for r in records:
        brief = {k: v for k, v in r.items() if k != "devices"}
        assert r["round_wall_s"] <= r["round_bound_s"], brief
        assert r["server_s"]["wait_train_s"] <= r["train_bound_s"] + PULL_SLACK_S, brief
        assert not set(HEALTHY) & (set(r["missed"]) | set(r["benched"])), brief
        assert set(r["miss_reasons"]) == set(r["missed"]), brief
    assert any(r["missed"] for r in records if r["round"] in (3, 4)), [r["missed"] for r in records]
    reasons = [why for r in records for why in r["miss_reasons"].values()]
    assert all("no reply within its bound" in why or "SuperLink answered" in why for why in reasons), reasons


def check_rows(records: list[dict], files: dict[str, int]) -> None:
    """Every row names its device (no partition ids); a trained row counts its rounds; a row with both
    splits counts exactly the PNGs in its tree, with at least one held-out image of each class that has two
    or more (a stratified split). A round's model is scored by the next round's trainers (evaluation.pipelined,
    on by default here), so a row may hold one split alone: a device that trained and then left, or one that
    scored a round it did not train in."""
    seen, counted = set(), set()
    for r in records:
        for d in r["devices"]:
            assert "device" in d and "node_id" in d and "partition_id" not in d, (r["round"], d)
            assert "train_examples" in d or "test_examples" in d, (r["round"], d)
            assert "train_examples" not in d or "rounds_trained" in d, (r["round"], d)
            name = d["device"]
            seen.add(name)
            if "test_examples" in d:
                assert d["test_examples"] >= sum(n >= 2 for n in TREES[name].values()), (r["round"], d)
            if "train_examples" in d and "test_examples" in d:
                assert d["train_examples"] + d["test_examples"] == files[name], (r["round"], d)
                counted.add(name)
    assert seen >= {"pi-a", "pi-b", "pi-c", "pi-d"}, seen
    assert counted >= {"pi-a", "pi-b", "pi-c", "pi-d"}, counted


def check_membership(records: list[dict]) -> None:
    """Who trained when: the first three in round 1; pi-x never (refused over its 'unicorn' folder);
    pi-d from its join on; pi-b not after it hung (missed in round 3)."""
    by_round = {r["round"]: trained(r) for r in records}
    assert set(by_round[1]) == set(FIRST), by_round[1].keys()
    assert all("pi-x" not in t for t in by_round.values())
    refused = [e for r in records for e in r["refused"]]
    unicorn = [e for e in refused if "unicorn" in e["reason"]]
    assert unicorn, refused
    row_ids = {d["node_id"] for r in records for d in r["devices"]}
    assert row_ids.isdisjoint(e["node_id"] for e in unicorn), (unicorn, row_ids)
    twin = [e for e in refused if "'pi-c' is already used by node" in e["reason"]]
    assert twin and all(e["device"] == "pi-c" and "\n" not in e["reason"] for e in twin), refused
    assert row_ids.isdisjoint(e["node_id"] for e in twin), (twin, row_ids)  # pi-c's rows are pi-c's alone
    joined = [r["round"] for r in records if "pi-d" in names(r["joined"])]
    assert joined and joined[0] in (2, 3), [r["joined"] for r in records]
    # it connects while round 2 runs and trains from round 3 on, every round
    assert all("pi-d" in by_round[n] for n in range(3, ROUNDS + 1)), by_round
    assert "pi-b" in names(records[2]["missed"]), records[2]["missed"]
    assert all("pi-b" not in t for n, t in by_round.items() if n > 2), by_round


def check_resume(records: list[dict]) -> None:
    """pi-a, killed after round 2 and restarted after round 3, trains again in round 5 or 6 with its
    count of trained rounds carried on from its saved state: before + rounds trained since, not 1."""
    rows = {r["round"]: trained(r)["pi-a"] for r in records if "pi-a" in trained(r)}
    before = [n for n in rows if n <= 2]
    assert before, rows
    done = rows[max(before)]["rounds_trained"]
    assert done == len(before), rows  # counted from 1 in this run
    again = [n for n in rows if n >= 5]
    assert again, sorted(rows)
    for n in again:
        since = sum(2 < m <= n for m in rows)
        assert rows[n]["rounds_trained"] == done + since, (n, rows[n], sorted(rows))


def check_outputs(tmp_path: Path, run: Path) -> None:
    """summary.json keyed by device name, and each device's state where its state dir says."""
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds"] == ROUNDS
    assert {"pi-a", "pi-c", "pi-d"} <= set(summary["devices"]), summary["devices"].keys()
    assert "pi-x" not in summary["devices"]
    for device in ("pi-a", "pi-c", "pi-d"):
        assert (tmp_path / "state" / device / NAME / "state.pt").is_file(), device


def test_named_devices_join_die_hang_and_resume_on_loopback(tmp_path):
    link = Loopback(tmp_path, secure=False)
    config_path, profile = devices_config(tmp_path, link.env)
    fmnist = load_dataset("fashion-mnist", "train")
    files = write_trees(tmp_path / "data", TREES, fmnist.images.numpy(), fmnist.labels.numpy())
    nodes: dict[str, subprocess.Popen] = {}
    try:
        link.start_link()
        drive(link, tmp_path, config_path, profile, nodes)
    finally:
        if "pi-b" in nodes and nodes["pi-b"].poll() is None:
            os.killpg(nodes["pi-b"].pid, signal.SIGCONT)  # a stopped process acts on stop()'s SIGTERM only once resumed
        link.stop()
    run = tmp_path / "runs" / NAME
    records = [r.to_json() for r in read_records(run)]  # as metrics.jsonl holds them
    check_rounds(records)
    check_rows(records, files)
    check_membership(records)
    check_resume(records)
    check_outputs(tmp_path, run)

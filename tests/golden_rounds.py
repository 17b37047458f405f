"""The fleet's behaviour, pinned: per-round accuracy, bytes and selections of small seeded runs.

A redesign must not change what a round does. This script runs a few tiny fleets through the
real CLI (``fleet simulate``, Flower's simulation engine), each from the same size-computed
profile, the same seeded start and the same data, and keeps only what the code decides: the
global and personalized accuracy of every round, the bytes uploaded, the deadline and simulated
clock, and per device its selection (tensors, trained fraction, rho, predicted time, bytes).

    python tests/golden_rounds.py --write    # record tests/data/golden-rounds-<capability>-<vendor>.json
    python tests/golden_rounds.py            # compare a fresh run with them (exit 1 when it equals none)

Training's floats depend on the numeric libraries' builds (torch's kernels, numpy's sums) and on the
instruction set torch dispatches to (``torch.backends.cpu.get_cpu_capability()``: AVX2 and AVX-512 kernels
sum in other orders, and a round's selection follows the last bits), so a recording holds only under the
dependency set it was made with, ``requirements.lock`` (which ``scripts/install.sh`` installs), on a CPU of
its capability. Even one capability's kernels are not one: oneDNN picks its own code path from the CPU's other
features (VNNI, BF16, AMX), so an Intel and an AMD AVX-512 machine sum a convolution in other orders. Each
capability therefore has one recording per CPU it was made on (``golden-rounds-<capability>[-<vendor>].json``),
each naming what it was made under; a run must equal one of them exactly, and a difference from the closest
one says first where the environment is not that recording's. Replies are aggregated in device-name order, so
the arrival order of the simulation's replies does not enter.

``tests/test_golden_rounds.py`` runs the comparison.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
CONFIG = "simulations/fleet-tiny.yaml"

# name -> overrides of fleet-tiny: the strategies, a personal head, fine-tuning before evaluation, Ditto
RUNS: dict[str, dict[str, object]] = {
    "fleet-head-finetune": {
        "federation.strategy": "fleet",
        "personalization.policy": "head",
        "personalization.finetune_steps": 2,
    },
    "naive-tight": {"federation.strategy": "naive", "federation.deadline_factor": 0.3},
    "ditto": {"federation.strategy": "ditto"},
}
ROUNDS = 3
# recorded before device momentum was saved in float16 and before transfers were float16 (their rounding moves
# every round after the first, by design: docs/state-precision-result.json, docs/results.md "Compact transfers");
# the rest of what a round decides must still be exactly the recording's
PINNED = {"federation.state_precision": "float32", "federation.transfer": "float32"}
ROUND_KEYS = ("deadline_s", "round_time_s", "sim_time_s", "global_accuracy", "personal_accuracy", "bytes_uploaded")
DEVICE_KEYS = ("selected", "trained_fraction", "rho", "predicted_time_s", "bytes_uploaded", "global_accuracy")
TOLERANCE = 1e-6  # accuracies and seconds: float sums in another order may move the last bits, nothing more
NUMERIC = ("torch", "numpy")  # the libraries whose builds decide a round's floats
CAPABILITY = "cpu_capability"  # ... and the instruction set torch's kernels run in (AVX2, AVX512)


def write_profile(path: Path) -> None:
    """fleet-tiny's model profiled from tensor sizes (tests/conftest.py): the same on every machine."""
    sys.path.insert(0, str(ROOT))
    from tests.conftest import proportional_profile, small_model

    proportional_profile(small_model(), batch_size=16, input_size=16).save(path)


def run_one(name: str, overrides: dict[str, object], profile: Path, out: Path) -> list[dict]:
    """One seeded run's rounds, reduced to what the code decides."""
    sets = {**overrides, "hardware.profile": str(profile), "federation.rounds": ROUNDS, "output_dir": str(out)}
    sets.update(PINNED)
    cmd = [sys.executable, "-m", "fleet.cli", "simulate", CONFIG, "--name", f"golden-{name}"]
    cmd += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"{name}: fleet simulate exited {done.returncode}:\n{tail}")
    lines = (out / f"golden-{name}" / "metrics.jsonl").read_text().splitlines()
    return [reduce(json.loads(line)) for line in lines]


def reduce(rec: dict) -> dict:
    devices = {d["device"]: {k: d[k] for k in DEVICE_KEYS if k in d} for d in rec["devices"]}
    return {**{k: rec[k] for k in ROUND_KEYS}, "devices": devices}


def differences(expected: object, got: object, where: str = "") -> list[str]:
    """Every place ``got`` differs from ``expected`` (numbers within TOLERANCE)."""
    if isinstance(expected, dict) and isinstance(got, dict):
        out = [f"{where}.{k}: missing" for k in expected if k not in got]
        out += [f"{where}.{k}: unexpected" for k in got if k not in expected]
        for k in expected.keys() & got.keys():
            out += differences(expected[k], got[k], f"{where}.{k}")
        return out
    if isinstance(expected, list) and isinstance(got, list):
        if len(expected) != len(got):
            return [f"{where}: {len(got)} entries, expected {len(expected)}"]
        return [d for i, (e, g) in enumerate(zip(expected, got)) for d in differences(e, g, f"{where}[{i}]")]
    if isinstance(expected, float) and isinstance(got, (int, float)):
        close = math.isclose(expected, got, rel_tol=TOLERANCE, abs_tol=TOLERANCE)
        return [] if close else [f"{where}: {got} != {expected}"]
    return [] if expected == got else [f"{where}: {got!r} != {expected!r}"]


def environment() -> dict[str, str]:
    """The numeric libraries' versions (torch's includes its build, e.g. +cu130) and the instruction set."""
    import importlib

    import torch

    versions = {name: importlib.import_module(name).__version__ for name in NUMERIC}
    return {**versions, CAPABILITY: torch.backends.cpu.get_cpu_capability()}


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it (GenuineIntel, AuthenticAMD), or "unknown"."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")), "unknown")


def golden_path(capability: str | None = None, vendor: str | None = None) -> Path:
    """Where this machine's recording is written: its capability and its CPU's vendor."""
    return DATA / f"golden-rounds-{capability or environment()[CAPABILITY]}-{vendor or cpu_vendor()}.json"


def recordings(capability: str | None = None) -> dict[Path, dict]:
    """Every recording made on a CPU of this capability (the first ones were named by capability alone)."""
    cap = capability or environment()[CAPABILITY]
    paths = sorted({*DATA.glob(f"golden-rounds-{cap}.json"), *DATA.glob(f"golden-rounds-{cap}-*.json")})
    return {path: json.loads(path.read_text()) for path in paths}


def compare(recorded: dict[Path, dict], got: dict) -> tuple[Path, list[str]]:
    """The recording closest to ``got`` and how ``got`` differs from it: none when it equals that one."""
    diffs = {path: differences(rec["runs"], got) for path, rec in recorded.items()}
    closest = min(diffs, key=lambda path: len(diffs[path]))
    return closest, diffs[closest]


def environment_note(recorded: dict[str, str]) -> str | None:
    """One line when this environment is not the recording's, else None."""
    here = environment()
    if {k: recorded.get(k) for k in here} == here:
        return None
    return f"recorded under {recorded}, running under {here}: install with scripts/install.sh (requirements.lock)"


def run_all() -> dict[str, list[dict]]:
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "profile.yaml"
        write_profile(profile)
        return {name: run_one(name, overrides, profile, Path(tmp) / "runs") for name, overrides in RUNS.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record this CPU's recording")
    args = parser.parse_args()
    got = run_all()
    if args.write:
        path = golden_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        made = {**environment(), "cpu": cpu_vendor()}
        path.write_text(json.dumps({"environment": made, "runs": got}, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path}")
        return 0
    recorded = recordings()
    if not recorded:
        print("no recording for this CPU's capability; make one: python tests/golden_rounds.py --write")
        return 1
    closest, diffs = compare(recorded, got)
    note = environment_note(recorded[closest]["environment"]) if diffs else None
    print("\n".join(([note] if note else []) + diffs[:40]) or f"same rounds as {closest.name}")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())

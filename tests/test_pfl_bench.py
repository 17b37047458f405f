"""fleet bench pfl: personalized accuracy at equal simulated time, per device, and new devices."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from fleet.bench.pfl import combine, personalized_curve, pfl_table, seed_figures


def run(tmp_path, name: str, points: list[tuple[float, float, list[float]]], key: str) -> dict:
    """A finished run's summary and metrics.jsonl: (sim time, mean, per-device accuracies) per round."""
    out = tmp_path / name
    out.mkdir()
    records = [
        {
            "round": i + 1,
            "sim_time_s": t,
            "global_accuracy": 0.5,
            key: a,
            "bytes_uploaded": 100,
            "devices": [{"device": f"d{j}", key: v} for j, v in enumerate(devs)],
        }
        for i, (t, a, devs) in enumerate(points)
    ]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    history = [{k: r[k] for k in ("round", "sim_time_s", "global_accuracy", key, "bytes_uploaded")} for r in records]
    return {"run_dir": str(out), "sim_time_s": points[-1][0], "history": history}


def test_each_method_is_judged_on_its_own_personalized_accuracy_at_the_baselines_horizon(tmp_path):
    summaries = {
        "fedavg_ft": run(tmp_path, "ft", [(20, 0.6, [0.5, 0.7]), (40, 0.8, [0.7, 0.9])], "finetuned_accuracy"),
        "fleet_head": run(
            tmp_path, "fh", [(10, 0.7, [0.6, 0.8]), (30, 0.85, [0.8, 0.9]), (50, 0.99, [1.0, 1.0])], "personal_accuracy"
        ),
    }
    rep = seed_figures(summaries, target_fraction=0.95)
    assert rep["horizon_s"] == 40 and rep["target_accuracy"] == pytest.approx(0.95 * 0.8)
    base, fleet = rep["methods"]["fedavg_ft"], rep["methods"]["fleet_head"]
    assert base["personalized_accuracy_mean"] == pytest.approx(0.8) and base["time_to_target_s"] == 40
    assert fleet["personalized_accuracy_mean"] == pytest.approx(0.85)  # round 3 lies past the horizon
    assert fleet["time_to_target_s"] == 30 and fleet["speedup_vs_baseline"] == pytest.approx(40 / 30)
    assert fleet["device_accuracies"] == [0.8, 0.9] and fleet["personalized_accuracy_p10"] == pytest.approx(0.81)
    assert personalized_curve(summaries["fedavg_ft"]["history"], "fedavg_ft")[0]["global_accuracy"] == 0.6

    both = combine({0: rep, 1: rep})
    assert both["fleet_head"]["personalized_accuracy_mean"] == pytest.approx(0.85)
    assert both["fleet_head"]["personalized_accuracy_mean_ci95"] == pytest.approx(0.0)
    report = {"comparison": "x", "seeds": [0, 1], "target_fraction_of_baseline": 0.95, "methods": both}
    report["new_devices"] = {"elastic": {"final_accuracy": 0.9, "device_time_s": 5.0, "time_vs_full": 0.5}}
    table = pfl_table(report)
    assert "fleet_head" in table and "1.33x" in table and "90.00% in 5.0s of device time (0.50x full's)" in table


@pytest.mark.slow
def test_the_pfl_bench_runs_end_to_end_on_a_tiny_fleet(tmp_path, capsys):
    """Two methods, one round each, one new device: every figure, plot and the new device's curves."""
    from fleet.bench.pfl import bench_pfl

    overrides = {
        "output_dir": str(tmp_path),
        "federation.rounds": 1,
        "devices.newcomers": 1,
        "devices.shift.rotation_deg": 45,
        "devices.shift.domains": 2,
    }
    report = bench_pfl(
        "simulations/fleet-tiny.yaml",
        overrides,
        methods=["fleet_head"],
        finetune_steps=2,
        newcomer_epochs=1,
        quiet=True,
    )
    assert set(report["methods"]) == {"fedavg_ft", "fleet_head"}
    for entry in report["methods"].values():
        assert 0 <= entry["personalized_accuracy_mean"] <= 1 and entry["bytes_uploaded"] > 0
    assert set(report["new_devices"]) == {"full", "tl", "bn_bias", "elastic"}
    assert all(len(e["curve"]) == 2 and e["device_time_s"] > 0 for e in report["new_devices"].values())
    assert all(len(r["methods"]["fleet_head"]["device_accuracies"]) == 3 for r in report["per_seed"].values())
    for path in report["plots"]:
        assert (tmp_path / path.split("/")[-1]).stat().st_size > 3000
    # The new devices again, from the finished run alone, as `--newcomers-from` does: the run the bench took them
    # from, the baseline's (no "fleet" method ran), so the same final global model
    from fleet.cli import main

    fleet_run = tmp_path / "fleet-tiny-s0-fedavg_ft"
    argv = ["bench", "pfl", "--newcomers-from", str(fleet_run), "--newcomer-epochs", "1", "--json"]
    assert main([*argv, "--set", "train.interval=1"]) == 0  # fleet-tiny's own interval: nothing changes
    again = json.loads(capsys.readouterr().out)
    assert again["runs"] == [str(fleet_run)] and again["newcomer_lr"] == pytest.approx(1e-3)
    assert again["overrides"] == {"train.interval": 1}
    assert Path(again["plot"]) == tmp_path / "new-devices.png" and Path(again["plot"]).stat().st_size > 3000
    # The same devices, model and lr: the same figures. Not elastic's: on 16 test images its selection can
    # turn on float rounding, which differs with the thread count a process runs with.
    for m in ("full", "tl", "bn_bias"):
        assert again["new_devices"][m]["final_accuracy"] == pytest.approx(report["new_devices"][m]["final_accuracy"])
    assert again["new_devices"]["elastic"]["device_time_s"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--newcomers-from", "{tmp}/nowhere"], "--newcomers-from: {tmp}/nowhere holds no finished fleet run"),
        (["--newcomer-lr", "0"], "--newcomer-lr: 0.0 is not allowed; use a number in (0, 10)"),
        (["--newcomer-epochs", "0"], "--newcomer-epochs: 0 is not allowed"),
    ],
)
def test_bad_newcomer_flags_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    from fleet.cli import main

    assert main(["bench", "pfl", *(a.format(tmp=tmp_path) for a in argv)]) == 2
    err = capsys.readouterr().err.strip()
    assert message.format(tmp=tmp_path) in err and "\n" not in err


@pytest.mark.parametrize("newcomers", [None, 0])
def test_a_corrupt_run_checkpoint_is_one_line_and_exit_2(tmp_path, capsys, newcomers):
    from fleet.cli import main

    (tmp_path / "checkpoint.pt").write_bytes(b"not a checkpoint")
    cfg = yaml.safe_load(Path("simulations/pfl.yaml").read_text())
    if newcomers is not None:  # a run without new devices: its checkpoint is read all the same
        cfg["devices"]["newcomers"] = newcomers
    (tmp_path / "fleet-config.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["bench", "pfl", "--newcomers-from", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{tmp_path}/checkpoint.pt: not a readable fleet checkpoint" in err and "\n" not in err


def test_a_run_without_new_devices_has_none_to_personalize(tmp_path, capsys):
    from fleet.cli import main
    from fleet.federated.state import ServerState, save_checkpoint

    cfg = yaml.safe_load(Path("simulations/pfl.yaml").read_text())
    cfg["devices"]["newcomers"] = 0
    (tmp_path / "fleet-config.yaml").write_text(yaml.safe_dump(cfg))
    save_checkpoint(tmp_path, {"w": np.zeros(2, np.float32)}, ServerState())
    assert main(["bench", "pfl", "--newcomers-from", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--newcomers-from: {tmp_path} ran with devices.newcomers 0" in err and "\n" not in err

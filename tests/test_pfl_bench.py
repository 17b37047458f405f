"""fleet bench pfl: personalized accuracy at equal simulated time, per device, and new devices."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from fleet.bench.pfl import build_report, combine_reports, personalized_curve, pfl_table, seed_figures, seed_tag
from fleet.federated.shared.round_record import RoundRecord
from fleet.federated.shared.run_summary import RunSummary


def run(tmp_path, name: str, points: list[tuple[float, float, list[float]]], key: str) -> RunSummary:
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
    (out / "fleet-config.yaml").write_text("hardware:\n  profile: profiles/resnet18-16px-pi4.yaml\n")
    history = [{k: r[k] for k in ("round", "sim_time_s", "global_accuracy", key, "bytes_uploaded")} for r in records]
    return RunSummary.from_json({"run_dir": str(out), "sim_time_s": points[-1][0], "history": history})


def test_each_method_is_judged_on_its_own_personalized_accuracy_at_the_baselines_horizon(tmp_path):
    summaries = {
        "fedavg_ft": run(tmp_path, "ft", [(20, 0.65, [0.5, 0.7]), (40, 0.8, [0.7, 0.9])], "finetuned_accuracy"),
        "fleet_head": run(
            tmp_path, "fh", [(10, 0.7, [0.6, 0.8]), (30, 0.85, [0.8, 0.9]), (50, 0.99, [1.0, 1.0])], "personal_accuracy"
        ),
    }
    rep = seed_figures(summaries, 0.1, 0)
    assert rep["horizon_s"] == 40 and rep["alpha"] == 0.1
    assert rep["profile"]["speed_factor"] == pytest.approx(7.1) and rep["profile"]["host"]["cpu"]  # whose seconds
    base, fleet = rep["methods"]["fedavg_ft"], rep["methods"]["fleet_head"]
    assert base["personalized_accuracy_mean"] == pytest.approx(0.8)
    assert fleet["personalized_accuracy_mean"] == pytest.approx(0.85)  # round 3 lies past the horizon
    assert fleet["device_accuracies"] == [0.8, 0.9] and fleet["personalized_accuracy_p10"] == pytest.approx(0.81)
    # the curve is the devices' mean, as the final figure and the target are, not the round's weighted 0.65
    assert [p["global_accuracy"] for p in base["curve"]] == pytest.approx([0.6, 0.8])
    (point,) = personalized_curve([(RoundRecord(round=2, sim_time_s=5.0), [0.2, 0.4])])
    assert (point["round"], point["sim_time_s"], point["global_accuracy"]) == (2, 5.0, pytest.approx(0.3))


def seed_report(seed: int, alpha: float, figures: dict[str, tuple[float, float, list[tuple[float, float]]]]) -> dict:
    """A seed's figures as seed_figures leaves them: per method (mean, p10, curve of (time, accuracy))."""
    methods = {
        m: {
            "personalized_accuracy_mean": mean,
            "personalized_accuracy_p10": low,
            "bytes_uploaded": 10,
            "global_accuracy_swing": 0.01,
            "curve": [{"sim_time_s": t, "global_accuracy": a} for t, a in curve],
            "device_accuracies": [mean],
        }
        for m, (mean, low, curve) in figures.items()
    }
    return {"alpha": alpha, "seed": seed, "horizon_s": 40, "methods": methods}


def test_fleets_best_method_is_paired_with_the_best_baseline_at_a_target_that_discriminates(tmp_path):
    per_seed = {
        "a0.1-s0": seed_report(
            0,
            0.1,
            {
                "fedavg_ft": (0.70, 0.50, [(20, 0.70)]),
                "ditto": (0.90, 0.80, [(20, 0.85), (40, 0.90)]),
                "fleet_ditto": (0.92, 0.82, [(10, 0.86), (20, 0.92)]),
                "fleet_head": (0.80, 0.70, [(10, 0.80)]),
            },
        ),
        "a0.1-s1": seed_report(
            1,
            0.1,
            {
                "fedavg_ft": (0.60, 0.40, [(20, 0.60)]),
                "ditto": (0.80, 0.70, [(20, 0.80)]),
                "fleet_ditto": (0.80, 0.72, [(10, 0.70), (30, 0.80)]),
                "fleet_head": (0.70, 0.60, [(10, 0.70)]),
            },
        ),
    }
    report = build_report("pfl.yaml", per_seed, {})
    assert report["best_baseline"] == "ditto" and report["by_alpha"]["0.1"]["best_fleet_method"] == "fleet_ditto"
    assert per_seed["a0.1-s0"]["target_accuracy"] == pytest.approx(0.89)  # ditto's final less 1 point
    ditto, ours = report["methods"]["ditto"], report["methods"]["fleet_ditto"]
    assert ditto["time_to_target_s"] == pytest.approx(30)  # 40 s and 20 s
    assert ours["time_to_target_s"] == pytest.approx(25) and ours["reached_target"] == 2  # 20 s and 30 s
    assert ours["speedup_vs_best_baseline"] == pytest.approx((40 / 20 + 20 / 30) / 2)
    assert report["methods"]["fleet_head"]["time_to_target_s"] is None  # not reached: no time, no mean
    assert report["methods"]["fleet_head"]["reached_target"] == 0
    pair = report["paired_vs_best_baseline"]
    assert pair["method"] == "fleet_ditto" and pair["mean_diff"] == pytest.approx(0.01)
    assert pair["mean_diff_ci95_low"] == pytest.approx(0.01 - 12.706 * 0.01414214 / 2**0.5, abs=1e-4)
    assert pair["p10_diff"] == pytest.approx(0.02)
    assert {"protocol", "best_baseline", "paired_vs_best_baseline"} <= set(report)
    assert {"config", "seeds", "comparison", "personalized_accuracy_is", "target_fraction_of_baseline"} <= set(report)
    table = pfl_table(report)
    assert "best baseline ditto" in table and "fleet_ditto - ditto: mean +1.00 points" in table

    # The same seeds in two batch files, with a third beta: pooled and computed again
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(build_report("pfl.yaml", {"a0.1-s0": per_seed["a0.1-s0"]}, {})))
    other = {
        "a5-s0": seed_report(
            0,
            5,
            {
                "fedavg_ft": (0.85, 0.8, [(20, 0.85)]),
                "ditto": (0.84, 0.8, [(20, 0.84)]),
                "fleet_ditto": (0.80, 0.7, [(20, 0.8)]),
                "fleet_head": (0.845, 0.7, [(20, 0.845)]),
            },
        ),
        "a0.1-s1": per_seed["a0.1-s1"],
    }
    second.write_text(json.dumps(build_report("pfl.yaml", other, {})))
    pooled = combine_reports([str(first), str(second)], str(tmp_path / "all.json"))
    assert pooled["paired_vs_best_baseline"]["mean_diff"] == pytest.approx(0.01)
    assert pooled["by_alpha"]["5"]["best_baseline"] == "fedavg_ft"
    choice = pooled["default_policy"]  # fleet_head: 10 points short at 0.1, 0.5 at 5; fleet_ditto: 5 points at 5
    assert choice["chosen"] == "fleet_ditto" and choice["worst_gap"] == pytest.approx(-0.05)
    assert (tmp_path / "all.json").is_file()


def test_batches_that_ran_different_methods_pool_on_the_methods_every_seed_ran(tmp_path):
    """Regression: the per-device plot took the first seed's methods, and a method another batch had not run
    stopped the pooling with a KeyError."""
    methods = {"fedavg_ft": (0.85, 0.8, [(20, 0.85)]), "ditto": (0.86, 0.8, [(20, 0.86)])}
    more = {**methods, "fleet_head": (0.87, 0.8, [(20, 0.87)])}
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(build_report("pfl.yaml", {"a0.1-s0": seed_report(0, 0.1, more)}, {})))
    second.write_text(json.dumps(build_report("pfl.yaml", {"a0.1-s1": seed_report(1, 0.1, methods)}, {})))
    pooled = combine_reports([str(first), str(second)], str(tmp_path / "all.json"))
    assert set(pooled["methods"]) == {"fedavg_ft", "ditto"} and len(pooled["plots"]) == 3


def test_a_file_that_is_no_report_is_one_line_and_exit_2(tmp_path, capsys):
    from fleet.cli import main

    bad = tmp_path / "x.json"
    bad.write_text("{}")
    assert main(["bench", "pfl", "--combine", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--combine: {bad} is not a report of this bench" in err and "\n" not in err


@pytest.mark.slow
def test_the_pfl_bench_runs_end_to_end_on_a_tiny_fleet(tmp_path, capsys):
    """The baseline and the new methods, one round each with every device scored, one new device: every figure,
    plot and the new device's curves."""
    from fleet.bench.pfl import bench_pfl

    overrides = {
        "output_dir": str(tmp_path),
        "federation.rounds": 1,
        "devices.newcomers": 1,
        "devices.shift.rotation_deg": 45,
        "devices.shift.domains": 2,
        "federation.devices_per_round": 2,
        "evaluation.all_devices": True,
    }
    methods = ["fleet_head", "fedrep", "fedala", "apfl", "fleet_ditto"]
    settings = {"methods": methods, "finetune_steps": 2, "newcomer_epochs": 1, "quiet": True}
    report = bench_pfl("simulations/fleet-tiny.yaml", overrides, **settings)
    assert set(report["methods"]) == {"fedavg_ft", "fleet_head", "fedrep", "fedala", "apfl", "fleet_ditto"}
    assert report["best_baseline"] in {"fedavg_ft", "fedrep", "fedala", "apfl"}
    assert report["paired_vs_best_baseline"]["method"] in {"fleet_head", "fleet_ditto"}
    for entry in report["methods"].values():
        assert 0 <= entry["personalized_accuracy_mean"] <= 1 and entry["bytes_uploaded"] > 0
    assert set(report["new_devices"]) == {"full", "tl", "bn_bias", "elastic"}
    assert all(len(e["curve"]) == 2 and e["device_time_s"] > 0 for e in report["new_devices"].values())
    assert all(0 <= e["final_distribution_accuracy"] <= 1 for e in report["new_devices"].values())
    held_out, distribution = report["new_devices_verdict"]
    assert held_out["figure"] == "final_accuracy" and distribution["figure"] == "final_distribution_accuracy"
    assert distribution["seeds"] == [seed_tag(1.0, 0)] and distribution["elastic_time_vs_full"] < 1
    assert all(len(r["methods"]["fleet_head"]["device_accuracies"]) == 3 for r in report["per_seed"].values())
    for path in report["plots"]:
        assert (tmp_path / path.split("/")[-1]).stat().st_size > 3000
    # The new devices again, from the finished run alone, as `--newcomers-from` does: the run the bench took them
    # from, fleet's first method's (plain "fleet" did not run), so the same final global model
    from fleet.cli import main

    fleet_run = tmp_path / f"fleet-tiny-{seed_tag(1.0, 0)}-fleet_head"
    argv = ["bench", "pfl", "--newcomers-from", str(fleet_run), "--newcomer-epochs", "1", "--json"]
    assert main([*argv, "--set", "train.interval=1"]) == 0  # fleet-tiny's own interval: nothing changes
    again = json.loads(capsys.readouterr().out)
    assert again["runs"] == [str(fleet_run)] and again["newcomer_lr"] == pytest.approx(1e-3)
    assert again["batch_orders"] == 1 and report["new_devices"]["full"]["batch_orders"] == 1
    assert again["new_devices_per_run"]["0"]["tl"]["final_accuracy"] == again["new_devices"]["tl"]["final_accuracy"]
    assert again["overrides"] == {"train.interval": 1}
    assert Path(again["plot"]) == tmp_path / "new-devices.png" and Path(again["plot"]).stat().st_size > 3000
    # The same devices, model and lr: the same figures. Not elastic's: on 16 test images its selection can
    # turn on float rounding, which differs with the thread count a process runs with.
    for m in ("full", "tl", "bn_bias"):
        assert again["new_devices"][m]["final_accuracy"] == pytest.approx(report["new_devices"][m]["final_accuracy"])
    assert again["new_devices"]["elastic"]["device_time_s"] > 0
    # --reuse: every finished run is read, not run again, and the figures are the same
    reused = bench_pfl("simulations/fleet-tiny.yaml", overrides, **settings, reuse=True)
    for m, entry in report["methods"].items():
        assert reused["methods"][m]["personalized_accuracy_mean"] == entry["personalized_accuracy_mean"]
    assert "reusing" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--newcomers-from", "{tmp}/nowhere"], "--newcomers-from: {tmp}/nowhere holds no finished fleet run"),
        (["--newcomer-lr", "0"], "--newcomer-lr: 0.0 is not allowed; use a number in (0, 10)"),
        (["--newcomer-epochs", "0"], "--newcomer-epochs: 0 is not allowed"),
        (["--newcomer-orders", "0"], "--newcomer-orders: 0 is not allowed"),
    ],
)
def test_bad_newcomer_flags_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    from fleet.cli import main

    assert main(["bench", "pfl", *(a.format(tmp=tmp_path) for a in argv)]) == 2
    err = capsys.readouterr().err.strip()
    assert message.format(tmp=tmp_path) in err and "\n" not in err


def test_newcomer_orders_reach_the_new_devices_from_either_entry(monkeypatch, capsys):
    """--newcomer-orders is passed on by the bench and by --newcomers-from (each is checked to train that many
    orders in tests/test_newcomer.py)."""
    import fleet.bench.pfl as pfl
    from fleet.cli import main

    got = {}
    monkeypatch.setattr(pfl, "newcomers_from", lambda *a, **kw: got.update(kw) or {"new_devices": {}})
    monkeypatch.setattr(pfl, "bench_pfl", lambda *a, **kw: got.update(kw) or {})
    monkeypatch.setattr(pfl, "newcomers_table", lambda report: "")
    monkeypatch.setattr(pfl, "pfl_table", lambda report: "")
    assert main(["bench", "pfl", "--newcomers-from", "runs/x", "--newcomer-orders", "3"]) == 0
    assert got.pop("orders") == 3
    assert main(["bench", "pfl", "--newcomer-orders", "2"]) == 0
    assert got["newcomer_orders"] == 2


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
    from fleet.federated.on_server.state import ServerState, save_checkpoint

    cfg = yaml.safe_load(Path("simulations/pfl.yaml").read_text())
    cfg["devices"]["newcomers"] = 0
    (tmp_path / "fleet-config.yaml").write_text(yaml.safe_dump(cfg))
    save_checkpoint(tmp_path, {"w": np.zeros(2, np.float32)}, ServerState())
    assert main(["bench", "pfl", "--newcomers-from", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--newcomers-from: {tmp_path} ran with devices.newcomers 0" in err and "\n" not in err


def test_the_new_device_verdict_counts_the_seeds_elastic_beats_tl_and_bn_bias_on():
    from fleet.bench.pfl import newcomer_verdict

    def seed(full, tl, bn, el):
        return {
            m: {"final_accuracy": a, "time_vs_full": t}
            for m, a, t in (("full", full, 1.0), ("tl", tl, 0.2), ("bn_bias", bn, 0.5), ("elastic", el, 0.54))
        }

    per_seed = {"s0": seed(0.90, 0.85, 0.86, 0.89), "s1": seed(0.92, 0.93, 0.91, 0.93), "s2": {}}  # s1: a tie
    v = newcomer_verdict(per_seed)
    assert v["seeds"] == ["s0", "s1"] and v["seeds_above_tl_and_bn_bias"] == ["s0"]
    assert v["elastic_vs_full_points"] == pytest.approx(0.0) and v["elastic_time_vs_full"] == pytest.approx(0.54)
    assert newcomer_verdict(per_seed, "final_distribution_accuracy") is None  # an older report: no such figure

"""``fleet bench testbed``'s figures from a testbed run's records, without running one (the bench itself
runs the real testbed; its own run is in docs/results.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleet.base.errors import ConfigError
from fleet.base.process import process_age_s
from fleet.bench.figures import first_reaching
from fleet.bench.testbed import (
    ACCURACY,
    DeviceFigures,
    bench_table,
    class_fixed_s,
    class_start_s,
    device_entries,
    from_assembly,
    mean_accuracy,
    memory_entries,
    method_entry,
    overhead_share,
    regime_of,
    regime_ratio,
    simulation_config,
    slowest_by_class,
    targets,
    within,
)
from fleet.bench.testbed_seeds import combine, combined_table, read_reports
from fleet.engine.config import config_to_dict
from fleet.federated.on_device import tasks
from fleet.federated.on_server.wall import Lap
from fleet.federated.shared import keys
from fleet.federated.shared.config import fleet_config_from_dict
from fleet.federated.shared.round_record import DeviceRow, RejectionRow, RoundRecord
from fleet.testbed.config import TestbedClassConfig, parse_testbed_config
from fleet.testbed.run import TestbedRun, assembly_s

PI = TestbedClassConfig(name="pi", count=2, cpu=0.2, uplink_mbps=8, downlink_mbps=16)
BOARD = TestbedClassConfig(name="board", count=1, cpu=0.4, uplink_mbps=80, downlink_mbps=160)


def row(device: str, wall: float, ready: float | None = 20.0, up: int = 4_000_000) -> DeviceRow:
    d = {"device": device, "wall_s": wall, "measured_time_s": 3.0, "bytes_uploaded": up, "trained_fraction": 0.5}
    return DeviceRow(**d, steps=10, ready_s=ready)


def fake_run(tmp_path: Path, walls: list[tuple[float, float, float]], accuracy: list[float]) -> TestbedRun:
    records, clock = [], 0.0
    for k, ((a, b, c), acc) in enumerate(zip(walls, accuracy), start=1):
        clock += max(a, b, c) + 10
        devices = [row("pi-0", a), row("pi-1", b), row("board-0", c, ready=5.0)]
        records.append(
            RoundRecord(
                round=k,
                wall_time_s=clock,
                global_accuracy=acc,
                server_accuracy=acc - 0.01,
                personal_accuracy=acc + 0.02,
                devices=devices,
            )
        )
    classes = {"pi-0": PI, "pi-1": PI, "board-0": BOARD}
    return TestbedRun(records, None, {"pi-0": (900.0, 0)}, {"pi-0": (0, 0)}, classes, tmp_path)


def test_a_method_is_judged_on_its_rounds_within_the_budget(tmp_path):
    run = fake_run(tmp_path, [(40, 50, 20)] * 4, [0.70, 0.80, 0.85, 0.90])
    assert [r.wall_time_s for r in run.records] == [60, 120, 180, 240]
    assert len(within(run.records, 180)) == 3 and len(within(run.records, None)) == 4
    assert first_reaching(run.records, 0.84, ACCURACY).round == 3
    assert first_reaching(run.records, 0.95, ACCURACY) is None
    entry = method_entry(run, 180, 0.79, 0.6, device_entries(run, within(run.records, 180), 8_000_000))
    assert entry["rounds"] == 3 and entry["time_to_target_s"] == 120 and entry["target_round"] == 2
    assert entry["final_server_accuracy"] == pytest.approx(0.84) and entry["final_accuracy"] == 0.85
    # the start's 0.6 for 60 s, then 0.69 and 0.79 for 60 s each, over the 180 s budget
    assert entry["mean_accuracy"] == pytest.approx((0.6 + 0.69 + 0.79) / 3)
    assert entry["personalized_accuracy_mean"] == pytest.approx(0.87) and entry["wall_s"] == 180
    pi = entry["devices"]["pi-0"]
    assert pi["round_s"] == 40 and pi["ready_s"] == 20 and pi["upload_s"] == pytest.approx(4.0)  # 4 MB at 8 Mbit/s
    assert pi["download_s"] == pytest.approx(4.0) and pi["memory_peak_mb"] == 900 and pi["bytes_uploaded"] == 12e6
    assert method_entry(run, 180, 0.9, 0.6, {})["time_to_target_s"] is None  # not reached


def test_mean_accuracy_is_the_step_curves_area_over_the_budget():
    assert mean_accuracy([[10, 0.8], [30, 0.9]], start=0.5, budget_s=40) == pytest.approx((5 + 16 + 9) / 40)
    assert mean_accuracy([[10, None], [50, 0.9]], start=0.5, budget_s=40) == 0.5  # unscored, past the budget
    assert mean_accuracy([], start=None, budget_s=40) is None


def test_the_regime_is_read_off_the_slowest_class_under_fedavg():
    devices = {
        "pi-0": DeviceFigures(cpu=0.2, compute_s=60.0, upload_s=20.0, download_s=5.0),
        "pi-1": DeviceFigures(cpu=0.2, compute_s=40.0, upload_s=15.0, download_s=5.0),
        "board-0": DeviceFigures(cpu=0.4, compute_s=1.0, upload_s=20.0, download_s=5.0),
    }
    ratio = regime_ratio(devices)
    assert ratio == pytest.approx((60 / 25 + 40 / 20) / 2)
    assert regime_of(ratio) == "compute" and regime_of(1.9) == "upload" and regime_of(None) == "upload"


def test_class_figures_are_medians_of_each_rounds_slowest_device(tmp_path):
    run = fake_run(tmp_path, [(40, 50, 20), (45, 41, 22), (90, 42, 21)], [0.7, 0.8, 0.9])
    of_run = {"pi-0": "pi", "pi-1": "pi", "board-0": "board"}
    assert slowest_by_class(run.records, lambda d: d.wall_s, lambda d: of_run[d.device]) == {"pi": 50, "board": 21}
    assert class_start_s(run, "pi") == 20 and class_start_s(run, "board") == 5
    run.records[0].devices.append(DeviceRow(device="pi-1", global_accuracy=0.5))  # scored only: not yet a member
    run.records[1].devices[0].ready_s = 26.0
    assert class_start_s(run, "pi") == 20  # a row with no start is no start, not a crash at the report's end
    pi0 = device_entries(run, run.records, 0)["pi-0"]
    # its rounds of 40, 45 and 90 s each spent 3 s computing and 4 s uploading (4 MB at 8 Mbit/s)
    assert pi0.round_s == 45 and pi0.overhead_share == pytest.approx(1 - 7 / 45)


def test_scoring_inside_a_train_message_is_the_devices_compute_not_overhead(tmp_path):
    """A device's scoring inside its train message (the received model, its personalized one) is its own model
    work; the last round's separate evaluation message is not inside that message's wall_s."""
    run = fake_run(tmp_path, [(40, 50, 20)] * 2, [0.7, 0.8])
    for r in run.records:
        r.devices[0].train_eval_time_s, r.devices[0].score_time_s = 2.0, 1.0
    run.records[-1].devices[0].eval_time_s = 2.0 + 6.0  # the row joins the evaluation message's 6 s
    pi0 = device_entries(run, run.records, 0)["pi-0"]
    assert pi0.scoring_s == 3.0 and pi0.compute_s == 3.0
    assert pi0.overhead_share == pytest.approx(1 - (3 + 3 + 4) / 40)


def test_the_overhead_is_the_slowest_class_share_in_the_worst_method():
    def method(*shares: tuple[float | None, float | None]) -> dict[str, DeviceFigures]:
        rows = [("pi", 0.2, shares[0]), ("pi", 0.2, shares[1]), ("board", 0.4, 0.9), ("host", None, 0.9)]
        return {f"d{i}": DeviceFigures(cls, c, overhead_share=s) for i, (cls, c, s) in enumerate(rows)}

    # medians over the pi class, 0.2 and 0.06; the unlimited and faster classes do not count
    assert overhead_share({"fedavg": method(0.1, 0.3), "fleet": method(0.05, 0.07)}) == pytest.approx(0.2)
    assert overhead_share({"fleet": method(None, 0.07)}) == pytest.approx(0.07)
    assert overhead_share({"fleet": method(None, None)}) is None


def test_the_simulator_gets_each_class_profile_links_and_what_else_its_rounds_cost(tmp_path):
    for name in ("pi-0", "board-0"):
        (tmp_path / "devices" / name).mkdir(parents=True)
        (tmp_path / "devices" / name / "device-profile.yaml").write_text("{}")
    cfg = parse_testbed_config(
        {"name": "tb", "testbed": {"classes": [vars(PI), vars(BOARD)]}, "federation": {"rounds": 4}}
    )
    run = fake_run(tmp_path, [(40, 50, 20)] * 2, [0.7, 0.8])
    fixed = {c: class_fixed_s(run, c, 8_000_000) for c in ("pi", "board")}
    sim = simulation_config(cfg, run, fixed, rounds=5)
    assert sim.name == "tb-simulated" and sim.federation.rounds == 5 and sim.federation.strategy == "fleet"
    assert sim.devices.num_devices == 3 and not sim.testbed.classes and sim.evaluation.pipelined  # as deployed
    pi = sim.devices.device_classes[0]
    # its start: a round's wall less compute (3 s), upload (4 MB at 8 Mbit/s) and download (8 MB at 16): 40 and 50 s
    assert (pi.share, pi.bandwidth_mbps, pi.downlink_mbps, pi.start_s) == (pytest.approx(2 / 3), 8, 16, 34)
    assert pi.profile == str(tmp_path / "devices" / "pi-0" / "device-profile.yaml")
    board = fleet_config_from_dict(config_to_dict(sim)).devices.device_classes[1]  # the core loads it back
    assert board.start_s == pytest.approx(20 - 3 - 0.4 - 0.4)


def test_a_memory_limited_device_whose_reply_was_rejected_still_trained_that_round(tmp_path):
    small = TestbedClassConfig(name="pi", count=1, cpu=0.2, memory_mb=1202)
    records = [
        RoundRecord(round=1, sampled=["pi-0"], devices=[row("pi-0", 50)]),
        RoundRecord(round=2, sampled=["pi-0"], rejections=[RejectionRow(round=2, device="pi-0")]),
        RoundRecord(round=3, sampled=["pi-0"], missed=["pi-0"]),
    ]
    run = TestbedRun(records, None, {"pi-0": (1201.5, 0)}, {"pi-0": (0, 0)}, {"pi-0": small}, tmp_path)
    entry = memory_entries({"fleet": run})["pi-0"]["fleet"]
    assert (entry["rounds"], entry["rounds_trained"], entry["rejected"], entry["oom_kills"]) == (3, 2, 1, 0)
    assert entry["cgroup_peak_mb"] == 1201.5 and entry["memory_mb"] == 1202


def report_of(seed: int = 0, fleet_time: float | None = 200.0, fleet_final: float = 0.838) -> dict:
    figures = (("fedavg", 4, 300.0, 4, 0.84), ("naive", 5, None, None, 0.78), ("fleet", 5, fleet_time, 2, fleet_final))
    report = {
        "config": "testbed-compute",
        "regime": "compute",
        "seed": seed,
        "compute_to_transfer": 2.4,
        "overhead_share": 0.12,
        "start_accuracy": 0.6,
        "target_accuracy": 0.83,
        "budget_s": 600.0,
        "methods": {
            m: {
                "rounds": r,
                "time_to_target_s": t,
                "target_round": k,
                "final_server_accuracy": a,
                "mean_accuracy": a - 0.1,
                "final_accuracy": a,
                "personalized_accuracy_mean": a,
            }
            for m, r, t, k, a in figures
        },
        "fleet": {"speedup_vs_fedavg": None if fleet_time is None else 300.0 / fleet_time},
        "naive": {"speedup_vs_fedavg": None},
        "classes": {
            "pi": {
                "cpu": 0.2,
                "uplink_mbps": 20,
                "downlink_mbps": 50,
                "measured_full_step_s": 0.4,
                "start_s": 30.0,
                "measured_round_s": 60.0,
                "predicted_round_s": 55.0,
                "compute_upload_s": 20.0,
                "error": 55 / 60 - 1,
            }
        },
        "memory": {"pi-0": {"fleet": {"oom_kills": 0, "rounds_trained": 5, "rounds": 5}}},
    }
    report["targets"] = targets(report)
    return report


def test_the_report_says_which_target_was_missed_and_by_what():
    report = report_of()
    assert report["targets"] == {
        "fedavg_reaches_target_late": True,
        "fleet_3x_sooner_than_fedavg": False,
        "fleet_final_within_half_a_point": True,
        "slowest_class_overhead_at_most_15pct": True,
        "simulator_within_15pct_every_class": True,
        "memory_limited_devices_train_to_the_end": True,
    }
    table = bench_table(report)
    assert "MISSED: fleet_3x_sooner_than_fedavg" in table and "not reached" in table and "1.50x" in table
    assert "   -8%" in table and "60.0s" in table and "computes 2.4x" in table
    report["methods"]["fedavg"]["target_round"] = 2  # FedAvg passed the target before its last two rounds
    assert targets(report)["fedavg_reaches_target_late"] is False


def test_seeds_combine_per_regime_paired_with_fedavg(tmp_path):
    files = []
    for seed, t, final in ((0, 100.0, 0.85), (1, None, 0.83), (1, 150.0, 0.82)):  # seed 1 rerun: the later counts
        files.append(tmp_path / f"r{len(files)}.json")
        files[-1].write_text(json.dumps(report_of(seed, t, final)))
    combined = combine(read_reports([str(f) for f in files]))
    compute = combined["testbed-compute"]
    assert sorted(compute["seeds"]) == ["0", "1"] and compute["speedup_vs_fedavg"]["median"] == pytest.approx(2.5)
    assert compute["final_minus_fedavg"]["min"] == pytest.approx(-0.02)
    assert compute["final_minus_fedavg"]["max"] == pytest.approx(0.01)
    assert "testbed-compute (compute regime): fleet reaches the target 2.50x sooner" in combined_table(combined)
    assert "2.50x sooner" in combined_table(combined) and "seed 1 2.00x" in combined_table(combined)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"--combine: .*bad.json is not a report of this bench"):
        read_reports([str(tmp_path / "bad.json")])


def test_a_deployed_device_reports_its_process_start_once():
    assert 0 <= process_age_s() < 24 * 3600 * 365
    tasks._HANDLED[0] = 0
    first, second = tasks.readiness(), tasks.readiness()
    assert first[keys.READY_S] > 0 and second == {}  # a simulation worker's later messages: no lifetime


def test_too_few_rounds_stop_the_bench_before_any_device_starts(capsys):
    from fleet.cli import main

    assert main(["bench", "testbed", "--rounds", "1"]) == 2
    assert "--rounds: an integer >= 2" in capsys.readouterr().err


def test_a_methods_clock_starts_once_its_fleet_has_assembled(tmp_path):
    """The first round's wait for the devices' query answers (their profiling as they join) is reported apart,
    and every figure of time is counted after it."""
    run = fake_run(tmp_path, [(40, 50, 20)] * 3, [0.70, 0.80, 0.90])
    run.records[0].server_s = {Lap.OPEN: 50.0, Lap.WAIT_TRAIN: 10.0}  # its 60 s: 50 of them waiting for the joins
    assert assembly_s(run.records) == 50.0 and assembly_s(run.records[1:]) == 0.0  # only a first round's
    shifted = from_assembly(run)
    assert [r.wall_time_s for r in shifted.records] == [10, 70, 130] and run.records[0].wall_time_s == 60
    entry = method_entry(shifted, 70, 0.79, 0.6, device_entries(shifted, within(shifted.records, 70), 0))
    assert entry["assembly_s"] == 50.0 and entry["rounds"] == 2 and entry["time_to_target_s"] == 70

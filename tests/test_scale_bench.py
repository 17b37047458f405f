"""`fleet bench scale`: fleet specs, per-round figures, the memory watch, and one small end-to-end run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleet.base.errors import ConfigError
from fleet.bench.launch import MemoryWatch
from fleet.bench.scale import floor_work, parse_fleets, round_figures, state_figures
from fleet.federated.on_server.tracking import METRICS_FILE, read_records
from fleet.federated.shared.round_record import DeviceRow, RoundRecord
from tests.test_fleet_simulation import TINY, run_fleet


def test_fleet_specs_are_checked():
    assert parse_fleets(["8:8", "256:16"]) == [(8, 8), (256, 16)]
    with pytest.raises(ConfigError, match="'8' is not DEVICES:PER_ROUND"):
        parse_fleets(["8"])
    with pytest.raises(ConfigError, match="samples 16 of 8"):
        parse_fleets(["8:16"])


def test_round_figures_leave_out_the_first_round_and_divide_work_by_the_workers():
    def rec(wall: float, sim: float, work: list[tuple[float, float]]) -> RoundRecord:
        devices = [DeviceRow(measured_time_s=t, eval_time_s=e) for t, e in work]
        return RoundRecord(round_wall_s=wall, round_time_s=sim, devices=devices)

    records = [rec(30.0, 9.0, [(1.0, 0.5)]), rec(6.0, 4.0, [(2.0, 1.0), (2.0, 1.0)]), rec(9.0, 5.0, [(3.0, 0.0)] * 2)]
    fig = round_figures(records, parallel=2)
    assert fig["first_round_wall_s"] == 30.0
    assert fig["wall_s_per_round"] == 7.5 and fig["sim_s_per_round"] == 4.5
    assert fig["overhead_ratio"] == pytest.approx((6.0 / 3.0 + 9.0 / 3.0) / 2)  # 6 s of work on 2 workers: 3 s
    assert round_figures([], 2)["wall_s_per_round"] is None


def test_a_floor_device_sleeps_for_the_median_work_its_tier_measured_after_the_first_round():
    def rec(work: list[tuple[float, float, float]]) -> RoundRecord:
        return RoundRecord(devices=[DeviceRow(tier=tier, measured_time_s=t, eval_time_s=e) for tier, t, e in work])

    records = [rec([(1.0, 9.0, 9.0)]), rec([(1.0, 1.0, 0.2), (4.0, 3.0, 0.0)]), rec([(1.0, 2.0, 0.4), (4.0, 0.0, 0.3)])]
    work = floor_work(records)  # zeros are devices that did not do that part
    assert (work["train_s"], work["eval_s"]) == (2.0, 0.3)
    assert work["train_s_by_tier"] == {"1.0": 1.5, "4.0": 3.0}
    assert work["eval_s_by_tier"] == pytest.approx({"1.0": 0.3, "4.0": 0.3})


def test_a_floor_device_works_its_tiers_seconds_and_the_median_for_a_tier_fleet_never_measured():
    from fleet.bench.floor_app import seconds_for, work_config

    config = work_config({"train_s": 2.0, "eval_s": 0.3, "train_s_by_tier": {"1.0": 1.5, "4.0": 3.0}}, "train")
    assert [seconds_for(config, t) for t in (1.0, 4.0, 2.0)] == [1.5, 3.0, 2.0]
    assert seconds_for(work_config({"train_s": 2.0, "eval_s": 0.3}, "eval"), 1.0) == 0.3  # no tiers: the median


def test_state_figures_count_bytes_per_device_that_keeps_state(tmp_path):
    for name, size in (("dev-1", 300), ("dev-2", 100)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "state.pt").write_bytes(b"x" * size)
    (tmp_path / "dev-2" / "plan.json").write_bytes(b"x" * 100)
    assert state_figures(tmp_path) == {"state_bytes": 500, "devices_with_state": 2, "state_bytes_per_device": 250.0}
    assert state_figures(tmp_path / "none")["state_bytes"] == 0


def test_the_memory_watch_sees_a_process_session():
    code = "import time; x = bytearray(300 * 2**20); x[::4096] = b'1' * len(x[::4096]); time.sleep(3)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    watch = MemoryWatch(interval_s=0.2)
    thread = watch.run(proc.pid)
    time.sleep(2)
    watch.stop(thread)
    proc.wait()
    assert watch.server >= 300 * 2**20  # its own peak (RSS)
    assert 300 * 2**20 <= watch.total <= watch.server + 50 * 2**20  # the session's PSS: one process, its pages
    assert watch.worker == 0  # no ClientApp actor in that session


@pytest.mark.slow
def test_the_scale_bench_prints_its_figures_for_each_fleet(tmp_path):
    res = run_fleet(
        ["bench", "scale", "--json", "--config", TINY, "--fleets", "4:2", "6:3", "--output-dir", str(tmp_path)],
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:]
    report = json.loads(res.stdout[res.stdout.index("{") :])
    assert [(f["devices"], f["per_round"]) for f in report["fleets"]] == [(4, 2), (6, 3)]
    for f in report["fleets"]:
        assert f["rounds"] == 2 and "error" not in f
        assert f["wall_s_per_round"] > 0 and f["overhead_ratio"] >= 1.0 and f["sim_s_per_round"] > 0
        by_process = f["peak_rss_bytes_by_process"]
        assert by_process["server"] > 100 * 2**20 and by_process["worker"] > 100 * 2**20
        assert f["peak_rss_bytes"] >= by_process["server"] / 2  # the whole simulation's PSS: shared pages split
        assert 1 <= f["devices_with_state"] <= f["devices"] and f["state_bytes_per_device"] > 0
        # Flower's floor on the same fleet: its devices slept for what fleet's measured, and it cost some overhead
        assert f["flower_floor_work_s"]["train_s"] > 0 and f["flower_floor_overhead_ratio"] >= 1.0
        assert "flower_floor_error" not in f
        assert set(f["flower_floor_work_s"]["train_s_by_tier"]) <= {"1.0", "2.0", "3.0", "4.0"}
        # and the busy floor: the same work spent spinning on the workers' CPUs
        assert f["flower_busy_floor_work_s"] == f["flower_floor_work_s"]
        assert f["flower_busy_floor_overhead_ratio"] >= 1.0 and "flower_busy_floor_error" not in f
    assert (tmp_path / "scale.png").stat().st_size > 1000 and (tmp_path / "scale.json").is_file()
    assert not any((Path(f["run_dir"]) / "devices").exists() for f in report["fleets"])  # state deleted: GBs


def test_read_records_stops_at_a_line_cut_short(tmp_path):
    assert read_records(tmp_path) == []  # a run that wrote no rounds
    (tmp_path / METRICS_FILE).write_text('{"round": 1}\n\n{"round": 2}\n{"round": 3, "dev')
    assert read_records(tmp_path) == [RoundRecord(round=1), RoundRecord(round=2)]


def test_scoring_the_personalized_model_after_training_counts_as_device_work_and_as_floor_training():
    """A train reply's score_time_s is evaluation the device did: the overhead ratio divides by it, and the
    floor's trainers sleep it with their training."""
    row = DeviceRow(tier=2.0, measured_time_s=2.0, score_time_s=0.5, eval_time_s=0.5)
    records = [RoundRecord(round_wall_s=9.0, round_time_s=1.0, devices=[row])] * 2
    assert round_figures(records, parallel=1)["overhead_ratio"] == pytest.approx(9.0 / 3.0)
    work = floor_work(records)
    assert (work["train_s"], work["eval_s"], work["train_s_by_tier"]) == (2.5, 0.5, {"2.0": 2.5})


def test_a_busy_floor_device_holds_its_cpu_for_its_work_and_a_sleeping_one_does_not():
    from flwr.app import ConfigRecord

    from fleet.bench.floor_app import BUSY_KEY, WORK_KEY, work

    def cpu_s(busy: bool) -> float:
        started = time.process_time()
        assert work(ConfigRecord({WORK_KEY: 0.3, BUSY_KEY: busy})) == 0.3
        return time.process_time() - started

    assert cpu_s(busy=False) < 0.05
    assert cpu_s(busy=True) > 0.1  # a whole core for 0.3 s, or at least its share of a loaded one

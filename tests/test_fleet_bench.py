"""The fleet benchmark's report: equal simulated time, smoothed final accuracy, seeds."""

from __future__ import annotations

import dataclasses

import pytest

from fleet.bench.figures import SIM_CLOCK, WALL_CLOCK, speedup, time_to_target
from fleet.bench.fleet import (
    bench_table,
    combine,
    differences,
    final_accuracy,
    mean_ci95,
    seed_report,
    time_mean_accuracy,
    within,
)
from fleet.federated.on_server.coordinator import out_of_time
from fleet.federated.on_server.state import ServerState
from fleet.federated.shared.config import fleet_config_from_dict
from fleet.federated.shared.round_record import RoundRecord
from fleet.federated.shared.run_summary import RunSummary


def hist(points: list[tuple[float, float]]) -> list[RoundRecord]:
    return [
        RoundRecord.from_json(
            {
                "round": i + 1,
                "sim_time_s": t,
                "global_accuracy": a,
                "personal_accuracy": a + 0.05,
                "personal_accuracy_p10": a - 0.1,
                "bytes_uploaded": 100,
            }
        )
        for i, (t, a) in enumerate(points)
    ]


def summary(name: str) -> RunSummary:
    return RunSummary(run_dir=f"runs/{name}")


def test_time_to_target_and_horizon():
    h = hist([(10, 0.5), (20, 0.7), (30, 0.8), (40, 0.9)])
    assert time_to_target(h, 0.75, clock=SIM_CLOCK) == 30
    assert time_to_target(h, 0.95, clock=SIM_CLOCK) is None
    walled = [dataclasses.replace(r, wall_time_s=3 * r.sim_time_s) for r in h]
    assert time_to_target(walled, 0.75, clock=WALL_CLOCK) == 90  # the same round, read on the other clock
    assert speedup(90, 30) == 3.0 and speedup(90, None) is None and speedup(None, 30) is None
    assert [r.round for r in within(h, 30.0)] == [1, 2, 3]
    assert within(h, None) == h
    assert final_accuracy(h, 3) == pytest.approx((0.7 + 0.8 + 0.9) / 3)
    assert final_accuracy(h, 1) == pytest.approx(0.9)


def test_seed_report_compares_at_fedavgs_horizon():
    fedavg = hist([(20, 0.6), (40, 0.7), (60, 0.8)])
    # an elastic method with 10 s rounds; rounds after the 60 s horizon are not counted
    elastic = hist([(10 * (i + 1), a) for i, a in enumerate([0.5, 0.6, 0.7, 0.78, 0.8, 0.82, 0.99, 0.99])])
    rep = seed_report(
        {m: summary(m) for m in ("fedavg", "naive", "fleet")},
        {"fedavg": fedavg, "naive": elastic, "fleet": elastic},
        target_fraction=0.95,
        final_rounds=2,
    )
    assert rep["horizon_s"] == 60
    assert rep["target_accuracy"] == pytest.approx(0.95 * 0.75)
    f, e = rep["methods"]["fedavg"], rep["methods"]["fleet"]
    assert f["time_to_target_s"] == 60 and e["time_to_target_s"] == 40  # target 0.7125
    assert e["speedup_vs_fedavg"] == pytest.approx(1.5)
    assert e["rounds"] == 6 and e["final_accuracy"] == pytest.approx(0.81)  # 0.99s come after the horizon
    assert e["last_round_accuracy"] == pytest.approx(0.82) and e["bytes_uploaded"] == 600
    assert e["personalized_accuracy_mean"] == pytest.approx(0.87)
    # late accuracy: every round ending in the last 30% of the horizon (from 42 s), the same time for both
    assert f["late_accuracy"] == pytest.approx(0.8)  # FedAvg's round at 60 s
    assert e["late_accuracy"] == pytest.approx((0.8 + 0.82) / 2)  # its rounds ending at 50 and 60 s


def test_time_mean_weighs_each_accuracy_by_how_long_it_held():
    h = hist([(10, 0.5), (20, 0.7), (40, 0.9)])
    # from 20 s: 0.7 holds for 20 s, then 0.9 for 20 s up to the 60 s horizon
    assert time_mean_accuracy(h, 20.0, 60.0) == pytest.approx(0.8)
    # from 15 s, 0.5 held for the first 5 s of the 35 s up to 50 s
    assert time_mean_accuracy(h, 15.0, 50.0) == pytest.approx((0.5 * 5 + 0.7 * 20 + 0.9 * 10) / 35)
    assert time_mean_accuracy(h, 5.0, 60.0) is None  # no model yet at 5 s: nothing to hold


def test_seed_report_time_mean_starts_when_every_method_has_a_model():
    fedavg = hist([(20, 0.6), (40, 0.8)])
    elastic = hist([(10, 0.5), (20, 0.7), (30, 0.7), (40, 0.9)])
    rep = seed_report(
        {m: summary(m) for m in ("fedavg", "naive", "fleet")},
        {"fedavg": fedavg, "naive": elastic, "fleet": elastic},
        target_fraction=0.95,
        final_rounds=1,
    )
    assert rep["methods"]["fedavg"]["time_mean_accuracy"] == pytest.approx(0.6)  # 20..40 s: 0.6 until 40 s
    assert rep["methods"]["fleet"]["time_mean_accuracy"] == pytest.approx(0.7)  # its 10 s round is before the start


def test_differences_give_a_95_interval_over_seeds():
    mean, half = mean_ci95([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.303 * 1.0 / 3**0.5, rel=1e-4)
    assert mean_ci95([0.5]) == (0.5, None)

    def rep(fedavg: float, naive: float, fleet: float) -> dict:
        return {
            "methods": {
                m: {"final_accuracy": a, "late_accuracy": a, "time_mean_accuracy": None}
                for m, a in (("fedavg", fedavg), ("naive", naive), ("fleet", fleet))
            }
        }

    d = differences({0: rep(0.70, 0.72, 0.75), 1: rep(0.70, 0.74, 0.73)})
    assert set(d) == {"naive-fedavg", "fleet-fedavg", "fleet-naive"}
    fn = d["fleet-naive"]["final_accuracy"]
    assert fn["per_seed"] == pytest.approx([0.03, -0.01]) and fn["mean"] == pytest.approx(0.01)
    assert fn["ci95"] == pytest.approx(12.706 * 0.02828427 / 2**0.5, rel=1e-4)  # contains 0: a tie
    assert d["fleet-fedavg"]["late_accuracy"]["mean"] == pytest.approx(0.04)
    assert "time_mean_accuracy" not in d["fleet-naive"]  # a figure some seed lacks is left out
    table = bench_table(
        {
            "seeds": [0, 1],
            "final_accuracy_is": "f",
            "late_accuracy_is": "l",
            "target_fraction_of_fedavg_final": 0.95,
            "methods": {},
            "differences": d,
        }
    )
    assert "fleet-naive: final +1.00 ± 25.41, late +1.00 ± 25.41, time mean n/a" in table


def test_combine_averages_seeds_and_needs_every_seed_for_time_to_target():
    def rep(fin: float, ttt: float | None) -> dict:
        entry = {
            "time_to_target_s": ttt,
            "final_accuracy": fin,
            "last_round_accuracy": fin,
            "personalized_accuracy_mean": fin,
            "personalized_accuracy_p10": fin,
            "bytes_uploaded": 10,
            "rounds": 5,
            "sim_time_s": 50.0,
            "speedup_vs_fedavg": 2.0,
        }
        return {"methods": {m: dict(entry) for m in ("fedavg", "naive", "fleet")}}

    out = combine({0: rep(0.7, 10.0), 1: rep(0.8, None)})
    assert out["fleet"]["final_accuracy"] == pytest.approx(0.75)
    assert out["fleet"]["final_accuracy_per_seed"] == [0.7, 0.8]
    assert out["fleet"]["final_accuracy_stdev"] == pytest.approx(0.0707, abs=1e-3)
    assert out["fleet"]["time_to_target_s"] is None  # a seed that never reached the target
    assert out["fleet"]["speedup_vs_fedavg"] == pytest.approx(2.0)


def test_time_budget_stops_the_round_loop():
    cfg = fleet_config_from_dict({"federation": {"time_budget_s": 30.0}})
    assert not out_of_time(cfg, ServerState(run_tag="x", sim_time_s=29.9))
    assert out_of_time(cfg, ServerState(run_tag="x", sim_time_s=30.0))
    assert not out_of_time(fleet_config_from_dict({}), ServerState(run_tag="x", sim_time_s=1e9))


def test_bench_plot_draws_every_seed(tmp_path):
    import json

    from fleet.bench.fleet import plot_bench

    histories = {"fedavg": hist([(20, 0.6), (40, 0.7)]), "naive": hist([(10, 0.65), (20, 0.7), (30, 0.72), (40, 0.75)])}
    histories["fleet"] = histories["naive"]
    for m, h in histories.items():
        (tmp_path / m).mkdir()
        (tmp_path / m / "summary.json").write_text(json.dumps({"history": [r.to_json() for r in h]}))
    rep = seed_report(
        {m: summary(str(tmp_path / m)) for m in histories}, histories, target_fraction=0.95, final_rounds=1
    )
    for m in rep["methods"]:
        rep["methods"][m]["run_dir"] = str(tmp_path / m)
    path = plot_bench({"per_seed": {"0": rep, "1": rep}}, tmp_path / "bench.png")
    assert path.stat().st_size > 5000
    import matplotlib.image

    assert matplotlib.image.imread(path).shape[:2] == (400, 1200)  # one row, a panel per seed
    wide = plot_bench({"per_seed": {str(s): rep for s in range(5)}}, tmp_path / "bench5.png")
    assert matplotlib.image.imread(wide).shape[:2] == (800, 2400)  # wrapped at 4 panels a row


def test_reuse_takes_only_a_finished_run_made_with_the_same_config(tmp_path):
    import json

    import yaml

    from fleet.base.errors import ConfigError
    from fleet.bench.fleet import bench_fleet, reused_summary
    from fleet.engine.config import config_to_dict
    from fleet.federated.shared.config import run_dir

    want = fleet_config_from_dict(
        {"name": "b-naive", "output_dir": str(tmp_path), "federation": {"strategy": "naive", "rounds": 4}}
    )
    out = run_dir(want)
    with pytest.raises(ConfigError, match="--reuse naive: .* holds no finished run"):
        reused_summary("naive", want)
    out.mkdir(parents=True)
    (out / "fleet-config.yaml").write_text(yaml.safe_dump(config_to_dict(want)))
    (out / "summary.json").write_text(json.dumps({"rounds": 4, "sim_time_s": 12.0, "run_dir": str(out)}))
    assert reused_summary("naive", want).rounds == 4
    other = fleet_config_from_dict({**config_to_dict(want), "train": {"lr": 0.5}})
    with pytest.raises(ConfigError, match=r"was run with train.lr=0.01, this bench needs 0.5"):
        reused_summary("naive", other)
    (out / "summary.json").write_text(json.dumps({"rounds": 2, "sim_time_s": 6.0, "run_dir": str(out)}))
    with pytest.raises(ConfigError, match="stopped after 2 rounds"):
        reused_summary("naive", want)
    with pytest.raises(ConfigError, match="--reuse: 'fedsgd' is not a method"):
        bench_fleet("simulations/fleet-tiny.yaml", reuse=("fedsgd",))


def test_reuse_accepts_a_raised_round_cap_once_the_time_budget_is_reached(tmp_path):
    import json

    import yaml

    from fleet.base.errors import ConfigError
    from fleet.bench.fleet import reused_summary
    from fleet.engine.config import config_to_dict
    from fleet.federated.shared.config import run_dir

    want = fleet_config_from_dict(
        {"name": "b-fleet", "output_dir": str(tmp_path), "federation": {"rounds": 41, "time_budget_s": 100.0}}
    )
    out = run_dir(want)
    out.mkdir(parents=True)
    made = config_to_dict(want)
    made["federation"]["rounds"] = 82  # the bench resumed it with a doubled cap
    (out / "fleet-config.yaml").write_text(yaml.safe_dump(made))
    (out / "summary.json").write_text(json.dumps({"rounds": 45, "sim_time_s": 101.0, "run_dir": str(out)}))
    assert reused_summary("fleet", want).rounds == 45
    (out / "summary.json").write_text(json.dumps({"rounds": 40, "sim_time_s": 90.0, "run_dir": str(out)}))
    with pytest.raises(ConfigError, match="was run with federation.rounds=82, this bench needs 41"):
        reused_summary("fleet", want)


def test_elastic_round_cap_follows_the_deadline_factor():
    from fleet.bench.fleet import elastic_round_cap

    cfg = fleet_config_from_dict({"federation": {"rounds": 10}, "devices": {"tiers": [1, 2, 3, 4]}})
    assert elastic_round_cap(cfg) == 41  # rounds of at least 1/4 of FedAvg's
    tight = fleet_config_from_dict(
        {"federation": {"rounds": 10, "deadline_factor": 0.5}, "devices": {"tiers": [1, 2, 3, 4]}}
    )
    assert elastic_round_cap(tight) == 81  # half the deadline: rounds of 1/8 of FedAvg's
    loose = fleet_config_from_dict({"federation": {"rounds": 10, "deadline_factor": 1.5}, "devices": {"tiers": [1, 2]}})
    assert elastic_round_cap(loose) == 21


@pytest.mark.slow
def test_bench_carries_elastic_runs_to_the_horizon_past_their_round_cap(tmp_path):
    """A near-zero deadline makes elastic rounds far shorter than the cap assumes: the bench
    resumes them until FedAvg's horizon, and a second bench reuses all three runs as they are."""
    import json

    import yaml

    from fleet.bench.fleet import bench_fleet
    from fleet.engine.experiment import make_model
    from fleet.engine.models import model_meta
    from fleet.federated.shared.config import load_fleet_config
    from tests.conftest import proportional_profile

    # A size-proportional profile: how many elastic rounds fit FedAvg's horizon must not depend on
    # how fast this machine happens to be (a measured one needed 10 to 80 rounds).
    cfg = load_fleet_config("simulations/fleet-tiny.yaml")
    m = cfg.model
    meta = model_meta(m.name, m.num_classes, m.in_channels, m.small_input)
    profile = proportional_profile(make_model(m), cfg.train.batch_size, cfg.data.input_size, meta=meta)
    profile.save(tmp_path / "profile.yaml")
    overrides = {
        "output_dir": str(tmp_path),
        "hardware.profile": str(tmp_path / "profile.yaml"),
        "federation.deadline_s": 0.001,
        "elastic.min_rho_margin": 0.0,
        # at this deadline no probe fits, and skipping them makes rounds so short that the horizon takes
        # hundreds of them; the round cap's doubling is what this test checks, not the probe rule
        "elastic.probe_only_when_it_fits": False,
    }
    report = bench_fleet("simulations/fleet-tiny.yaml", overrides, quiet=True)
    horizon = json.loads((tmp_path / "fleet-tiny-fedavg" / "summary.json").read_text())["sim_time_s"]
    for method in ("naive", "fleet"):
        run = tmp_path / f"fleet-tiny-{method}"
        done = json.loads((run / "summary.json").read_text())
        assert done["sim_time_s"] >= horizon and done["rounds"] > 5  # past the cap of 2 * 2 + 1 rounds
        cap = yaml.safe_load((run / "fleet-config.yaml").read_text())["federation"]["rounds"]
        doublings = (cap // 5).bit_length() - 1
        assert cap == 5 * 2**doublings and doublings >= 1  # the cap of 5, doubled ...
        assert done["rounds"] > cap // 2  # ... only until the horizon was reached
    again = bench_fleet("simulations/fleet-tiny.yaml", overrides, quiet=True, reuse=("fedavg", "naive", "fleet"))
    assert again["methods"] == report["methods"]


def test_device_classes_are_averaged_over_seeds_tabled_and_plotted(tmp_path):
    """Each method's per-class figures (summary.json's classes) reach the report, its table and a plot."""
    from fleet.bench.fleet import plot_bench_classes

    def rep(speedup: float, classes: bool) -> dict:
        entry = {k: 0.5 for k in ("final_accuracy", "personalized_accuracy_mean", "personalized_accuracy_p10")}
        entry.update({"time_to_target_s": 1.0, "last_round_accuracy": 0.5, "bytes_uploaded": 1, "rounds": 1})
        entry.update({"sim_time_s": 1.0, "speedup_vs_fedavg": 1.0})
        figs = {"round_speedup_mean": speedup, "speedup_mean": 1.0, "trained_fraction_mean": 0.25}
        figs["personalized_accuracy_mean"] = 0.8
        entry["classes"] = {"pi4-like": figs, "jetson-like": dict(figs, round_speedup_mean=1.0)} if classes else {}
        return {"methods": {m: dict(entry) for m in ("fedavg", "naive", "fleet")}}

    out = combine({0: rep(6.0, True), 1: rep(4.0, True)})
    assert out["fleet"]["classes"]["pi4-like"]["round_speedup_mean"] == pytest.approx(5.0)
    assert out["fleet"]["classes"]["jetson-like"]["seeds"] == 2
    assert combine({0: rep(6.0, False)})["fleet"]["classes"] == {}
    report = {"methods": out, "seeds": [0, 1], "differences": {}}
    report.update({k: "x" for k in ("final_accuracy_is", "late_accuracy_is", "time_mean_accuracy_is")})
    report["target_fraction_of_fedavg_final"] = 0.95
    table = bench_table(report)
    assert "   fleet       pi4-like         5.00x           1.00x    0.250    80.0%" in table
    path = plot_bench_classes(report, tmp_path / "classes.png")
    assert path.stat().st_size > 5000


def test_the_global_accuracy_swing_is_the_mean_change_between_evaluated_rounds():
    from fleet.bench.fleet import accuracy_swing

    h = hist([(10, 0.5), (20, 0.7), (30, 0.6)])
    h.insert(1, RoundRecord(round=9, sim_time_s=15))  # a round without evaluation
    assert accuracy_swing(h) == pytest.approx(0.15)
    assert accuracy_swing(hist([(10, 0.5)])) is None
    entry = seed_report(
        {m: summary(m) for m in ("fedavg", "naive", "fleet")},
        {m: h for m in ("fedavg", "naive", "fleet")},
        target_fraction=0.9,
        final_rounds=1,
    )
    assert entry["methods"]["fleet"]["global_accuracy_swing"] == pytest.approx(0.15)

"""``fleet bench fleet``: FedAvg (full training) vs naive per-device ElasticTrainer vs fleet.

For each seed, the device profile and pretrained checkpoint are made once and
passed to all three methods, so they share partitions, profile and start.
Each method runs as its own ``fleet simulate`` process (a fresh Ray per run).

The methods get the same *simulated time*, not the same number of rounds:
FedAvg runs ``federation.rounds`` rounds, which sets the horizon; the elastic
methods run until their clock reaches it (their rounds are shorter, so they
run more of them). Comparing at equal rounds would hand FedAvg 2-3x the time.

Global accuracy on non-IID held-out splits moves a few points from round to
round, so ``final_accuracy`` is the mean of the last ``final_rounds`` rounds
within the horizon (``last_round_accuracy`` is reported too). Three rounds of
FedAvg span 30% of the horizon but three elastic rounds only about 12%, so
``late_accuracy`` averages every round that ends in the same last 30% of the
simulated time for every method: more rounds, less noise. Time to target
is the simulated time until the global accuracy first reaches
``target_fraction`` of FedAvg's final accuracy. With several seeds, each
method's figures are averaged over seeds and the per-seed reports are kept, and
``differences`` gives each pair of methods' per-seed differences with a 95%
confidence interval over seeds: whether a gap is larger than the seeds' scatter.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from fleet.base.errors import ConfigError, FleetError
from fleet.bench.figures import SIM_CLOCK, speedup, time_to_target
from fleet.bench.launch import progress_log
from fleet.bench.regimes import run_profile
from fleet.engine.config import config_to_dict
from fleet.federated.launch.prepare import EFFECTIVE_CONFIG, prepare
from fleet.federated.on_server.tracking import honest_rejections, honest_tensors_left_out, read_records
from fleet.federated.shared.config import FleetConfig, load_fleet_config, run_dir
from fleet.federated.shared.round_record import RoundRecord, fields_json
from fleet.federated.shared.run_summary import SUMMARY_FILE, RunSummary

METHODS = ("fedavg", "naive", "fleet")
FIGURES = (
    "time_to_target_s",
    "final_accuracy",
    "late_accuracy",
    "time_mean_accuracy",
    "last_round_accuracy",
    "global_accuracy_swing",
    "personalized_accuracy_mean",
    "personalized_accuracy_p10",
    "bytes_uploaded",
    "rounds",
    "sim_time_s",
)


def within(history: list[RoundRecord], horizon_s: float | None) -> list[RoundRecord]:
    """The rounds that ended by the horizon (all of them without one)."""
    if horizon_s is None:
        return list(history)
    return [r for r in history if r.sim_time_s <= horizon_s * (1 + 1e-9)]


def scored(history: list[RoundRecord]) -> list[float]:
    """The global accuracies of the rounds that were evaluated, in order."""
    return [r.global_accuracy for r in history if r.global_accuracy is not None]


def final_accuracy(history: list[RoundRecord], final_rounds: int) -> float | None:
    accs = scored(history)[-final_rounds:]
    return float(statistics.fmean(accs)) if accs else None


LATE_FRACTION = 0.3  # late_accuracy: the rounds that end in this last fraction of the horizon


def late_accuracy(history: list[RoundRecord], horizon_s: float | None) -> float | None:
    """Mean global accuracy of the rounds ending in the last ``LATE_FRACTION`` of the horizon."""
    if horizon_s is None:
        return None
    accs = scored([r for r in history if r.sim_time_s >= (1 - LATE_FRACTION) * horizon_s])
    return float(statistics.fmean(accs)) if accs else None


def time_mean_accuracy(history: list[RoundRecord], start_s: float, end_s: float) -> float | None:
    """Mean of the accuracy-against-time step curve over ``[start_s, end_s]``: a round's accuracy
    holds from its end until the next round ends. Methods with rounds of different lengths are
    weighted by time, not by round, so the figure compares them at equal time."""
    points = [(r.sim_time_s, r.global_accuracy) for r in history if r.global_accuracy is not None]
    if not points or end_s <= start_s or points[0][0] > start_s * (1 + 1e-9):
        return None
    area = 0.0
    for (t, acc), nxt in zip(points, points[1:] + [(float("inf"), None)]):
        lo, hi = max(t, start_s), min(nxt[0], end_s)
        if hi > lo:
            area += acc * (hi - lo)
    return area / (end_s - start_s)


def accuracy_swing(history: list[RoundRecord]) -> float | None:
    """The mean absolute change of global accuracy from one evaluated round to the next: how steady the
    global model is (a device that personalizes from a bad round starts worse)."""
    accs = scored(history)
    steps = [abs(b - a) for a, b in zip(accs, accs[1:])]
    return float(statistics.fmean(steps)) if steps else None


def method_entry(
    summary: RunSummary,
    history: list[RoundRecord],
    target: float,
    final_rounds: int,
    horizon_s: float | None = None,
    common_start_s: float | None = None,
) -> dict:
    """The bench figures of one method's run, over the rounds in ``history``."""
    last = history[-1] if history else None
    records = within(read_records(Path(summary.run_dir)), horizon_s)
    return {
        "time_to_target_s": time_to_target(history, target, clock=SIM_CLOCK),
        "final_accuracy": final_accuracy(history, final_rounds),
        "late_accuracy": late_accuracy(history, horizon_s),
        "time_mean_accuracy": (
            time_mean_accuracy(history, common_start_s, horizon_s)
            if horizon_s is not None and common_start_s is not None
            else None
        ),
        "last_round_accuracy": None if last is None else last.global_accuracy,
        "global_accuracy_swing": accuracy_swing(history),
        "personalized_accuracy_mean": last.personal_accuracy if last else summary.personalized_accuracy_mean,
        "personalized_accuracy_p10": last.personal_accuracy_p10 if last else summary.personalized_accuracy_p10,
        "bytes_uploaded": int(sum(r.bytes_uploaded for r in history)),
        "honest_rejected": honest_rejections(records),
        "honest_tensors_left_out": honest_tensors_left_out(records),
        "rounds": len(history),
        "sim_time_s": 0.0 if last is None else last.sim_time_s,
        # per device class, over the whole run (devices.device_classes)
        "classes": {name: fields_json(c) for name, c in summary.classes.items()},
        "run_dir": summary.run_dir,
    }


def seed_report(
    summaries: dict[str, RunSummary],
    histories: dict[str, list[RoundRecord]],
    *,
    target_fraction: float,
    final_rounds: int,
) -> dict:
    """One seed's comparison: FedAvg's run sets the horizon and the target."""
    horizon = histories["fedavg"][-1].sim_time_s if histories["fedavg"] else None
    cut = {m: within(h, horizon) for m, h in histories.items()}
    fedavg_final = final_accuracy(cut["fedavg"], final_rounds)
    target = target_fraction * fedavg_final if fedavg_final is not None else float("inf")
    firsts = [h[0].sim_time_s for h in cut.values() if h]
    start = max(firsts) if len(firsts) == len(cut) else None  # the first moment every method has a model
    methods = {m: method_entry(summaries[m], cut[m], target, final_rounds, horizon, start) for m in summaries}
    f = methods["fedavg"]["time_to_target_s"]
    for m in methods:
        if m != "fedavg":
            t = methods[m]["time_to_target_s"]
            methods[m]["speedup_vs_fedavg"] = speedup(f, t)
    return {"horizon_s": horizon, "target_accuracy": target, "methods": methods}


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return float(statistics.fmean(vals)) if vals and len(vals) == len(values) else None


def combine(seeds: dict[int, dict]) -> dict[str, dict]:
    """Each method's figures averaged over seeds (None if any seed missed the target), plus the spread."""
    out: dict[str, dict] = {}
    for m in METHODS:
        entries = [rep["methods"][m] for rep in seeds.values()]
        agg = {k: _mean([e.get(k) for e in entries]) for k in FIGURES}
        agg["final_accuracy_per_seed"] = [e["final_accuracy"] for e in entries]
        agg["late_accuracy_per_seed"] = [e.get("late_accuracy") for e in entries]
        if len(entries) > 1 and all(e["final_accuracy"] is not None for e in entries):
            agg["final_accuracy_stdev"] = statistics.stdev(e["final_accuracy"] for e in entries)
        if m != "fedavg":
            agg["speedup_vs_fedavg"] = _mean([e["speedup_vs_fedavg"] for e in entries])
            agg["speedup_per_seed"] = [e["speedup_vs_fedavg"] for e in entries]
        agg["classes"] = combine_classes([e.get("classes") or {} for e in entries])
        out[m] = agg
    return out


CLASS_FIGURES = ("round_speedup_mean", "speedup_mean", "trained_fraction_mean", "personalized_accuracy_mean")


def combine_classes(per_seed: list[dict[str, dict]]) -> dict[str, dict]:
    """Each device class's figures averaged over the seeds that had it (empty without classes)."""
    names = sorted({c for classes in per_seed for c in classes})
    return {
        c: {k: _mean([s[c].get(k) for s in per_seed if c in s]) for k in CLASS_FIGURES}
        | {"seeds": sum(c in s for s in per_seed)}
        for c in names
    }


# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom; beyond 30, the normal's.
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)


def mean_ci95(values: list[float]) -> tuple[float, float | None]:
    """(mean, half-width of its 95% confidence interval) over independent seeds; no interval from one seed."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    df = len(values) - 1
    t = _T975[df - 1] if df <= len(_T975) else 1.96
    return mean, t * statistics.stdev(values) / len(values) ** 0.5


DIFFERENCE_FIGURES = ("final_accuracy", "late_accuracy", "time_mean_accuracy")


def differences(seeds: dict[int, dict]) -> dict[str, dict]:
    """Each later method minus each earlier one (``fleet-naive``, ...), per figure: the per-seed
    differences, their mean and its 95% interval. Every seed runs all methods from the same
    partitions, profile and start, so differences cancel what the seeds share; an interval that
    contains 0 means the seeds cannot tell the two apart."""
    out: dict[str, dict] = {}
    for i, a in enumerate(METHODS):
        for b in METHODS[:i]:
            pair: dict[str, dict] = {}
            for fig in DIFFERENCE_FIGURES:
                diffs = [
                    rep["methods"][a][fig] - rep["methods"][b][fig]
                    for rep in seeds.values()
                    if rep["methods"][a].get(fig) is not None and rep["methods"][b].get(fig) is not None
                ]
                if len(diffs) != len(seeds) or not diffs:
                    continue
                mean, half = mean_ci95(diffs)
                pair[fig] = {"mean": mean, "ci95": half, "per_seed": diffs}
            out[f"{a}-{b}"] = pair
    return out


def _simulate(config_path: Path, quiet: bool, resume: bool = False) -> None:
    cmd = [
        sys.executable,
        "-c",
        "import sys; from fleet.cli import main; sys.exit(main())",
        "simulate",
        str(config_path),
    ]
    cmd += ["--resume"] if resume else []
    res = subprocess.run(
        cmd,
        stdout=subprocess.PIPE if quiet else None,
        stderr=subprocess.STDOUT if quiet else None,
        text=True,
        env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"},
    )
    if res.returncode != 0:
        tail = (res.stdout or "")[-1500:] if quiet else ""
        raise FleetError(
            f"the {config_path.name} simulation failed (exit {res.returncode}){': ' + tail if tail else ''}"
        )


PATH_FIELDS = ("output_dir", "model.weights", "hardware.profile", "hardware.spill_dir")


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(Path(v).resolve()) if f"{prefix}{k}" in PATH_FIELDS and v else v
    return out


def reused_summary(method: str, want: FleetConfig) -> RunSummary:
    """The summary of ``method``'s completed run, if it was made with exactly the config this bench
    would run it with (same shared profile and start model); else a one-line error."""
    out = run_dir(want)
    if not (out / SUMMARY_FILE).is_file() or not (out / EFFECTIVE_CONFIG).is_file():
        raise ConfigError(f"--reuse {method}: {out} holds no finished run; run the bench without --reuse {method}")
    summary = RunSummary.read(out)
    fed = want.federation
    # With a time budget the round count is only a cap (and the bench may have raised it).
    timed_out = bool(fed.time_budget_s) and summary.sim_time_s >= fed.time_budget_s
    made = _flat(config_to_dict(load_fleet_config(out / EFFECTIVE_CONFIG)))
    for key, value in _flat(config_to_dict(want)).items():
        if key == "output_dir" or (timed_out and key == "federation.rounds"):
            continue
        if made.get(key) != value:
            raise ConfigError(
                f"--reuse {method}: {out} was run with {key}={made.get(key)!r}, this bench needs {value!r}; "
                f"run it again (drop --reuse {method})"
            )
    if summary.rounds < fed.rounds and not timed_out:
        raise ConfigError(
            f"--reuse {method}: {out} stopped after {summary.rounds} rounds; finish it with "
            f"`fleet simulate {out / EFFECTIVE_CONFIG} --resume` or drop --reuse {method}"
        )
    return summary


def elastic_round_cap(cfg: FleetConfig) -> int:
    """How many rounds an elastic method may take to fill FedAvg's horizon. Its rounds last about
    the deadline: ``deadline_factor`` of the fastest device's full round, against FedAvg's
    ``max(tiers)`` times that. Only a cap; the time budget ends the run (see :func:`_run_seed`)."""
    fed = cfg.federation
    return int(fed.rounds * max(cfg.devices.tiers) / min(1.0, fed.deadline_factor)) + 1


def _run_seed(
    path: str, overrides: dict[str, Any], seed: int, tag: str, log, quiet: bool, reuse: tuple[str, ...] = ()
) -> tuple[dict[str, RunSummary], dict[str, list[RoundRecord]]]:
    """Run the three methods for one seed; FedAvg first, since its clock sets the others' horizon.
    Methods in ``reuse`` are read from their finished runs instead (see :func:`reused_summary`)."""
    base = load_fleet_config(path, overrides)
    shared, _ = prepare(
        load_fleet_config(path, {**overrides, "name": f"{base.name}{tag}-shared"}), resume=False, log=log
    )
    summaries: dict[str, RunSummary] = {}
    horizon = None
    for method in METHODS:
        extra: dict[str, Any] = {
            "name": f"{base.name}{tag}-{method}",
            "federation.strategy": method,
            "hardware.profile": shared.hardware.profile,
            "model.weights": shared.model.weights,
        }
        if method != "fedavg":
            extra["federation.time_budget_s"] = horizon
            extra["federation.rounds"] = elastic_round_cap(base)
        if method in reuse:
            summaries[method] = reused_summary(method, load_fleet_config(path, {**overrides, **extra}))
            log(f"--- seed {seed}, {method}: reusing {summaries[method].run_dir} ---")
            if method == "fedavg":
                horizon = summaries[method].sim_time_s
            continue
        cfg, config_path = prepare(load_fleet_config(path, {**overrides, **extra}), resume=False, log=log)
        log(
            f"--- seed {seed}, {method}: "
            + (f"{cfg.federation.rounds} rounds" if horizon is None else f"{horizon:.1f}s simulated")
            + f" on {cfg.devices.num_devices} devices ---"
        )
        _simulate(config_path, quiet)
        summaries[method] = RunSummary.read(run_dir(cfg))
        while (
            horizon is not None
            and summaries[method].sim_time_s < horizon
            and summaries[method].rounds >= cfg.federation.rounds
        ):
            # Rounds shorter than the cap assumed (an explicit deadline_s, say): carry on to the horizon.
            cfg, config_path = prepare(
                load_fleet_config(config_path, {"federation.rounds": 2 * cfg.federation.rounds}), resume=True, log=log
            )
            log(
                f"--- seed {seed}, {method}: {summaries[method].rounds} rounds ended short of the horizon; "
                f"resuming with federation.rounds={cfg.federation.rounds} ---"
            )
            _simulate(config_path, quiet, resume=True)
            summaries[method] = RunSummary.read(run_dir(cfg))
        if method == "fedavg":
            horizon = summaries[method].sim_time_s
    return summaries, {m: s.history for m, s in summaries.items()}


def bench_fleet(
    path: str,
    overrides: dict[str, Any] | None = None,
    *,
    target_fraction: float = 0.95,
    quiet: bool = False,
    seeds: list[int] | None = None,
    final_rounds: int = 3,
    reuse: tuple[str, ...] = (),
) -> dict:
    overrides = dict(overrides or {})
    unknown = [m for m in reuse if m not in METHODS]
    if unknown:
        raise ConfigError(f"--reuse: {unknown[0]!r} is not a method; use some of {', '.join(METHODS)}")
    if final_rounds < 1:
        raise ConfigError(f"--final-rounds: {final_rounds} is not allowed; use an integer >= 1")
    base = load_fleet_config(path, overrides)
    seeds = list(seeds) if seeds else [base.train.seed]
    log = progress_log(quiet)
    per_seed: dict[int, dict] = {}
    for seed in seeds:
        tag = "" if seeds == [base.train.seed] else f"-s{seed}"
        summaries, histories = _run_seed(path, {**overrides, "train.seed": seed}, seed, tag, log, quiet, tuple(reuse))
        per_seed[seed] = seed_report(summaries, histories, target_fraction=target_fraction, final_rounds=final_rounds)
    report: dict[str, Any] = {
        "config": str(path),
        "devices": base.devices.num_devices,
        "tiers": base.devices.tiers,
        "fedavg_rounds": base.federation.rounds,
        "comparison": "equal simulated time: FedAvg's rounds set the horizon",
        "final_accuracy_is": f"mean global accuracy of the last {final_rounds} rounds within the horizon",
        "late_accuracy_is": f"mean global accuracy of the rounds ending in the last {LATE_FRACTION:.0%} of the horizon",
        "time_mean_accuracy_is": "mean of the global accuracy-against-time curve, from when every method has "
        "a model to the horizon",
        "target_fraction_of_fedavg_final": target_fraction,
        "seeds": list(per_seed),
        "profile": run_profile(next(iter(per_seed.values()))["methods"]["fedavg"]["run_dir"]),  # whose seconds
        "reused_runs": list(reuse),
        "methods": combine(per_seed),
        "differences": differences(per_seed),
        "per_seed": {str(s): r for s, r in per_seed.items()},
    }
    out = Path(base.output_dir) / f"{base.name}-bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report["plot"] = str(plot_bench(report, out.with_suffix(".png")))
    if any(entry["classes"] for entry in report["methods"].values()):
        report["class_plot"] = str(plot_bench_classes(report, out.with_name(f"{out.stem}-classes.png")))
    out.write_text(json.dumps(report, indent=2))
    return report


def plot_bench(report: dict, path: Path) -> Path:
    """Global accuracy against simulated time, one panel per seed, every method, with the
    horizon and the target marked: the figure behind time to target and final accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = report["per_seed"]
    cols = min(len(seeds), 4)
    rows = -(-len(seeds) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(seeds) :]:
        ax.set_visible(False)
    for ax, (seed, rep) in zip(axes.flat, seeds.items()):
        for method, entry in rep["methods"].items():
            history = RunSummary.read(Path(entry["run_dir"])).history
            history = [r for r in history if r.evaluated]  # rounds without evaluation
            xs = [r.sim_time_s for r in history]
            ys = [100 * r.global_accuracy for r in history]
            sp = entry.get("speedup_vs_fedavg")
            label = f"{method}: final {100 * (entry['final_accuracy'] or 0):.1f}%" + (
                f", {sp:.2f}x to target" if sp else ""
            )
            ax.plot(xs, ys, marker=".", label=label)
        ax.axhline(100 * rep["target_accuracy"], color="grey", ls=":", lw=1, label="target")
        if rep["horizon_s"]:
            ax.axvline(rep["horizon_s"], color="grey", ls="--", lw=1, label="horizon (FedAvg's time)")
            ax.axvspan(
                (1 - LATE_FRACTION) * rep["horizon_s"],
                rep["horizon_s"],
                color="grey",
                alpha=0.08,
                label="late accuracy window",
            )
        ax.set_title(f"seed {seed}")
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("global accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_bench_classes(report: dict, path: Path) -> Path:
    """Per device class, each method side by side: round speedup, trained fraction and personalized
    accuracy (means over the seeds): what each kind of device gets from each method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = report["methods"]
    names = sorted({c for entry in methods.values() for c in entry["classes"]})
    width = 0.8 / len(methods)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, title in (
        (axes[0], "round_speedup_mean", "round speedup vs training fully (compute + upload)"),
        (axes[1], "trained_fraction_mean", "trained fraction of weights"),
        (axes[2], "personalized_accuracy_mean", "personalized accuracy (last evaluation)"),
    ):
        for i, (method, entry) in enumerate(methods.items()):
            values = [(entry["classes"].get(c) or {}).get(key) or 0.0 for c in names]
            ax.bar([j + i * width for j in range(len(names))], values, width, label=method)
        ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(names))], names)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"per device class, mean over seeds {report['seeds']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def class_table(report: dict) -> list[str]:
    """One line per method and device class (none without classes)."""
    rows = [(m, c, f) for m, entry in report["methods"].items() for c, f in entry.get("classes", {}).items()]
    if not rows:
        return []

    def num(v: float | None, fmt: str, scale: float = 1.0, unit: str = "") -> str:
        return format(scale * v, fmt) + unit if v is not None else "n/a"

    lines = [
        f"{'method':>8} {'class':>14} {'round speedup':>13} {'compute speedup':>15} {'trained':>8} {'pers acc':>8}"
    ]
    for m, c, f in rows:
        lines.append(
            f"{m:>8} {c:>14} {num(f['round_speedup_mean'], '.2f', unit='x'):>13} "
            f"{num(f['speedup_mean'], '.2f', unit='x'):>15} {num(f['trained_fraction_mean'], '.3f'):>8} "
            f"{num(f['personalized_accuracy_mean'], '.1f', 100, '%'):>8}"
        )
    return lines


def bench_table(report: dict) -> str:
    def pct(v):
        return f"{100 * v:6.2f}%" if v is not None else "   n/a "

    def sec(v):
        return f"{v:9.1f}" if v is not None else "      n/a"

    def pts(v):  # a change in accuracy, in points
        return f"{100 * v:.2f}" if v is not None else "n/a"

    seeds = report["seeds"]
    lines = [
        f"equal simulated time; {len(seeds)} seed(s) {seeds}; final = {report['final_accuracy_is']}",
        f"late = {report['late_accuracy_is']}",
        f"target = {report['target_fraction_of_fedavg_final']:.0%} of FedAvg's final accuracy",
        f"time mean = {report.get('time_mean_accuracy_is', 'n/a')}",
        f"{'method':>8} {'rounds':>6} {'to target s':>11} {'final':>8} {'late':>8} {'time mean':>9} "
        f"{'last':>8} {'swing':>7} {'pers mean':>9} {'pers p10':>9} {'MB up':>8} {'speedup':>8}",
    ]
    for m, r in report["methods"].items():
        sp = r.get("speedup_vs_fedavg")
        lines.append(
            f"{m:>8} {r['rounds'] or 0:6.1f} {sec(r['time_to_target_s']):>11} {pct(r['final_accuracy'])} "
            f"{pct(r.get('late_accuracy'))} "
            f"{pct(r.get('time_mean_accuracy')):>9} {pct(r['last_round_accuracy'])} "
            f"{pts(r.get('global_accuracy_swing')):>7} "
            f"{pct(r['personalized_accuracy_mean']):>9} {pct(r['personalized_accuracy_p10']):>9} "
            f"{(r['bytes_uploaded'] or 0) / 1e6:8.1f} {f'{sp:.2f}x' if sp else '   -':>8}"
        )

    def gap(d: dict | None) -> str:
        if d is None:
            return "n/a"
        return f"{100 * d['mean']:+.2f}" + (f" ± {100 * d['ci95']:.2f}" if d["ci95"] is not None else "")

    lines.append(f"differences in points, mean ± 95% interval over the {len(seeds)} seed(s):")
    for pair, figs in report.get("differences", {}).items():
        lines.append(
            f"{pair:>13}: final {gap(figs.get('final_accuracy'))}, late {gap(figs.get('late_accuracy'))}, "
            f"time mean {gap(figs.get('time_mean_accuracy'))}"
        )
    return "\n".join(lines + class_table(report))

"""``fleet bench pfl``: personalized federated learning, every method at the same simulated time.

The methods people compare personalization with (pFL-Bench's baselines) against fleet, on devices
whose label mix *and* inputs differ (``devices.shift``):

* ``fedavg_ft``: FedAvg, then each device fine-tunes the global model before it is scored;
* ``fedbn`` / ``fedper``: FedAvg with the normalization layers / the head kept on the device;
* ``ditto``: every device trains fully, and a personal model pulled toward the global one;
* ``naive``: per-device ElasticTrainer;
* ``fleet``, ``fleet_head``, ``fleet_norms``, ``fleet_head_norms``: fleet with each personal policy.

Each method runs as its own ``fleet simulate`` from the same profile, start model and split.
FedAvg+FT runs ``federation.rounds`` rounds, which sets the simulated-time horizon every other
method gets (as ``fleet bench fleet`` does). A method's **personalized accuracy** is what its
devices end with on their own held-out splits: the fine-tuned global model for FedAvg+FT, the
device's own model for the others. The target is 95% of FedAvg+FT's final personalized mean.

``devices.newcomers`` devices never take part. After the runs, each personalizes from fleet's
final global model with ``full``, ``tl``, ``bn_bias`` and ``elastic`` (rho 0.5), its accuracy
recorded against device time (:mod:`fleet.federated.newcomer`): ElasticTrainer's claim, on a fleet.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fleet.base.errors import ConfigError
from fleet.bench.fleet import _mean, _simulate, accuracy_swing, elastic_round_cap, mean_ci95, time_to_target, within
from fleet.bench.launch import progress_log
from fleet.engine.device_profile import DeviceProfile
from fleet.federated.config import load_fleet_config, run_dir
from fleet.federated.newcomer import personalize_newcomer
from fleet.federated.prepare import prepare
from fleet.federated.state import CHECKPOINT_FILE, load_checkpoint
from fleet.federated.tracking import METRICS_FILE, SUMMARY_FILE, p10

DEFAULT_CONFIG = "simulations/pfl.yaml"
BASELINE = "fedavg_ft"  # its rounds set the horizon, its final personalized mean the target
METHODS: dict[str, dict[str, Any]] = {
    "fedavg_ft": {"federation.strategy": "fedavg"},  # + finetune_steps (the bench's --finetune-steps)
    "fedbn": {"federation.strategy": "fedavg", "personalization.policy": "norms"},
    "fedper": {"federation.strategy": "fedavg", "personalization.policy": "head"},
    "ditto": {"federation.strategy": "ditto", "federation.deadline_factor": 1e6},  # the baseline trains fully
    "naive": {"federation.strategy": "naive"},
    "fleet": {"federation.strategy": "fleet", "personalization.policy": "none"},
    "fleet_head": {"federation.strategy": "fleet", "personalization.policy": "head"},
    "fleet_norms": {"federation.strategy": "fleet", "personalization.policy": "norms"},
    "fleet_head_norms": {"federation.strategy": "fleet", "personalization.policy": "head+norms"},
}
NEWCOMER_SOURCE = "fleet"  # whose final global model the new devices personalize from


def personalized_key(method: str) -> str:
    """The history field that is a method's personalized accuracy."""
    return "finetuned_accuracy" if method == BASELINE else "personal_accuracy"


def personalized_curve(history: list[dict], method: str) -> list[dict]:
    """``[{"sim_time_s", "global_accuracy"}]`` of the method's personalized accuracy (evaluated rounds only),
    in the shape :func:`fleet.bench.fleet.time_to_target` reads."""
    key = personalized_key(method)
    return [{"sim_time_s": r["sim_time_s"], "global_accuracy": r[key]} for r in history if r.get(key) is not None]


def device_values(run: Path, method: str, horizon: float | None) -> list[float]:
    """Each device's personalized accuracy in the method's last evaluated round within the horizon."""
    key = personalized_key(method)
    records = [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines() if line.strip()]
    evaluated = [r for r in within(records, horizon) if r.get(key) is not None]
    return [d[key] for d in evaluated[-1]["devices"] if key in d] if evaluated else []


def method_figures(summary: dict, method: str, horizon: float | None, target: float) -> dict[str, Any]:
    """One method's figures in one seed, over its rounds within the horizon."""
    history = within(summary["history"], horizon)
    curve = personalized_curve(history, method)
    devices = device_values(Path(summary["run_dir"]), method, horizon)
    return {
        "personalized_accuracy_mean": statistics.fmean(devices) if devices else None,
        "personalized_accuracy_p10": p10(devices),
        "time_to_target_s": time_to_target(curve, target),
        "bytes_uploaded": int(sum(r.get("bytes_uploaded", 0) for r in history)),
        "global_accuracy_swing": accuracy_swing(history),
        "rounds": len(history),
        "sim_time_s": history[-1]["sim_time_s"] if history else 0.0,
        "device_accuracies": devices,
        "curve": curve,
        "run_dir": summary["run_dir"],
    }


def run_method(path: str, overrides: dict[str, Any], log, quiet: bool) -> dict:
    """One method's simulation; its summary."""
    cfg, config_path = prepare(load_fleet_config(path, overrides), resume=False, log=log)
    _simulate(config_path, quiet)
    return json.loads((run_dir(cfg) / SUMMARY_FILE).read_text())


def run_seed(
    path: str, overrides: dict[str, Any], methods: Sequence[str], finetune_steps: int, tag: str, log, quiet: bool
) -> dict[str, dict]:
    """Every method for one seed from one shared profile and start; the baseline first (its clock is the horizon)."""
    base = load_fleet_config(path, overrides)
    shared, _ = prepare(
        load_fleet_config(path, {**overrides, "name": f"{base.name}{tag}-shared"}), resume=False, log=log
    )
    common = {**overrides, "hardware.profile": shared.hardware.profile, "model.weights": shared.model.weights}
    summaries: dict[str, dict] = {}
    horizon = None
    for method in [BASELINE] + [m for m in methods if m != BASELINE]:
        extra = {"name": f"{base.name}{tag}-{method}", **METHODS[method]}
        extra["personalization.finetune_steps"] = finetune_steps if method == BASELINE else 0
        if horizon is not None:
            extra["federation.time_budget_s"] = horizon
            extra["federation.rounds"] = elastic_round_cap(base)
        span = f"{horizon:.1f}s simulated" if horizon is not None else f"{base.federation.rounds} rounds (the horizon)"
        log(f"--- seed {overrides.get('train.seed', base.train.seed)}, {method}: {span} ---")
        summaries[method] = run_method(path, {**common, **extra}, log, quiet)
        if horizon is None:
            horizon = summaries[method]["sim_time_s"]
    return summaries


def seed_figures(summaries: dict[str, dict], target_fraction: float) -> dict[str, Any]:
    """One seed's comparison at the baseline's horizon and target."""
    horizon = summaries[BASELINE]["sim_time_s"]
    base = method_figures(summaries[BASELINE], BASELINE, horizon, float("inf"))
    final = base["personalized_accuracy_mean"]
    target = target_fraction * final if final is not None else float("inf")
    methods = {m: method_figures(s, m, horizon, target) for m, s in summaries.items()}
    t_base = methods[BASELINE]["time_to_target_s"]
    for entry in methods.values():
        t = entry["time_to_target_s"]
        entry["speedup_vs_baseline"] = t_base / t if t_base and t else None
    return {"horizon_s": horizon, "target_accuracy": target, "methods": methods}


NEWCOMER_LR = 1e-3  # a tenth of the fleet's: fine-tuning a trained model on a few hundred images, not training it


def newcomer_figures(
    run: Path, epochs: int, log, lr: float = NEWCOMER_LR, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The newcomers personalize from the final global model of the run in ``run`` (its config, with
    ``overrides``): per method, the mean over them of the final accuracy and device time, and the mean curve."""
    cfg = load_fleet_config(run / "fleet-config.yaml", overrides)
    try:
        loaded = load_checkpoint(run)
    except Exception as exc:  # a damaged or foreign file: torch's own error says little to a user
        raise ConfigError(f"{run / CHECKPOINT_FILE}: not a readable fleet checkpoint ({type(exc).__name__})") from None
    if loaded is None:
        raise ConfigError(f"{run / CHECKPOINT_FILE}: not a readable fleet checkpoint; give a finished run's folder")
    if cfg.devices.newcomers == 0:
        return {}
    model = loaded[0]
    profile = DeviceProfile.load(cfg.hardware.profile)
    curves = []
    for pid in range(cfg.devices.taking_part, cfg.devices.num_devices):
        log(f"--- new device {pid} personalizes from {run.name} ---")
        curves.append(personalize_newcomer(cfg, model, pid, profile, epochs=epochs, lr=lr))
    out = {}
    for method in curves[0]:
        mean_curve = [
            {k: statistics.fmean(c[method][i][k] for c in curves) for k in ("device_time_s", "accuracy")}
            for i in range(len(curves[0][method]))
        ]
        out[method] = {
            "final_accuracy": mean_curve[-1]["accuracy"],
            "device_time_s": mean_curve[-1]["device_time_s"],
            "curve": mean_curve,
        }
    full = out.get("full")
    for entry in out.values():
        entry["time_vs_full"] = (
            entry["device_time_s"] / full["device_time_s"] if full and full["device_time_s"] else None
        )
    return out


FIGURES = ("personalized_accuracy_mean", "personalized_accuracy_p10", "time_to_target_s", "bytes_uploaded")


def combine(seeds: dict[int, dict]) -> dict[str, dict]:
    """Each method's figures as the mean over seeds, with a 95% interval where there are several
    (None when a seed has no figure: e.g. a method that never reached the target)."""
    out: dict[str, dict] = {}
    for method in next(iter(seeds.values()))["methods"]:
        entry: dict[str, Any] = {}
        for fig in (*FIGURES, "global_accuracy_swing", "speedup_vs_baseline"):
            values = [rep["methods"][method].get(fig) for rep in seeds.values()]
            if any(v is None for v in values):
                entry[fig], entry[f"{fig}_ci95"] = None, None
                continue
            entry[fig], entry[f"{fig}_ci95"] = mean_ci95([float(v) for v in values])
        entry["per_seed"] = {str(s): rep["methods"][method]["personalized_accuracy_mean"] for s, rep in seeds.items()}
        out[method] = entry
    return out


def bench_pfl(
    path: str = DEFAULT_CONFIG,
    overrides: dict[str, Any] | None = None,
    *,
    seeds: Sequence[int] | None = None,
    methods: Sequence[str] | None = None,
    finetune_steps: int = 10,
    newcomer_epochs: int = 5,
    newcomer_lr: float = NEWCOMER_LR,
    target_fraction: float = 0.95,
    quiet: bool = False,
) -> dict[str, Any]:
    methods = list(methods or METHODS)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError(f"--methods: {unknown[0]!r} is not a method; use some of {', '.join(METHODS)}")
    if finetune_steps < 1:
        raise ConfigError(f"--finetune-steps: {finetune_steps} is not allowed; use an integer >= 1")
    log = progress_log(quiet)
    overrides = dict(overrides or {})
    base = load_fleet_config(path, overrides)
    seeds = list(seeds or [base.train.seed])
    per_seed, newcomers = {}, {}
    for seed in seeds:
        tag = f"-s{seed}"
        summaries = run_seed(path, {**overrides, "train.seed": seed}, methods, finetune_steps, tag, log, quiet)
        per_seed[seed] = seed_figures(summaries, target_fraction)
        source = summaries.get(NEWCOMER_SOURCE) or summaries[BASELINE]
        newcomers[seed] = newcomer_figures(Path(source["run_dir"]), newcomer_epochs, log, newcomer_lr)
    report: dict[str, Any] = {
        "config": str(path),
        "seeds": seeds,
        "comparison": f"equal simulated time: {BASELINE}'s rounds set the horizon",
        "personalized_accuracy_is": "each device's accuracy on its held-out split with the model it ends with "
        f"(the fine-tuned global model for {BASELINE}), in the last evaluated round within the horizon",
        "target_fraction_of_baseline": target_fraction,
        "methods": combine(per_seed),
        "new_devices": combine_newcomers(newcomers),
        "per_seed": {str(s): r for s, r in per_seed.items()},
    }
    out = Path(base.output_dir) / f"{base.name}-pfl.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report["plots"] = [str(p) for p in plot_pfl(report, out.with_suffix(""))]
    out.write_text(json.dumps(report, indent=2))
    report["report"] = str(out)
    return report


def newcomers_from(
    runs: Sequence[str],
    epochs: int,
    lr: float = NEWCOMER_LR,
    overrides: dict[str, Any] | None = None,
    quiet: bool = False,
) -> dict[str, Any]:
    """The new devices of finished runs (e.g. each seed's ``<name>-sN-fleet``) personalize again from
    their final global models, without running the fleets again; ``overrides`` change the runs' configs
    (e.g. ``train.interval``, how often a new device's elastic training probes)."""
    log = progress_log(quiet)
    per_run = {}
    for i, run in enumerate(runs):
        path = Path(run)
        if not (path / CHECKPOINT_FILE).is_file() or not (path / "fleet-config.yaml").is_file():
            raise ConfigError(
                f"--newcomers-from: {run} holds no finished fleet run; give a run folder with {CHECKPOINT_FILE}"
            )
        per_run[i] = newcomer_figures(path, epochs, log, lr, overrides)
        if not per_run[i]:
            raise ConfigError(
                f"--newcomers-from: {run} ran with devices.newcomers 0, so it has no new devices to personalize; "
                "give a run made with newcomers"
            )
    report = {"runs": [str(r) for r in runs], "newcomer_lr": lr, "overrides": dict(overrides or {})}
    report["new_devices"] = combine_newcomers(per_run)
    plot = Path(runs[0]).parent / "new-devices.png"
    report["plot"] = str(plot_new_devices(report["new_devices"], plot))
    return report


def combine_newcomers(per_seed: dict[int, dict]) -> dict[str, dict]:
    """Per personalization method, the new devices' final accuracy and device time, mean over seeds."""
    seeds = [s for s in per_seed.values() if s]
    if not seeds:
        return {}
    return {
        m: {
            "final_accuracy": statistics.fmean(s[m]["final_accuracy"] for s in seeds),
            "device_time_s": statistics.fmean(s[m]["device_time_s"] for s in seeds),
            "time_vs_full": _mean([s[m]["time_vs_full"] for s in seeds]),
            "curve": [  # epoch by epoch, mean over the seeds
                {k: statistics.fmean(s[m]["curve"][i][k] for s in seeds) for k in ("device_time_s", "accuracy")}
                for i in range(min(len(s[m]["curve"]) for s in seeds))
            ],
        }
        for m in seeds[0]
    }


def plot_pfl(report: dict, stem: Path) -> list[Path]:
    """The first seed's personalized accuracy against simulated time, every method's per-device
    accuracies, and the new devices' accuracy against device time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = next(iter(report["per_seed"].values()))
    paths = [Path(f"{stem}.png"), Path(f"{stem}-devices.png"), Path(f"{stem}-new-devices.png")]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for method, entry in first["methods"].items():
        ax.plot(
            [p["sim_time_s"] for p in entry["curve"]],
            [100 * p["global_accuracy"] for p in entry["curve"]],
            marker=".",
            label=method,
        )
    ax.axhline(100 * first["target_accuracy"], color="grey", ls=":", lw=1, label="target")
    ax.set(
        xlabel="simulated time (s)",
        ylabel="personalized accuracy (%)",
        title="personalized accuracy, seed " + str(report["seeds"][0]),
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4))
    names = list(first["methods"])
    for i, method in enumerate(names):
        values = [100 * v for rep in report["per_seed"].values() for v in rep["methods"][method]["device_accuracies"]]
        ax.scatter([i + 0.15 * ((j % 5) - 2) / 2 for j in range(len(values))], values, s=12, alpha=0.6)
        ax.hlines(statistics.fmean(values) if values else 0, i - 0.3, i + 0.3, color="black")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set(ylabel="a device's personalized accuracy (%)", title="per device, every seed (bar: mean)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)

    plot_new_devices(report["new_devices"], paths[2])
    return paths


def plot_new_devices(new_devices: dict, path: Path) -> Path:
    """Each personalization method's accuracy against device time, mean over the new devices and seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, entry in new_devices.items():
        ax.plot(
            [p["device_time_s"] for p in entry["curve"]],
            [100 * p["accuracy"] for p in entry["curve"]],
            marker="o",
            label=method,
        )
    ax.set(xlabel="device time (s)", ylabel="accuracy (%)", title="new devices personalizing from the final model")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def pfl_table(report: dict) -> str:
    def pct(v, ci=None):
        return "n/a" if v is None else f"{100 * v:.2f}%" + (f" ±{100 * ci:.2f}" if ci else "")

    lines = [
        f"{report['comparison']}; seeds {report['seeds']}; target {report['target_fraction_of_baseline']:.0%} of "
        f"{BASELINE}'s final personalized mean",
        f"{'method':>17} {'pers mean':>16} {'pers p10':>16} {'to target s':>11} {'vs base':>8} {'MB up':>9} "
        f"{'swing':>6}",
    ]
    for m, r in report["methods"].items():
        t, sp, swing = r["time_to_target_s"], r["speedup_vs_baseline"], r["global_accuracy_swing"]
        lines.append(
            f"{m:>17} {pct(r['personalized_accuracy_mean'], r['personalized_accuracy_mean_ci95']):>16} "
            f"{pct(r['personalized_accuracy_p10'], r['personalized_accuracy_p10_ci95']):>16} "
            f"{'n/a' if t is None else f'{t:.1f}':>11} {'n/a' if sp is None else f'{sp:.2f}x':>8} "
            f"{(r['bytes_uploaded'] or 0) / 1e6:>9.1f} {'n/a' if swing is None else f'{100 * swing:.2f}':>6}"
        )
    if report["new_devices"]:
        lines.append(newcomers_table(report["new_devices"]))
    return "\n".join(lines)


def newcomers_table(new_devices: dict) -> str:
    lines = ["new devices, personalizing from fleet's final global model (mean over them and the seeds):"]
    for m, r in new_devices.items():
        ratio = r["time_vs_full"]
        lines.append(
            f"{m:>17} {100 * r['final_accuracy']:>8.2f}% in {r['device_time_s']:.1f}s of device time"
            + ("" if ratio is None else f" ({ratio:.2f}x full's)")
        )
    return "\n".join(lines)

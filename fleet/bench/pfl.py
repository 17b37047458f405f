"""``fleet bench pfl``: personalized federated learning, every method at the same simulated time.

The published personalization methods against fleet's, on devices whose label mix *and* inputs
differ (``devices.shift``), in one harness (docs/algorithms.md, "Personal models"):

* baselines (:data:`BASELINES`), each training every tensor: ``fedavg_ft`` (FedAvg, then each device
  fine-tunes the global model before it is scored), ``fedbn`` / ``fedper`` (the norms / the head
  kept on the device), ``fedrep`` (a personal head trained first, then the shared body), ``fedala``
  (the global model merged into the device's own by learned weights), ``apfl`` (a personal model
  mixed with the shared one) and ``ditto`` (a personal model pulled toward the global one);
* fleet's: ``naive`` (per-device ElasticTrainer), ``fleet`` with each personal policy, and fleet's
  selection with a personal-model method (``fleet_ditto``, ``fleet_ditto_own``, ``fleet_rep``, ``fleet_ala``,
  ``fleet_apfl``).

The protocol (:data:`PROTOCOL`, in the JSON): every method runs as its own ``fleet simulate`` from
the same profile (a reference one from ``profiles/`` unless ``--profile measured``), start model and
split. FedAvg+FT runs ``federation.rounds`` rounds, which sets the simulated-time horizon every other
method gets. A method's personalized accuracy is its devices' accuracy in the last evaluated round
within the horizon, every device evaluated. The best baseline is the one with the highest mean over
the seeds; the target is its final personalized mean minus 1 point, per seed; fleet's best method
is compared with it paired by seed. Seeds run in batches (one ``--set devices.alpha=A`` each) and
combine with ``--combine``; ``--reuse`` takes any method run already finished with the same config.

``devices.newcomers`` devices never take part. After the runs, each personalizes from fleet's
final global model with ``full``, ``tl``, ``bn_bias`` and ``elastic`` (rho 0.5), its accuracy
recorded against device time (:mod:`fleet.federated.launch.newcomer`): ElasticTrainer's claim, on a fleet.
"""

from __future__ import annotations

import json
import shutil
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fleet.base.errors import ConfigError
from fleet.bench.figures import SIM_CLOCK, speedup, time_to_target
from fleet.bench.fleet import (
    _mean,
    _simulate,
    accuracy_swing,
    elastic_round_cap,
    mean_ci95,
    reused_summary,
    within,
)
from fleet.bench.launch import progress_log
from fleet.bench.regimes import run_profile
from fleet.engine.device_profile import DeviceProfile
from fleet.federated.launch.newcomer import mean_curve, personalize_newcomer
from fleet.federated.launch.prepare import prepare
from fleet.federated.on_server.state import CHECKPOINT_FILE, load_checkpoint
from fleet.federated.on_server.tracking import honest_rejections, honest_tensors_left_out, p10, read_records
from fleet.federated.shared.config import load_fleet_config, run_dir
from fleet.federated.shared.names import DEVICES_DIR
from fleet.federated.shared.round_record import DeviceRow, RoundRecord
from fleet.federated.shared.run_summary import RunSummary, history_json

DEFAULT_CONFIG = "simulations/pfl.yaml"
BASELINE = "fedavg_ft"  # its rounds set the horizon
FULL = {"federation.strategy": "fedavg"}  # a baseline trains every tensor
METHODS: dict[str, dict[str, Any]] = {
    "fedavg_ft": FULL,  # + finetune_steps (the bench's --finetune-steps)
    "fedbn": {**FULL, "personalization.policy": "norms"},
    "fedper": {**FULL, "personalization.policy": "head"},
    "fedrep": {**FULL, "personalization.method": "fedrep", "personalization.policy": "head"},
    "fedala": {**FULL, "personalization.method": "fedala"},
    "apfl": {**FULL, "personalization.method": "apfl"},
    "ditto": {**FULL, "personalization.method": "ditto"},
    "naive": {"federation.strategy": "naive"},
    "fleet": {"federation.strategy": "fleet", "personalization.policy": "none"},
    "fleet_head": {"federation.strategy": "fleet", "personalization.policy": "head"},
    "fleet_norms": {"federation.strategy": "fleet", "personalization.policy": "norms"},
    "fleet_head_norms": {"federation.strategy": "fleet", "personalization.policy": "head+norms"},
    "fleet_ditto": {"federation.strategy": "fleet", "personalization.method": "ditto"},
    "fleet_ditto_own": {
        "federation.strategy": "fleet",
        "personalization.method": "ditto",
        "personalization.personal_selection": "own",  # the personal model's tensors by compute alone
    },
    "fleet_ditto_own_half": {  # the same at half the automatic deadline: twice the rounds, each half as long
        "federation.strategy": "fleet",
        "personalization.method": "ditto",
        "personalization.personal_selection": "own",
        "federation.deadline_factor": 0.5,
    },
    "fleet_rep": {"federation.strategy": "fleet", "personalization.method": "fedrep", "personalization.policy": "head"},
    "fleet_apfl": {"federation.strategy": "fleet", "personalization.method": "apfl"},
    "fleet_apfl_half": {
        "federation.strategy": "fleet",
        "personalization.method": "apfl",
        "federation.deadline_factor": 0.5,
    },
    "fleet_ala": {"federation.strategy": "fleet", "personalization.method": "fedala"},
}
BASELINES = ("fedavg_ft", "fedbn", "fedper", "fedrep", "fedala", "apfl", "ditto")  # every other method is fleet's
NEWCOMER_SOURCE = "fleet"  # whose final global model the new devices personalize from (else fleet's first method run)
TARGET_MARGIN = 0.01  # the target: the best baseline's final personalized mean less this (1 point)
PROTOCOL = {
    "horizon": f"equal simulated time: {BASELINE}'s federation.rounds rounds set it for every method",
    "accuracy": "the last evaluated round within the horizon (not the best round)",
    "devices_scored": "every device taking part, sampled in that round or not (evaluation.all_devices)",
    "scored_after": "the method's own local step: each device's model after its last local training (its personal "
    "model under Ditto and APFL, FedALA's trained merge, the shared tensors with its own personal ones under "
    f"FedBN, FedPer and FedRep); for {BASELINE}, the global model after the device's fine-tuning steps. A device not "
    "sampled in the last round is scored with the model of its last local step",
    "target": "per seed, the best baseline's final personalized mean less 1 point; a method that never reaches it "
    "within the horizon has no time (not reached)",
    "paired": "fleet's best method minus the best baseline, seed by seed, with a 95% t interval over the seeds",
}


def personalized(method: str, row: DeviceRow) -> float | None:
    """A device row's personalized accuracy as ``method`` makes it: for the baseline, its fine-tuned model's."""
    return row.finetuned_accuracy if method == BASELINE else row.personal_accuracy


def device_rounds(records: list[RoundRecord], method: str) -> list[tuple[RoundRecord, list[float]]]:
    """Per evaluated round of ``records``: the round and each device's personalized accuracy."""
    rounds = [(r, [v for d in r.devices if (v := personalized(method, d)) is not None]) for r in records]
    return [(r, values) for r, values in rounds if values]


def personalized_curve(rounds: list[tuple[RoundRecord, list[float]]]) -> list[dict]:
    """Each evaluated round, its number and clock, with the mean over its devices as its ``global_accuracy``: a
    summary history's
    round (:func:`~fleet.federated.shared.run_summary.history_json`) that
    :func:`fleet.bench.figures.time_to_target` reads: the figure the final mean and the target are made of (the
    round's own accuracy weighs devices by their test samples, and a target from one read on the other could
    be out of reach of the method that set it)."""
    return [
        history_json(RoundRecord(round=r.round, sim_time_s=r.sim_time_s, global_accuracy=statistics.fmean(values)))
        for r, values in rounds
    ]


def method_figures(summary: RunSummary, method: str, horizon: float | None) -> dict[str, Any]:
    """One method's figures in one seed, over its rounds within the horizon (the target comes later: it
    follows the best baseline, known only over every seed)."""
    history = within(summary.history, horizon)
    records = within(read_records(Path(summary.run_dir)), horizon)
    rounds = device_rounds(records, method)
    devices = rounds[-1][1] if rounds else []
    return {
        "personalized_accuracy_mean": statistics.fmean(devices) if devices else None,
        "personalized_accuracy_p10": p10(devices),
        "bytes_uploaded": int(sum(r.bytes_uploaded for r in history)),
        "honest_rejected": honest_rejections(records),  # nobody attacks here
        "honest_tensors_left_out": honest_tensors_left_out(records),
        "global_accuracy_swing": accuracy_swing(history),
        "rounds": len(history),
        "sim_time_s": history[-1].sim_time_s if history else 0.0,
        "device_accuracies": devices,
        "curve": personalized_curve(rounds),
        "run_dir": summary.run_dir,
    }


def run_method(path: str, overrides: dict[str, Any], log, quiet: bool, reuse: bool) -> RunSummary:
    """One method's simulation; its summary. With ``reuse``, a finished run of the same config is read instead."""
    want = load_fleet_config(path, overrides)
    if reuse:
        try:
            summary = reused_summary(want.name, want)
            log(f"    reusing {summary.run_dir}")
            return summary
        except ConfigError as why:  # its first clause says why (no finished run, another config); the advice is moot
            log(f"    not reused ({str(why).split(': ', 1)[-1].split(';')[0]}): running it")
    cfg, config_path = prepare(want, resume=False, log=log)
    _simulate(config_path, quiet)
    # The devices' saved state (weights and momentum, ~90 MB each) is read by nothing after the run; a seed's
    # runs would otherwise fill a disk (20 GB a seed). Metrics, summary and the final checkpoint stay.
    shutil.rmtree(run_dir(cfg) / DEVICES_DIR, ignore_errors=True)
    return RunSummary.read(run_dir(cfg))


def newcomer_source(summaries: dict[str, RunSummary]) -> str:
    """The run whose final global model the new devices personalize from: ``fleet``'s, else the first of
    fleet's methods that ran, else the baseline's."""
    ours = [m for m in summaries if m not in BASELINES]
    return NEWCOMER_SOURCE if NEWCOMER_SOURCE in summaries else (ours[0] if ours else BASELINE)


def seed_tag(alpha: float, seed: int) -> str:
    """A seed's key and run-name tag: the Dirichlet beta and the seed (``a0.1-s3``)."""
    return f"a{alpha:g}-s{seed}"


def run_seed(
    path: str, overrides: dict[str, Any], methods: Sequence[str], finetune_steps: int, log, quiet: bool, reuse: bool
) -> dict[str, RunSummary]:
    """Every method for one seed from one shared profile and start; the baseline first (its clock is the horizon)."""
    base = load_fleet_config(path, overrides)
    tag = seed_tag(base.devices.alpha, base.train.seed)
    shared_cfg = load_fleet_config(path, {**overrides, "name": f"{base.name}-{tag}-shared"})
    shared, _ = prepare(shared_cfg, resume=reuse, log=log)  # resumed: the same start model as the reused runs
    common = {**overrides, "hardware.profile": shared.hardware.profile, "model.weights": shared.model.weights}
    summaries: dict[str, RunSummary] = {}
    horizon = None
    for method in [BASELINE] + [m for m in methods if m != BASELINE]:
        extra = {"name": f"{base.name}-{tag}-{method}", **METHODS[method]}
        extra["personalization.finetune_steps"] = finetune_steps if method == BASELINE else 0
        if horizon is not None:
            extra["federation.time_budget_s"] = horizon
            extra["federation.rounds"] = elastic_round_cap(load_fleet_config(path, {**overrides, **extra}))
        span = f"{horizon:.1f}s simulated" if horizon is not None else f"{base.federation.rounds} rounds (the horizon)"
        log(f"--- {tag}, {method}: {span} ---")
        summaries[method] = run_method(path, {**common, **extra}, log, quiet, reuse)
        if horizon is None:
            horizon = summaries[method].sim_time_s
    return summaries


def seed_figures(summaries: dict[str, RunSummary], alpha: float, seed: int) -> dict[str, Any]:
    """One seed's figures at the baseline's horizon."""
    horizon = summaries[BASELINE].sim_time_s
    methods = {m: method_figures(s, m, horizon) for m, s in summaries.items()}
    profile = run_profile(summaries[BASELINE].run_dir)
    return {"alpha": alpha, "seed": seed, "horizon_s": horizon, "profile": profile, "methods": methods}


NEWCOMER_LR = 1e-3  # a tenth of the fleet's: fine-tuning a trained model on a few hundred images, not training it


def newcomer_figures(
    run: Path,
    epochs: int,
    log,
    lr: float = NEWCOMER_LR,
    overrides: dict[str, Any] | None = None,
    orders: int = 1,
) -> dict[str, Any]:
    """The newcomers personalize from the final global model of the run in ``run`` (its config, with
    ``overrides``), each method in ``orders`` batch orders: per method, the mean over them of the final
    accuracy and device time, and the mean curve."""
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
        curves.append(personalize_newcomer(cfg, model, pid, profile, epochs=epochs, lr=lr, orders=orders))
    out = {}
    for method in curves[0]:
        mean = mean_curve([c[method] for c in curves])
        out[method] = {
            "final_accuracy": mean[-1]["accuracy"],
            "final_distribution_accuracy": mean[-1]["distribution_accuracy"],
            "device_time_s": mean[-1]["device_time_s"],
            "batch_orders": orders,
            "curve": mean,
        }
    full = out.get("full")
    for entry in out.values():
        entry["time_vs_full"] = (
            entry["device_time_s"] / full["device_time_s"] if full and full["device_time_s"] else None
        )
    return out


FIGURES = ("personalized_accuracy_mean", "personalized_accuracy_p10", "time_to_target_s", "bytes_uploaded")
SPEEDUPS = ("speedup_vs_best_baseline", "speedup_vs_baseline")


def with_target(seeds: dict[str, dict], best: str) -> None:
    """Set each seed's target (``best``'s final personalized mean less :data:`TARGET_MARGIN`), every method's
    time to it (None: not reached within the horizon) and its speedup over ``best`` and over FedAvg+FT."""
    for rep in seeds.values():
        final = rep["methods"][best]["personalized_accuracy_mean"]
        rep["target_accuracy"] = target = final - TARGET_MARGIN if final is not None else float("inf")
        for entry in rep["methods"].values():
            curve = [RoundRecord.from_json(point) for point in entry["curve"]]
            entry["time_to_target_s"] = time_to_target(curve, target, clock=SIM_CLOCK)
        t_best = rep["methods"][best]["time_to_target_s"]
        t_base = rep["methods"].get(BASELINE, {}).get("time_to_target_s")
        for entry in rep["methods"].values():
            entry["speedup_vs_best_baseline"] = speedup(t_best, entry["time_to_target_s"])
            entry["speedup_vs_baseline"] = speedup(t_base, entry["time_to_target_s"])


def combine(seeds: dict[str, dict]) -> dict[str, dict]:
    """Each method's figures as the mean over seeds, with a 95% interval where there are several
    (None when a seed has no figure: e.g. a method that never reached the target)."""
    out: dict[str, dict] = {}
    for method in common_methods(seeds):
        entry: dict[str, Any] = {}
        for fig in (*FIGURES, "global_accuracy_swing", *SPEEDUPS):
            values = [rep["methods"][method].get(fig) for rep in seeds.values()]
            if any(v is None for v in values):
                entry[fig], entry[f"{fig}_ci95"] = None, None
                continue
            entry[fig], entry[f"{fig}_ci95"] = mean_ci95([float(v) for v in values])
        entry["reached_target"] = sum(rep["methods"][method]["time_to_target_s"] is not None for rep in seeds.values())
        entry["per_seed"] = {s: rep["methods"][method]["personalized_accuracy_mean"] for s, rep in seeds.items()}
        out[method] = entry
    return out


def common_methods(seeds: dict[str, dict]) -> list[str]:
    """The methods every seed ran, in :data:`METHODS`' order."""
    return [m for m in METHODS if all(m in rep["methods"] for rep in seeds.values())]


def best_of(seeds: dict[str, dict], names: Sequence[str]) -> str | None:
    """Of ``names``, the method with the highest personalized mean over the seeds (None: none ran)."""
    ran = [m for m in common_methods(seeds) if m in names]
    means = {
        m: statistics.fmean(rep["methods"][m]["personalized_accuracy_mean"] or 0.0 for rep in seeds.values())
        for m in ran
    }
    return max(ran, key=means.__getitem__) if ran else None


def paired(seeds: dict[str, dict], method: str, baseline: str) -> dict[str, Any]:
    """``method`` minus ``baseline``, seed by seed: the mean difference of personalized mean and p10, with 95%
    intervals over the seeds (none from one seed)."""
    out: dict[str, Any] = {"method": method, "baseline": baseline}
    for fig, key in (("personalized_accuracy_mean", "mean_diff"), ("personalized_accuracy_p10", "p10_diff")):
        diffs = [rep["methods"][method][fig] - rep["methods"][baseline][fig] for rep in seeds.values()]
        mean, half = mean_ci95(diffs)
        out[key] = mean
        out[f"{key}_ci95_low"] = None if half is None else mean - half
        out[f"{key}_ci95_high"] = None if half is None else mean + half
        out[f"{key}_per_seed"] = dict(zip(seeds, diffs))
    return out


def alpha_report(seeds: dict[str, dict]) -> dict[str, Any]:
    """One Dirichlet beta's comparison: the best baseline, every method's figures against its target, and
    fleet's best method paired with it."""
    best = best_of(seeds, BASELINES) or BASELINE
    with_target(seeds, best)
    fleet_best = best_of(seeds, [m for m in METHODS if m not in BASELINES])
    return {
        "seeds": [rep["seed"] for rep in seeds.values()],
        "best_baseline": best,
        "best_fleet_method": fleet_best,
        "methods": combine(seeds),
        "paired_vs_best_baseline": paired(seeds, fleet_best, best) if fleet_best else None,
    }


def policy_choice(by_alpha: dict[str, dict]) -> dict[str, Any] | None:
    """fleet's method whose worst gap to the best method of any beta is smallest: the default a fleet whose data
    skew is unknown should run. None unless every beta ran the same fleet methods."""
    groups = list(by_alpha.values())
    names = [m for m in METHODS if m not in BASELINES and all(m in g["methods"] for g in groups)]
    if len(groups) < 2 or not names:
        return None
    gaps = {}
    for m in names:
        gaps[m] = {}
        for alpha, g in by_alpha.items():
            top = max(e["personalized_accuracy_mean"] or 0.0 for e in g["methods"].values())
            gaps[m][alpha] = (g["methods"][m]["personalized_accuracy_mean"] or 0.0) - top
    chosen = max(names, key=lambda m: min(gaps[m].values()))
    return {"gap_to_best_method": gaps, "chosen": chosen, "worst_gap": min(gaps[chosen].values())}


PRIMARY_ALPHA = "0.1"  # the beta the top-level figures are of (the most skewed: where personalization matters)


def build_report(config: str, per_seed: dict[str, dict], newcomers: dict[str, dict]) -> dict[str, Any]:
    """The bench's report from its seeds (of one batch or several combined): per beta, and the primary beta's
    figures at the top level as before."""
    alphas = sorted({f"{rep['alpha']:g}" for rep in per_seed.values()}, key=float)
    by_alpha = {a: alpha_report({k: rep for k, rep in per_seed.items() if f"{rep['alpha']:g}" == a}) for a in alphas}
    top = by_alpha.get(PRIMARY_ALPHA) or by_alpha[alphas[0]]
    return {
        "config": str(config),
        "profile": next(iter(per_seed.values())).get("profile"),  # whose seconds these are (every seed's in per_seed)
        "protocol": PROTOCOL,
        "seeds": list(per_seed),
        "comparison": PROTOCOL["horizon"],
        "personalized_accuracy_is": PROTOCOL["scored_after"],
        "target": PROTOCOL["target"],
        "target_fraction_of_baseline": None,  # the old key, kept: the target is no longer a fraction of FedAvg+FT's
        "best_baseline": top["best_baseline"],
        "paired_vs_best_baseline": top["paired_vs_best_baseline"],
        "methods": top["methods"],
        "by_alpha": by_alpha,
        "default_policy": policy_choice(by_alpha),
        "new_devices": combine_newcomers(newcomers),
        "new_devices_per_seed": newcomers,
        "new_devices_verdict": [newcomer_verdict(newcomers, f) for f in NEWCOMER_FIGURES],
        "per_seed": per_seed,
    }


def check_methods(methods: Sequence[str]) -> None:
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ConfigError(f"--methods: {unknown[0]!r} is not a method; use some of {', '.join(METHODS)}")


def bench_pfl(
    path: str = DEFAULT_CONFIG,
    overrides: dict[str, Any] | None = None,
    *,
    seeds: Sequence[int] | None = None,
    methods: Sequence[str] | None = None,
    finetune_steps: int = 10,
    newcomer_epochs: int = 5,
    newcomer_lr: float = NEWCOMER_LR,
    newcomer_orders: int = 1,
    quiet: bool = False,
    reuse: bool = False,
) -> dict[str, Any]:
    methods = list(methods or METHODS)
    check_methods(methods)
    if finetune_steps < 1:
        raise ConfigError(f"--finetune-steps: {finetune_steps} is not allowed; use an integer >= 1")
    log = progress_log(quiet)
    overrides = dict(overrides or {})
    base = load_fleet_config(path, overrides)
    per_seed, newcomers = {}, {}
    for seed in list(seeds or [base.train.seed]):
        summaries = run_seed(path, {**overrides, "train.seed": seed}, methods, finetune_steps, log, quiet, reuse)
        key = seed_tag(base.devices.alpha, seed)
        per_seed[key] = seed_figures(summaries, base.devices.alpha, seed)
        source = summaries[newcomer_source(summaries)]
        run = Path(source.run_dir)
        newcomers[key] = newcomer_figures(run, newcomer_epochs, log, newcomer_lr, orders=newcomer_orders)
    out = Path(base.output_dir) / f"{base.name}-a{base.devices.alpha:g}-pfl.json"
    return write_report(build_report(path, per_seed, newcomers), out)


def write_report(report: dict[str, Any], out: Path) -> dict[str, Any]:
    """The report as JSON at ``out``, with its plots beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    report["plots"] = [str(p) for p in plot_pfl(report, out.with_suffix(""))]
    out.write_text(json.dumps(report, indent=2))
    report["report"] = str(out)
    return report


def combine_reports(files: Sequence[str], out: str) -> dict[str, Any]:
    """Several batches' reports (``fleet bench pfl --json`` files) as one: their seeds pooled, every figure
    computed again. A seed run in two batches keeps the later file's."""
    per_seed: dict[str, dict] = {}
    newcomers: dict[str, dict] = {}
    config = None
    for f in files:
        try:
            report = json.loads(Path(f).read_text())
            per_seed.update(report["per_seed"])
            newcomers.update(report.get("new_devices_per_seed") or {})
            config = config or report["config"]
            if not all("alpha" in rep and "methods" in rep for rep in report["per_seed"].values()):
                raise KeyError("alpha")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"--combine: {f} is not a report of this bench ({type(exc).__name__}: {exc}); give the JSON files "
                "`fleet bench pfl` wrote"
            ) from None
    return write_report(build_report(config, per_seed, newcomers), Path(out))


def newcomers_from(
    runs: Sequence[str],
    epochs: int,
    lr: float = NEWCOMER_LR,
    overrides: dict[str, Any] | None = None,
    quiet: bool = False,
    orders: int = 1,
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
        per_run[i] = newcomer_figures(path, epochs, log, lr, overrides, orders)
        if not per_run[i]:
            raise ConfigError(
                f"--newcomers-from: {run} ran with devices.newcomers 0, so it has no new devices to personalize; "
                "give a run made with newcomers"
            )
    report = {
        "runs": [str(r) for r in runs],
        "newcomer_lr": lr,
        "overrides": dict(overrides or {}),
        "batch_orders": orders,
    }
    report["new_devices"] = combine_newcomers(per_run)
    report["new_devices_per_run"] = per_run  # keyed by the run's place in ``runs``, as the verdict's seeds are
    report["new_devices_verdict"] = [newcomer_verdict(per_run, f) for f in NEWCOMER_FIGURES]
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
            "final_distribution_accuracy": _mean([s[m].get("final_distribution_accuracy") for s in seeds]),
            "device_time_s": statistics.fmean(s[m]["device_time_s"] for s in seeds),
            "time_vs_full": _mean([s[m]["time_vs_full"] for s in seeds]),
            "batch_orders": min(s[m].get("batch_orders", 1) for s in seeds),  # the fewest a seed ran; older: one
            "curve": mean_curve([s[m]["curve"] for s in seeds]),  # epoch by epoch; older reports lack a key
        }
        for m in seeds[0]
    }


ELASTIC_RIVALS = ("full", "tl", "bn_bias", "elastic")  # the methods the new-device claim compares
NEWCOMER_FIGURES = ("final_accuracy", "final_distribution_accuracy")  # held-out split; the device's distribution


def newcomer_verdict(per_seed: dict[str, dict], figure: str = "final_accuracy") -> dict[str, Any] | None:
    """ElasticTrainer's claim on the new devices, by ``figure`` (``final_accuracy`` or
    ``final_distribution_accuracy``): elastic against full training on average, and the seeds on which
    it ends above both tl and bn_bias."""
    seeds = {
        k: s for k, s in per_seed.items() if s and all(s.get(m, {}).get(figure) is not None for m in ELASTIC_RIVALS)
    }
    if not seeds:
        return None
    above = [k for k, s in seeds.items() if all(s["elastic"][figure] > s[m][figure] for m in ("tl", "bn_bias"))]
    return {
        "figure": figure,
        "elastic_vs_full_points": 100
        * statistics.fmean(s["elastic"][figure] - s["full"][figure] for s in seeds.values()),
        "elastic_time_vs_full": _mean([s["elastic"]["time_vs_full"] for s in seeds.values()]),
        "seeds_above_tl_and_bn_bias": above,
        "seeds": sorted(seeds),
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
    colors = plt.get_cmap("tab20").colors
    for i, (method, entry) in enumerate(first["methods"].items()):
        curve = [RoundRecord.from_json(point) for point in entry["curve"]]
        ax.plot(
            [p.sim_time_s for p in curve],
            [100 * (p.global_accuracy or 0.0) for p in curve],
            marker=".",
            ls="--" if method in BASELINES else "-",  # baselines dashed, fleet's methods solid
            color=colors[i % len(colors)],
            label=method,
        )
    ax.axhline(100 * first["target_accuracy"], color="grey", ls=":", lw=1, label="target")
    ax.set(
        xlabel="simulated time (s)",
        ylabel="personalized accuracy (%)",
        title="personalized accuracy, " + next(iter(report["per_seed"])),
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4))
    names = common_methods(report["per_seed"])  # a batch may have run more methods than another
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
    if new_devices:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def pct(v: float | None, ci: float | None = None) -> str:
    return "n/a" if v is None else f"{100 * v:.2f}%" + (f" ±{100 * ci:.2f}" if ci else "")


def pfl_table(report: dict) -> str:
    """Per beta: every method's figures, the best baseline, and fleet's best method paired with it."""
    lines = [f"{report['comparison']}; target: {report['target']}"]
    for alpha, group in report["by_alpha"].items():
        lines.append(f"Dirichlet {alpha}, seeds {group['seeds']}; best baseline {group['best_baseline']}")
        lines.append(
            f"{'method':>17} {'pers mean':>16} {'pers p10':>16} {'reached':>7} {'to target s':>11} "
            f"{'vs best':>8} {'MB up':>9} {'swing':>6}"
        )
        for m, r in group["methods"].items():
            t, sp, swing = r["time_to_target_s"], r["speedup_vs_best_baseline"], r["global_accuracy_swing"]
            lines.append(
                f"{m:>17} {pct(r['personalized_accuracy_mean'], r['personalized_accuracy_mean_ci95']):>16} "
                f"{pct(r['personalized_accuracy_p10'], r['personalized_accuracy_p10_ci95']):>16} "
                f"{r['reached_target']:>3}/{len(group['seeds']):<3} {'n/a' if t is None else f'{t:.1f}':>11} "
                f"{'n/a' if sp is None else f'{sp:.2f}x':>8} {(r['bytes_uploaded'] or 0) / 1e6:>9.1f} "
                f"{'n/a' if swing is None else f'{100 * swing:.2f}':>6}"
            )
        pair = group["paired_vs_best_baseline"]
        if pair:
            low = pair["mean_diff_ci95_low"]
            lines.append(
                f"  {pair['method']} - {pair['baseline']}: mean {100 * pair['mean_diff']:+.2f} points"
                + ("" if low is None else f" (95% interval from {100 * low:+.2f})")
                + f", p10 {100 * pair['p10_diff']:+.2f}"
            )
    choice = report.get("default_policy")
    if choice:
        lines.append(f"default policy over the betas: {choice['chosen']} (worst gap {100 * choice['worst_gap']:+.2f})")
    if report["new_devices"]:
        lines.append(newcomers_table(report["new_devices"]))
    for v in report.get("new_devices_verdict") or []:
        if v:
            lines.append(
                f"elastic by {v['figure']}: {v['elastic_vs_full_points']:+.2f} points from full; above tl and bn_bias"
                f" on {len(v['seeds_above_tl_and_bn_bias'])} of {len(v['seeds'])} seeds"
            )
    return "\n".join(lines)


def newcomers_table(new_devices: dict) -> str:
    lines = ["new devices, personalizing from fleet's final global model (mean over them and the seeds):"]
    for m, r in new_devices.items():
        ratio = r["time_vs_full"]
        dist = r.get("final_distribution_accuracy")
        lines.append(
            f"{m:>17} {100 * r['final_accuracy']:>8.2f}% in {r['device_time_s']:.1f}s of device time"
            + ("" if ratio is None else f" ({ratio:.2f}x full's)")
            + ("" if dist is None else f"; {100 * dist:.2f}% on its distribution")
        )
    return "\n".join(lines)

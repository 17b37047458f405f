"""``fleet bench robustness``: how far 1, then 2, adversarial devices move an 8-device fleet.

One clean run, then one run per attack (:data:`fleet.bench.attack_names.ATTACKS`) and number
of adversaries. Adversaries are the first partitions (0, then 0 and 1), so every count adds one
device to the previous set. Every run shares the seed, the partitions, one measured profile and
one pretrained start (made once in ``<output_dir>/<name>-shared``, as ``fleet bench fleet`` does), so
the only difference between a run and the clean one is what the adversaries send.

Each simulation runs in its own process group with a timeout (:func:`fleet.bench.launch.launch`): an attack that
crashes or hangs the server is a finding (``server_crashed``), not the end of the bench.

Figures per run: ``final_accuracy`` is the mean global accuracy of the last 3 rounds, over the
devices that are honest in every run (the same test sets judge every run, whether or not an
attack's evaluation replies were rejected); ``rejected_replies`` the replies the server rejected
over the run, ``honest_rejected`` those of them from honest devices, ``honest_tensors_left_out`` the
tensors left out of honest replies for their own sign skew, ``rounds`` the rounds done.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fleet.base.errors import ConfigError
from fleet.bench.adversary_app import ATTACK_FILE, ATTACKS, EDGE_DIR
from fleet.bench.attack_names import ADAPTIVE
from fleet.bench.attacks import FIXED_STRENGTH, triggered_test
from fleet.bench.launch import HONEST_APP, Log, launch, progress_log, shared_start
from fleet.engine.config import NULL
from fleet.engine.experiment import model_with_weights
from fleet.engine.trainer import accuracy
from fleet.federated.launch.prepare import prepare
from fleet.federated.on_server.server_eval import server_test_set
from fleet.federated.on_server.state import load_checkpoint
from fleet.federated.on_server.tracking import honest_rejections, honest_tensors_left_out, read_records
from fleet.federated.shared.config import FleetConfig, load_fleet_config, run_dir
from fleet.federated.shared.names import DEVICES_DIR, simulated_names
from fleet.federated.shared.round_record import RoundRecord
from fleet.federated.shared.run_summary import SUMMARY_FILE

DEFAULT_CONFIG = "simulations/robustness.yaml"
REPORT_FILE = "robustness.json"
EDGE_REPORT_FILE = "robustness-edge.json"  # --adaptive's report: beside the fixed-strength one, not over it
ADVERSARY_APP = "fleet.bench.adversary_app:app"


def _finite(value: Any) -> float | None:
    """A number JSON can hold (NaN and infinities are not JSON), else None."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


FINAL_ROUNDS = 3  # final accuracy: the mean of this many last rounds (one round's accuracy moves by points)


def honest_accuracy(record: RoundRecord, honest_from: int) -> float | None:
    """A round's global accuracy over the devices that are honest in every run of the bench
    (partitions >= ``honest_from``), weighted by their test samples: the same devices judge every run,
    whether or not an attack's evaluation replies were rejected."""
    rows = [
        d
        for d in record.devices
        if (d.partition_id if d.partition_id is not None else -1) >= honest_from
        and _finite(d.global_accuracy) is not None
    ]
    total = sum(d.test_examples or 0 for d in rows)
    return sum(d.global_accuracy * (d.test_examples or 0) for d in rows) / total if total else None


def _mean(values: list[float]) -> float | None:
    return _finite(sum(values) / len(values)) if values else None


def run_figures(out: Path, error: str | None, honest_from: int, adversaries: list[str]) -> dict[str, Any]:
    """A run's figures from the rounds it wrote; a run without its summary.json crashed. ``adversaries``: the
    attacking devices' names (a rejection of any other is an honest device's)."""
    records = read_records(out)  # a line cut short by a crash ends them
    server = [a for a in (_finite(r.server_accuracy) for r in records) if a is not None][-FINAL_ROUNDS:]
    honest = [a for a in (honest_accuracy(r, honest_from) for r in records) if a is not None][-FINAL_ROUNDS:]
    crashed = error is not None or not (out / SUMMARY_FILE).is_file()
    figures = {
        "final_accuracy": _mean(server),
        "honest_device_accuracy": _mean(honest),
        "rejected_replies": sum(len(r.rejections) for r in records),
        "honest_rejected": honest_rejections(records, adversaries),
        "honest_tensors_left_out": honest_tensors_left_out(records, adversaries),
        "server_crashed": crashed,
        "rounds": len(records),
    }
    if crashed:
        figures["error"] = error or f"no {SUMMARY_FILE} in {out}"
    return figures


def backdoor_success(cfg: FleetConfig, out: Path) -> float | None:
    """The share of the server's triggered test images (none of the target class) that the run's last
    global model labels as the backdoor's target; None without a checkpoint."""
    loaded = load_checkpoint(out)
    if loaded is None:
        return None
    model = model_with_weights(cfg.model, loaded[0])
    size = cfg.data.input_size
    return accuracy(model, triggered_test(server_test_set(cfg), size), size)


def run_one(
    path: str,
    overrides: dict[str, Any],
    attack: str | None,
    partitions: list[int],
    *,
    timeout_s: float,
    log: Log,
    honest_from: int = 2,
    adaptive: bool = False,
) -> dict[str, Any]:
    """One simulation: clean (``attack`` None, the real ClientApp) or with ``partitions`` adversarial;
    its accuracy judged on partitions >= ``honest_from``. ``adaptive``: the attack at the edge of the
    checks (:mod:`fleet.bench.edge`), the strength each round found reported."""
    name = load_fleet_config(path, overrides).name
    mode, at_edge = ("-edge", " at the edge") if adaptive else ("", "")
    run_name = f"{name}-clean" if attack is None else f"{name}-{attack}{mode}-{len(partitions)}"
    cfg, config_path = prepare(load_fleet_config(path, {**overrides, "name": run_name}), resume=False, log=log)
    out = run_dir(cfg)
    (out / SUMMARY_FILE).unlink(missing_ok=True)  # only this launch's summary may count
    (out / ATTACK_FILE).unlink(missing_ok=True)
    shutil.rmtree(out / EDGE_DIR, ignore_errors=True)
    if attack is not None:
        spec = {"attack": attack, "partitions": partitions, **({"adaptive": True} if adaptive else {})}
        (out / ATTACK_FILE).write_text(json.dumps(spec))
    who = "clean" if attack is None else f"{attack}{at_edge}, adversarial partitions {partitions}"
    log(f"--- {run_name}: {who}; {cfg.federation.rounds} rounds on {cfg.devices.num_devices} devices ---")
    error = launch(config_path, HONEST_APP if attack is None else ADVERSARY_APP, timeout_s, log)
    entry: dict[str, Any] = {"attack": attack, "adversaries": len(partitions), "partitions": partitions}
    names = {pid: name for name, pid in simulated_names(cfg).items()}
    entry.update(run_figures(out, error, honest_from, [names[p] for p in partitions]))
    if adaptive:
        entry["edge_strengths"] = edge_strengths(out)
    if attack in (None, "backdoor"):  # the clean model's rate is the baseline a backdoor is measured against
        entry["backdoor_success"] = backdoor_success(cfg, out)
    shutil.rmtree(out / DEVICES_DIR, ignore_errors=True)  # 8 devices' weights and momentum: ~0.7 GB a run, unused
    entry["run_dir"] = str(out)
    acc = entry["final_accuracy"]
    log(
        f"--- {run_name}: final accuracy {'n/a' if acc is None else f'{100 * acc:.2f}%'}, "
        f"{entry['rejected_replies']} rejected" + (f", SERVER CRASHED ({entry['error']})" if entry.get("error") else "")
    )
    return entry


def edge_strengths(out: Path) -> dict[str, float]:
    """Per round, the strength the first adversary found at the edge of the checks (its colluders search the
    same replies and find the same)."""
    notes = [json.loads(f.read_text()) for f in sorted((out / EDGE_DIR).glob("*.json"))]
    first = min((n["partition"] for n in notes), default=None)
    rows = sorted((n["round"], n["strength"]) for n in notes if n["partition"] == first)
    return {str(r): s for r, s in rows}


def check_choices(attacks: Sequence[str], adversaries: Sequence[int], num_devices: int, adaptive: bool = False) -> None:
    """One-line errors for an unknown attack (in adaptive mode: one without a strength to search) or an
    adversary count the fleet cannot hold."""
    for attack in attacks:
        if attack not in ATTACKS:
            raise ConfigError(f"--attacks: {attack!r} is not an attack; use some of {', '.join(ATTACKS)}")
        if adaptive and attack not in FIXED_STRENGTH:
            raise ConfigError(
                f"--attacks: {attack!r} has no strength to search in --adaptive mode; use some of {', '.join(ADAPTIVE)}"
            )
    for k in adversaries:
        if not 1 <= k < num_devices:
            raise ConfigError(
                f"--adversaries: {k} is not allowed; use counts in [1, {num_devices - 1}] "
                f"(the fleet has {num_devices} devices and needs an honest one)"
            )


def started(path: str, overrides: dict[str, Any], log: Log, fresh: bool = False) -> dict[str, Any]:
    """The overrides every run of one seed shares: one measured profile and one pretrained start, and
    the server's balanced test set (the final accuracy). ``fresh``: a new start for another seed (the
    start of ``overrides`` is dropped, its profile kept)."""
    if fresh:  # the same measured profile (the same machine and model), a start pretrained with this seed
        overrides = {k: v for k, v in overrides.items() if k != "model.weights"}
    shared = shared_start(path, overrides, log)
    common = {**overrides, "hardware.profile": shared.hardware.profile, "model.weights": shared.model.weights}
    common["evaluation.server_test"] = True
    return common


# every defense off: the masked mean of docs/algorithms.md, what the defenses' cost is measured against
PLAIN_MEAN = {
    "robust.aggregation": "mean",
    "robust.norm_bound": NULL,
    "robust.min_pull": NULL,
    "robust.min_cos": NULL,
    "robust.max_sign_skew": NULL,
    "robust.norm_growth": NULL,
    "robust.similarity": False,
}


def clean_cost(
    path: str, common: dict[str, Any], clean: dict[str, Any], seeds: Sequence[int], timeout_s: float, log: Log
) -> dict[str, Any]:
    """Per seed, the clean fleet's final accuracy with the config's defenses and with the plain masked
    mean, from the same start. ``common`` and ``clean``: the bench's own start and clean run, reused
    for its seed."""
    base = load_fleet_config(path, common)
    rows = []
    for seed in seeds:
        own = seed == base.train.seed
        name = base.name if own else f"{base.name}-s{seed}"
        start = common if own else started(path, {**common, "train.seed": seed, "name": name}, log, fresh=True)
        defended = clean if own else run_one(path, start, None, [], timeout_s=timeout_s, log=log)
        plain = run_one(path, {**start, **PLAIN_MEAN, "name": f"{name}-plain"}, None, [], timeout_s=timeout_s, log=log)
        d, p = defended["final_accuracy"], plain["final_accuracy"]
        rows.append({"seed": seed, "defenses": d, "plain_mean": p, "cost": None if None in (d, p) else p - d})
    costs = [r["cost"] for r in rows if r["cost"] is not None]
    return {"seeds": rows, "mean_cost": _mean(costs), "cost_is": "plain mean's final accuracy less the defenses'"}


def bench_robustness(
    path: str = DEFAULT_CONFIG,
    overrides: dict[str, Any] | None = None,
    *,
    attacks: Sequence[str] = ATTACKS,
    adversaries: Sequence[int] = (1, 2),
    timeout_s: float = 1800.0,
    quiet: bool = False,
    cost_seeds: Sequence[int] = (),
    adaptive: bool = False,
) -> dict[str, Any]:
    """The clean run, then every attack with each number of adversaries, then (``cost_seeds``) what
    the defenses cost a clean fleet; the report is also written to ``<output_dir>/robustness.json``
    after every run, so a killed bench keeps what it measured. ``adaptive``: each attack at the largest
    strength the server's defense accepts, searched every round (:mod:`fleet.bench.edge`)."""
    base = load_fleet_config(path, overrides or {})
    check_choices(attacks, adversaries, base.devices.num_devices, adaptive)
    log = progress_log(quiet)
    common = started(path, dict(overrides or {}), log)
    fed = base.federation
    report: dict[str, Any] = {
        "config": str(path),
        "devices": base.devices.num_devices,
        "rounds": fed.rounds,
        "strategy": fed.strategy,
        "aggregation": base.robust.aggregation,
        "adaptive": adaptive,
        "defenses": dataclasses.asdict(base.robust),  # the robust section as it is, every field
        "final_accuracy_is": f"mean over the last {FINAL_ROUNDS} rounds of the global model's accuracy on the "
        f"server's test set ({base.data.test_per_class} per class, evaluation.server_test)",
        "honest_device_accuracy_is": f"the same mean of the global accuracy on the test splits of the devices "
        f"honest in every run (partitions >= {max(adversaries)})",
        "clean_final_accuracy": None,
        "clean": None,
        "attacks": [],
    }
    out = Path(base.output_dir).expanduser().resolve() / (EDGE_REPORT_FILE if adaptive else REPORT_FILE)
    out.parent.mkdir(parents=True, exist_ok=True)
    honest = max(adversaries)
    report["clean"] = run_one(path, common, None, [], timeout_s=timeout_s, log=log, honest_from=honest)
    report["clean_final_accuracy"] = report["clean"]["final_accuracy"]
    report["clean_backdoor_success"] = report["clean"]["backdoor_success"]
    out.write_text(json.dumps(report, indent=2))
    for attack in attacks:
        for k in adversaries:
            partitions = list(range(k))
            entry = run_one(
                path, common, attack, partitions, timeout_s=timeout_s, log=log, honest_from=honest, adaptive=adaptive
            )
            report["attacks"].append(entry)
            out.write_text(json.dumps(report, indent=2))
    if cost_seeds:
        report["clean_cost"] = clean_cost(path, common, report["clean"], cost_seeds, timeout_s, log)
    report["report"] = str(out)
    out.write_text(json.dumps(report, indent=2))
    return report


def robustness_table(report: dict[str, Any]) -> str:
    """The report as a table: each attack's final accuracy against the clean run's."""

    def pct(v: float | None) -> str:
        return f"{100 * v:7.2f}%" if v is not None else "     n/a"

    clean = report["clean_final_accuracy"]
    lines = [
        f"{report['devices']} devices, {report['rounds']} rounds, {report['strategy']}, "
        f"aggregation {report['aggregation']}; clean final accuracy {pct(clean).strip()}, "
        f"backdoor success of the clean model {pct(report.get('clean_backdoor_success')).strip()}",
        f"{'attack':>17} {'adv':>3} {'final':>8} {'vs clean':>9} {'rejected':>8} {'rounds':>6} {'backdoor':>8} "
        f"{'strength':>8}  server",
    ]
    for e in report["attacks"]:
        acc = e["final_accuracy"]
        gap = f"{100 * (acc - clean):+8.2f}" if acc is not None and clean is not None else "     n/a"
        backdoor = pct(e["backdoor_success"]) if "backdoor_success" in e else "       -"
        lines.append(
            f"{e['attack']:>17} {e['adversaries']:>3} {pct(acc)} {gap:>9} {e['rejected_replies']:>8} "
            f"{e['rounds']:>6} {backdoor:>8} {median_strength(e):>8}  "
            f"{'CRASHED: ' + e['error'] if e['server_crashed'] else 'ok'}"
        )
    cost = report.get("clean_cost")
    if cost:
        per_seed = ", ".join(
            f"seed {r['seed']} {pct(r['defenses']).strip()} vs {pct(r['plain_mean']).strip()}" for r in cost["seeds"]
        )
        mean = "n/a" if cost["mean_cost"] is None else f"{100 * cost['mean_cost']:+.2f}"
        lines.append(f"clean cost (plain mean - defenses): {mean} points ({per_seed})")
    lines.append(f"report: {report.get('report', '')}")
    return "\n".join(lines)


def median_strength(entry: dict[str, Any]) -> str:
    """An adaptive run's median strength over the rounds it searched ("-" at fixed strength)."""
    found = list(entry.get("edge_strengths", {}).values())
    return f"{statistics.median(found):.3g}" if found else "-"

"""``fleet bench fleet``: FedAvg (full training) vs naive per-device ElasticTrainer vs fleet.

Same seeds, partitions, device profile and pretrained start for every method:
the profile and checkpoint are made once and passed to all three runs. Each
method runs as its own ``fleet simulate`` process (a fresh Ray per run).
Time to target is simulated time until the global accuracy first reaches
``target_fraction`` of FedAvg's final accuracy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from fleet.errors import FleetError
from server.config import load_fleet_config, run_dir
from server.simulation import prepare

METHODS = ("fedavg", "naive", "fleet")


def time_to_target(history: list[dict], target: float) -> float | None:
    for rec in history:
        if rec["global_accuracy"] is not None and rec["global_accuracy"] >= target:
            return rec["sim_time_s"]
    return None


def _simulate(config_path: Path, quiet: bool) -> None:
    cmd = [sys.executable, "-c", "import sys; from fleet.cli import main; sys.exit(main())", "simulate", str(config_path)]
    res = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else None, stderr=subprocess.STDOUT if quiet else None, text=True, env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    if res.returncode != 0:
        tail = (res.stdout or "")[-1500:] if quiet else ""
        raise FleetError(f"the {config_path.name} simulation failed (exit {res.returncode}){': ' + tail if tail else ''}")


def bench_fleet(path: str, overrides: dict[str, Any] | None = None, *, target_fraction: float = 0.95, quiet: bool = False) -> dict:
    base = load_fleet_config(path, overrides)
    log = (lambda s: print(s, file=sys.stderr)) if quiet else print
    # One profile and one pretrained checkpoint, shared by every method.
    shared, _ = prepare(load_fleet_config(path, {**(overrides or {}), "name": f"{base.name}-shared"}), resume=False, log=log)
    results: dict[str, dict] = {}
    for method in METHODS:
        name = f"{base.name}-{method}"
        cfg = load_fleet_config(path, {**(overrides or {}), "name": name, "federation.strategy": method,
                                       "train.profile": shared.train.profile, "model.weights": shared.model.weights})
        cfg, config_path = prepare(cfg, resume=False, log=log)
        log(f"--- {method}: {cfg.federation.rounds} rounds on {cfg.federation.num_devices} devices ---")
        _simulate(config_path, quiet)
        out = run_dir(cfg)
        summary = json.loads((out / "summary.json").read_text())
        results[method] = {**summary, "history": summary["history"]}
    fedavg_final = results["fedavg"]["final_accuracy"]
    target = target_fraction * fedavg_final
    report: dict[str, Any] = {"target_accuracy": target, "target_fraction_of_fedavg_final": target_fraction,
                              "config": str(path), "devices": base.federation.num_devices, "tiers": base.federation.tiers,
                              "rounds": base.federation.rounds, "methods": {}}
    for method, s in results.items():
        report["methods"][method] = {
            "time_to_target_s": time_to_target(s["history"], target),
            "final_accuracy": s["final_accuracy"],
            "personalized_accuracy_mean": s["personalized_accuracy_mean"],
            "personalized_accuracy_p10": s["personalized_accuracy_p10"],
            "bytes_uploaded": s["bytes_uploaded"],
            "sim_time_s": s["sim_time_s"],
            "mean_round_time_s": s["sim_time_s"] / max(s["rounds"], 1),
            "run_dir": s["run_dir"],
        }
    f, e = report["methods"]["fedavg"]["time_to_target_s"], report["methods"]["fleet"]["time_to_target_s"]
    report["methods"]["fleet"]["speedup_vs_fedavg"] = (f / e) if f and e else None
    n = report["methods"]["naive"]["time_to_target_s"]
    report["methods"]["naive"]["speedup_vs_fedavg"] = (f / n) if f and n else None
    out = Path(base.output_dir) / f"{base.name}-bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report


def bench_table(report: dict) -> str:
    def pct(v):
        return f"{100 * v:6.2f}%" if v is not None else "   n/a "

    def sec(v):
        return f"{v:9.1f}" if v is not None else "      n/a"

    lines = [f"target accuracy {pct(report['target_accuracy'])} ({report['target_fraction_of_fedavg_final']:.0%} of FedAvg's final)",
             f"{'method':>8} {'to target s':>11} {'final':>8} {'pers mean':>9} {'pers p10':>9} {'MB up':>8} {'speedup':>8}"]
    for m, r in report["methods"].items():
        sp = r.get("speedup_vs_fedavg")
        lines.append(f"{m:>8} {sec(r['time_to_target_s']):>11} {pct(r['final_accuracy'])} {pct(r['personalized_accuracy_mean']):>9} "
                     f"{pct(r['personalized_accuracy_p10']):>9} {r['bytes_uploaded'] / 1e6:8.1f} {('%.2fx' % sp) if sp else '   -':>8}")
    return "\n".join(lines)

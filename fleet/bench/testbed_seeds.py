"""``fleet bench testbed --combine``: several runs of the testbed bench (a seed and a config each, run in
batches because one takes up to ~45 minutes) as one report, per config (simulations/testbed.yaml's upload
regime, testbed-compute.yaml's compute regime).

Each seed's figures are paired: fleet against FedAvg on the same devices, the same start and the same
budget. Per config the report gives each seed's pair and, over the seeds, the median speedup and the range
of the accuracy differences (two seeds have no interval worth the name; the range says as much).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from fleet.base.errors import ConfigError


def seed_entry(report: dict) -> dict:
    """One run's pair: fleet's speedup, and its final and mean accuracy less FedAvg's (points as fractions)."""
    fedavg, fleet = report["methods"]["fedavg"], report["methods"]["fleet"]

    def diff(key: str) -> float | None:
        return None if None in (fleet[key], fedavg[key]) else fleet[key] - fedavg[key]

    return {
        "speedup_vs_fedavg": report["fleet"]["speedup_vs_fedavg"],
        "final_minus_fedavg": diff("final_server_accuracy"),
        "mean_accuracy_minus_fedavg": diff("mean_accuracy"),
        "compute_to_transfer": report["compute_to_transfer"],
        "overhead_share": report.get("overhead_share"),  # None in a report made before the bench measured it
        "regime": report["regime"],
        "targets": report["targets"],
    }


def _spread(values: list[float | None]) -> dict | None:
    known = [v for v in values if v is not None]
    if not known:
        return None
    return {"median": statistics.median(known), "min": min(known), "max": max(known), "n": len(known)}


def combine(reports: Sequence[dict]) -> dict:
    """Per config, per seed, the paired figures; over seeds, their medians and ranges. A seed run twice with
    a config keeps the later report's."""
    configs: dict[str, dict[str, dict]] = {}
    for report in reports:
        configs.setdefault(report["config"], {})[str(report["seed"])] = seed_entry(report)
    out = {}
    for config, seeds in sorted(configs.items()):
        rows = list(seeds.values())
        out[config] = {
            "regimes": sorted({r["regime"] for r in rows}),
            "seeds": seeds,
            "speedup_vs_fedavg": _spread([r["speedup_vs_fedavg"] for r in rows]),
            "final_minus_fedavg": _spread([r["final_minus_fedavg"] for r in rows]),
            "mean_accuracy_minus_fedavg": _spread([r["mean_accuracy_minus_fedavg"] for r in rows]),
            "overhead_share": _spread([r["overhead_share"] for r in rows]),
        }
    return out


def read_reports(files: Sequence[str]) -> list[dict]:
    """The bench's JSON reports, each checked for what :func:`combine` reads; a one-line error otherwise."""
    reports = []
    for f in files:
        try:
            report = json.loads(Path(f).read_text())
            seed_entry(report)
            report["config"], report["seed"]  # noqa: B018 (checked: combine reads them)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"--combine: {f} is not a report of this bench ({type(exc).__name__}: {exc}); give the JSON "
                "files `fleet bench testbed` wrote"
            ) from None
        reports.append(report)
    return reports


def _range(s: dict | None, scale: float, unit: str) -> str:
    if s is None:
        return "n/a"
    return f"{scale * s['median']:+.2f}{unit} ({scale * s['min']:+.2f} to {scale * s['max']:+.2f}, {s['n']} seeds)"


def _times(speedup: float | None) -> str:
    return "not reached" if speedup is None else f"{speedup:.2f}x"


def combined_table(combined: dict) -> str:
    """A line per config: the median speedup over seeds, the final and mean accuracy differences' ranges."""
    lines = []
    for config, r in combined.items():
        speed = r["speedup_vs_fedavg"]
        per_seed = ", ".join(f"seed {s} {_times(e['speedup_vs_fedavg'])}" for s, e in sorted(r["seeds"].items()))
        lines += [
            f"{config} ({' and '.join(r['regimes'])} regime): fleet reaches the target "
            f"{_times(speed and speed['median'])} sooner than FedAvg (median; {per_seed})",
            f"  final accuracy less FedAvg's {_range(r['final_minus_fedavg'], 100, ' points')}",
            f"  mean accuracy over the budget less FedAvg's {_range(r['mean_accuracy_minus_fedavg'], 100, ' points')}",
            f"  the slowest class's round neither compute nor transfer {_range(r['overhead_share'], 100, '%')}",
        ]
    return "\n".join(lines)

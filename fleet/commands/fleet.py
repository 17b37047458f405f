"""``fleet simulate CONFIG.yaml`` and ``fleet bench fleet``: the fleet over Flower on one machine."""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleet.federated.shared.run_summary import RunSummary

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # devices have no internet; flwr reads this on import

DEFAULT_CONFIG = "simulations/fleet.yaml"
BENCH_CONFIG = "simulations/fleet-bench.yaml"


def _overrides(args: argparse.Namespace) -> dict:
    from fleet.engine.config import parse_override

    overrides = dict(parse_override(s) for s in args.set)
    for flag, path in (
        ("name", "name"),
        ("rounds", "federation.rounds"),
        ("strategy", "federation.strategy"),
        ("output_dir", "output_dir"),
        ("ray_address", "simulation.ray_address"),
        ("runtime", "testbed.runtime"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            overrides[path] = value
    return overrides


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="run the fleet on this machine with Flower's simulation engine")
    p.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help=f"fleet YAML (default: {DEFAULT_CONFIG})")
    p.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="override a field, e.g. federation.rounds=5"
    )
    p.add_argument("--name")
    p.add_argument("--output-dir")
    p.add_argument("--rounds", type=int)
    p.add_argument("--strategy", help="fleet, naive, fedavg or ditto")
    p.add_argument("--resume", action="store_true", help="continue from runs/<name>/checkpoint.pt")
    p.add_argument(
        "--ray-address",
        metavar="HOST:PORT",
        help="run on this existing Ray cluster (`ray start --head` prints the address); default: a local Ray",
    )
    p.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="also show Flower's and Ray's log on the terminal (always written to runs/<name>/flower.log)",
    )
    p.set_defaults(func=run_simulate)


def register_bench(sub: argparse._SubParsersAction) -> None:
    from fleet.bench.regimes import add_profile_flags

    p = sub.add_parser("fleet", help="FedAvg vs naive ElasticTrainer vs fleet on 8 devices in 4 speed tiers")
    p.add_argument("--config", default=BENCH_CONFIG, help=f"fleet YAML (default: {BENCH_CONFIG})")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--rounds", type=int, help="FedAvg's rounds; they set the simulated-time horizon of every method")
    p.add_argument("--output-dir")
    p.add_argument("--target", type=float, default=0.95, help="target = this fraction of FedAvg's final accuracy")
    p.add_argument("--seeds", type=int, nargs="+", help="run every method once per seed (default: train.seed)")
    p.add_argument("--final-rounds", type=int, default=3, help="final accuracy = mean of this many last rounds")
    p.add_argument(
        "--reuse",
        nargs="+",
        default=[],
        metavar="METHOD",
        help="take these methods' figures from their finished runs (made with the same config) instead of "
        "running them again, e.g. after changing only fleet: --reuse fedavg naive",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_profile_flags(p)
    p.set_defaults(func=run_bench)


def summary_table(summary: RunSummary) -> str:
    lines = [
        f"{summary.name} ({summary.strategy}): {summary.rounds} rounds, simulated {summary.sim_time_s:.1f}s",
        f"  global accuracy {100 * (summary.final_accuracy or 0):.2f}%   personalized mean "
        f"{100 * (summary.personalized_accuracy_mean or 0):.2f}%  p10 "
        f"{100 * (summary.personalized_accuracy_p10 or 0):.2f}%"
        + (
            f"   fine-tuned mean {100 * summary.finetuned_accuracy_mean:.2f}%"
            if summary.finetuned_accuracy_mean is not None
            else ""
        )
        + f"   uploaded {summary.bytes_uploaded / 1e6:.1f} MB   rejected replies {summary.rejections}",
        f"  {'device':>10} {'class':>11} {'tier':>5} {'rounds':>6} {'rho':>6} {'compute':>8} {'round':>7} "
        f"{'trained':>8} {'MB up':>8}",
    ]
    for name, d in summary.devices.items():
        lines.append(
            f"  {name:>10} {d.device_class or '-':>11} {d.tier or 0:>4g}x {d.rounds_trained:>6} {d.rho_mean:>6.2f} "
            f"{d.speedup_mean:>7.2f}x {d.round_speedup_mean:>6.2f}x "
            f"{100 * d.trained_fraction_mean:>7.1f}% {d.bytes_uploaded / 1e6:>8.1f}"
        )
    lines.append("  speedup over training fully: compute alone, and the whole round with the upload")
    lines.append(f"  metrics, summary, plots and Flower's log (flower.log): {summary.run_dir}")
    return "\n".join(lines)


def run_simulate(args: argparse.Namespace) -> int:
    from fleet.base.errors import FleetError
    from fleet.commands.simulation import simulate

    summary = simulate(args.config, _overrides(args), resume=args.resume, verbose=args.verbose)
    print(summary_table(summary))
    empty = summary.rounds_without_training
    if empty:
        raise FleetError(
            f"{len(empty)} of {summary.rounds} rounds ended with no accepted training reply (rounds {empty}; "
            f"first rejection: {summary.first_rejection or 'no device replied'}); fix what the rejections "
            "name, e.g. fewer devices than samples (devices.num_devices, samples_per_device)"
        )
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from fleet.bench.fleet import bench_fleet
    from fleet.bench.regimes import profile_overrides

    result = bench_fleet(
        args.config,
        {**_overrides(args), **profile_overrides(args.profile, args.regime)},
        target_fraction=args.target,
        quiet=args.json,
        seeds=args.seeds,
        final_rounds=args.final_rounds,
        reuse=tuple(args.reuse),
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        from fleet.bench.fleet import bench_table

        print(bench_table(result))
    return 0

"""``fleet bench robustness``: the fleet with adversarial devices, one attack at a time."""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # devices have no internet; flwr reads this on import

DEFAULT_CONFIG = "simulations/robustness.yaml"


def register_bench(sub: argparse._SubParsersAction) -> None:
    from fleet.bench.attack_names import ADAPTIVE, ATTACKS  # the help lists exactly what the bench runs
    from fleet.federated.shared.robust_choices import AGGREGATIONS  # no torch: devices build this parser

    p = sub.add_parser(
        "robustness", help="final accuracy and rejections of an 8-device fleet with 1, then 2, adversarial devices"
    )
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"fleet YAML (default: {DEFAULT_CONFIG})")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field")
    p.add_argument(
        "--attacks",
        nargs="+",
        metavar="ATTACK",
        help=f"run only these (default: all of {' '.join(ATTACKS)}; the bench checks the names)",
    )
    p.add_argument(
        "--adversaries", type=int, nargs="+", default=[1, 2], help="adversarial devices per run: partitions 0..k-1"
    )
    p.add_argument("--aggregation", help=f"robust.aggregation: one of {', '.join(AGGREGATIONS)}")
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="each attack at the largest strength the server's own defense accepts, searched every round by a dry "
        f"run of it (default attacks then: {' '.join(ADAPTIVE)}); the report goes to robustness-edge.json",
    )
    p.add_argument(
        "--cost-seeds",
        type=int,
        nargs="*",
        default=[0, 1],
        metavar="SEED",
        help="seeds whose clean fleet runs once more with every defense off, to measure what they cost "
        "(default: 0 1; none: skip)",
    )
    p.add_argument("--output-dir")
    p.add_argument(
        "--timeout-s", type=float, default=1800.0, help="a simulation still running after this counts as crashed"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    p.set_defaults(func=run_robustness)


def _overrides(args: argparse.Namespace) -> dict:
    from fleet.commands.common import set_overrides

    overrides = set_overrides(args)
    if args.aggregation is not None:
        overrides["robust.aggregation"] = args.aggregation
    return overrides


def run_robustness(args: argparse.Namespace) -> int:
    from fleet.bench.attack_names import ADAPTIVE, ATTACKS
    from fleet.bench.robustness import bench_robustness, robustness_table

    report = bench_robustness(
        args.config,
        _overrides(args),
        attacks=list(dict.fromkeys(args.attacks or (ADAPTIVE if args.adaptive else ATTACKS))),
        adversaries=list(dict.fromkeys(args.adversaries)),
        timeout_s=args.timeout_s,
        quiet=args.json,
        cost_seeds=list(dict.fromkeys(args.cost_seeds)),
        adaptive=args.adaptive,
    )
    print(json.dumps(report, indent=2) if args.json else robustness_table(report))
    return 0

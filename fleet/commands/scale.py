"""``fleet bench scale``: wall time, overhead and memory of the simulation from 8 to 1,000 devices, beside
Flower's own floor on the same fleets."""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # devices have no internet; flwr reads this on import

DEFAULT_CONFIG = "simulations/scale.yaml"


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scale", help="wall time per round, overhead ratio and peak memory as the fleet grows")
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"fleet YAML (default: {DEFAULT_CONFIG})")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field")
    p.add_argument(
        "--fleets",
        nargs="+",
        metavar="DEVICES:PER_ROUND",
        help="fleet sizes (default: 8:8 64:16 256:16 1000:16 1000:32)",
    )
    p.add_argument("--no-floor", action="store_true", help="skip Flower's floor (a sleeping ClientApp) at each size")
    p.add_argument("--output-dir")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="a fleet still running after this is stopped")
    p.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    p.set_defaults(func=run_scale)


def run_scale(args: argparse.Namespace) -> int:
    from fleet.bench.scale import FLEETS, bench_scale, parse_fleets, scale_table
    from fleet.commands.common import set_overrides

    fleets = parse_fleets(args.fleets) if args.fleets else FLEETS
    report = bench_scale(
        args.config,
        set_overrides(args),
        fleets=fleets,
        timeout_s=args.timeout_s,
        quiet=args.json,
        floor=not args.no_floor,
    )
    print(json.dumps(report, indent=2) if args.json else scale_table(report))
    return 0

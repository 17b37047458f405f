"""``fleet bench pfl``: personalization methods against fleet's personal policies, at equal simulated time."""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # devices have no internet; flwr reads this on import

DEFAULT_CONFIG = "simulations/pfl.yaml"


def register_bench(sub: argparse._SubParsersAction) -> None:
    from fleet.bench.regimes import add_profile_flags
    from fleet.commands.common import add_combine_flags

    p = sub.add_parser(
        "pfl", help="FedAvg+FT, FedBN, FedPer, FedRep, FedALA, APFL, Ditto against fleet's methods; new devices"
    )
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"fleet YAML (default: {DEFAULT_CONFIG})")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field")
    p.add_argument("--seeds", type=int, nargs="+", help="run every method once per seed (default: train.seed)")
    p.add_argument("--methods", nargs="+", metavar="METHOD", help="a subset of the methods (default: all)")
    p.add_argument("--finetune-steps", type=int, default=10, help="FedAvg+FT's fine-tuning steps before scoring")
    p.add_argument("--newcomer-epochs", type=int, default=5, help="epochs each new device personalizes for")
    p.add_argument(
        "--newcomer-lr", type=float, help="the new devices' learning rate (default: 0.001, a tenth of the fleet's)"
    )
    p.add_argument(
        "--newcomer-orders",
        type=int,
        default=1,
        help="batch orders each new device trains each method in, its curve their mean (on a few hundred images "
        "one order moves a method's accuracy as much as the methods differ)",
    )
    p.add_argument(
        "--newcomers-from",
        nargs="+",
        metavar="RUN_DIR",
        help="only the new devices, from these finished runs' final models (e.g. runs/pfl-s0-fleet); plot beside them",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="read any method run already finished with the same config (a batch cut short)",
    )
    add_combine_flags(p, "batches this bench wrote, e.g. one per Dirichlet beta", "runs/pfl-combined.json")
    p.add_argument("--output-dir")
    p.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    add_profile_flags(p)
    p.set_defaults(func=run_pfl)


def run_pfl(args: argparse.Namespace) -> int:
    from fleet.base.errors import ConfigError
    from fleet.bench.pfl import NEWCOMER_LR, bench_pfl, combine_reports, newcomers_from, newcomers_table, pfl_table
    from fleet.bench.regimes import profile_overrides
    from fleet.commands.common import require_counts, set_overrides
    from fleet.engine.config import parse_override

    require_counts(args, "newcomer_epochs", "newcomer_orders")
    lr = NEWCOMER_LR if args.newcomer_lr is None else args.newcomer_lr
    if not 0 < lr < 10:
        raise ConfigError(f"--newcomer-lr: {lr} is not allowed; use a number in (0, 10), e.g. {NEWCOMER_LR}")
    if args.newcomers_from:
        overrides = dict(parse_override(s) for s in args.set)
        report = newcomers_from(
            args.newcomers_from, args.newcomer_epochs, lr, overrides, args.json, orders=args.newcomer_orders
        )
        print(json.dumps(report, indent=2) if args.json else newcomers_table(report["new_devices"]))
        return 0
    if args.combine:
        report = combine_reports(args.combine, args.out or "runs/pfl-combined.json")
        print(json.dumps(report, indent=2) if args.json else pfl_table(report))
        return 0
    report = bench_pfl(
        args.config,
        {**set_overrides(args), **profile_overrides(args.profile, args.regime)},
        seeds=args.seeds,
        methods=args.methods,
        finetune_steps=args.finetune_steps,
        newcomer_epochs=args.newcomer_epochs,
        newcomer_lr=lr,
        newcomer_orders=args.newcomer_orders,
        quiet=args.json,
        reuse=args.reuse,
    )
    print(json.dumps(report, indent=2) if args.json else pfl_table(report))
    return 0

"""The ``fleet`` command. Each subcommand module registers its own parser.

A :class:`~fleet.base.errors.FleetError` (bad config, unknown model, mismatched
profile, ...) becomes one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fleet.base.errors import FleetError
from fleet.commands import bench as bench_command
from fleet.commands import certs, personalize, pfl, pretrain, profile, robustness, scale, supervise, testbed, train
from fleet.commands import device as device_command
from fleet.commands import fleet as fleet_command
from fleet.commands import memory as memory_command

# Modules exposing register(subparsers) and optionally register_bench(bench_subparsers).
COMMAND_MODULES = (
    train,
    profile,
    pretrain,
    personalize,
    bench_command,
    memory_command,
    fleet_command,
    device_command,
    robustness,
    scale,
    pfl,
    testbed,
    certs,
    supervise,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleet", description="Elastic, memory-budgeted on-device training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = sub.add_parser("bench", help="benchmarks that print figures (JSON with --json)")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for module in COMMAND_MODULES:
        for fn_name, target in (("register", sub), ("register_plan", sub), ("register_bench", bench_sub)):
            fn = getattr(module, fn_name, None)
            if fn is not None:
                fn(target)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except FleetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

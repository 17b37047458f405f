"""``fleet testbed [CONFIG]``: the fleet on emulated devices (real SuperNodes in cgroups and network namespaces)."""

from __future__ import annotations

import argparse

from fleet.commands.common import add_combine_flags

DEFAULT_CONFIG = "simulations/testbed.yaml"
COMBINED = "runs/testbed-combined.json"  # --combine's report unless --out names another
BENCH_ROUNDS = 4  # FedAvg's rounds in the bench: three methods in about 30 minutes on the default fleet


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "testbed",
        help="run the fleet on emulated devices: real SuperNodes with their own CPU, memory and links (root)",
    )
    p.add_argument(
        "config", nargs="?", default=DEFAULT_CONFIG, help=f"fleet YAML with a testbed section ({DEFAULT_CONFIG})"
    )
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a field")
    p.add_argument("--name")
    p.add_argument("--output-dir")
    p.add_argument("--rounds", type=int)
    p.add_argument("--strategy", help="fleet, naive, fedavg or ditto")
    add_runtime_flag(p)
    for kind, form, what in (
        ("kill", "NAME@ROUND", "kill a device as that round starts (it stays down)"),
        ("freeze", "NAME@ROUND:SECONDS", "freeze a device for that long as that round starts"),
        ("join", "NAME@ROUND", "start a device only as that round starts"),
    ):
        p.add_argument(f"--{kind}", action="append", default=[], metavar=form, help=what)
    p.set_defaults(func=run)


def add_runtime_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--runtime",
        help="how each device serves messages (testbed.runtime, checked there): warm, forked from "
        "`fleet device runtime` (default), or subprocess, Flower's fresh flwr-clientapp per message",
    )


def run(args: argparse.Namespace) -> int:
    from fleet.commands.fleet import _overrides, summary_table
    from fleet.federated.shared.run_summary import RunSummary
    from fleet.testbed.config import load_testbed_config
    from fleet.testbed.run import Fault, run_testbed

    faults = [Fault.parse(kind, text) for kind in ("kill", "freeze", "join") for text in getattr(args, kind)]
    cfg = load_testbed_config(args.config, _overrides(args))
    run = run_testbed(cfg, faults, log=lambda line: print(line, flush=True))
    print(summary_table(run.summary or RunSummary.read(run.run_dir)))  # none: the read says why
    return 0


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "testbed", help="FedAvg vs naive vs fleet on the emulated fleet in real seconds, and the simulator against it"
    )
    p.add_argument(
        "config", nargs="?", default=DEFAULT_CONFIG, help=f"fleet YAML with a testbed section ({DEFAULT_CONFIG})"
    )
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a field")
    p.add_argument("--output-dir")
    p.add_argument(
        "--rounds", type=int, default=BENCH_ROUNDS, help="FedAvg's rounds; their wall clock is every method's budget"
    )
    add_combine_flags(p, "a seed and a config each, e.g. --set train.seed=1; pooled per config", COMBINED)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_runtime_flag(p)
    p.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from fleet.base.errors import ConfigError
    from fleet.bench.launch import progress_log
    from fleet.bench.testbed import bench_table, bench_testbed, plot_bench
    from fleet.commands.fleet import _overrides
    from fleet.testbed.config import load_testbed_config
    from fleet.testbed.run import check_requirements

    if args.combine:
        return combine_bench(args)
    if args.rounds < 2:
        raise ConfigError(
            f"--rounds: an integer >= 2 (FedAvg should reach the target in its last two), not {args.rounds}"
        )
    overrides = {k: v for k, v in _overrides(args).items() if k != "federation.rounds"}
    cfg = load_testbed_config(args.config, overrides)
    check_requirements(cfg)
    report = bench_testbed(cfg, args.rounds, progress_log(args.json))
    out = Path(cfg.output_dir) / f"{cfg.name}-bench-seed{cfg.train.seed}.json"
    report["plots"] = [str(p) for p in plot_bench(report, out.with_suffix(""))]
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2) if args.json else f"{bench_table(report)}\nwrote {out}")
    return 0


def combine_bench(args: argparse.Namespace) -> int:
    """``--combine``: the reports pooled per regime, written as JSON, printed as a table (or the JSON)."""
    import json
    from pathlib import Path

    from fleet.bench.testbed_seeds import combine, combined_table, read_reports

    combined = combine(read_reports(args.combine))
    out = Path(args.out or COMBINED)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(combined, indent=2))
    print(json.dumps(combined, indent=2) if args.json else f"{combined_table(combined)}\nwrote {out}")
    return 0

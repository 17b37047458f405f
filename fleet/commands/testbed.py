"""``fleet testbed [CONFIG]``: the fleet on emulated devices (real SuperNodes in cgroups and network namespaces)."""

from __future__ import annotations

import argparse

DEFAULT_CONFIG = "simulations/testbed.yaml"


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
    for kind, form, what in (
        ("kill", "NAME@ROUND", "kill a device as that round starts (it stays down)"),
        ("freeze", "NAME@ROUND:SECONDS", "freeze a device for that long as that round starts"),
        ("join", "NAME@ROUND", "start a device only as that round starts"),
    ):
        p.add_argument(f"--{kind}", action="append", default=[], metavar=form, help=what)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fleet.commands.fleet import _overrides, summary_table
    from fleet.federated.config import load_fleet_config
    from fleet.testbed.run import Fault, run_testbed

    faults = [Fault.parse(kind, text) for kind in ("kill", "freeze", "join") for text in getattr(args, kind)]
    cfg = load_fleet_config(args.config, _overrides(args))
    summary = run_testbed(cfg, faults, log=lambda line: print(line, flush=True))
    print(summary_table(summary))
    return 0

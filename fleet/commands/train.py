"""``fleet train --config C --method M --rho R``"""

from __future__ import annotations

import argparse

from fleet.commands.common import add_config_args, config_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train one method on this device and write a JSON record")
    add_config_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fleet.engine.train_run import run_training

    cfg = config_from_args(args)
    record, path = run_training(cfg)
    acc = record["final_accuracy"]
    print(f"final accuracy {100 * acc:.2f}%  training time {record['train_time_s']:.1f}s  record: {path}")
    return 0

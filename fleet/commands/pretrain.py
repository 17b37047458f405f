"""``fleet pretrain --config C [--out ckpt.pt]``"""

from __future__ import annotations

import argparse
from pathlib import Path

from fleet.commands.common import add_config_args, config_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pretrain", help="train the starting checkpoint on the config's pretraining classes")
    add_config_args(p, default_config="simulations/personalize.yaml")
    p.add_argument("--out", help="checkpoint file (default: the config's pretrain.checkpoint)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fleet.engine.pretrain import checkpoint_path, pretrain

    cfg = config_from_args(args)
    pretrain(cfg, Path(args.out) if args.out else checkpoint_path(cfg))
    return 0

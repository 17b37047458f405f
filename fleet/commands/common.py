"""Flags shared by the commands that read an experiment config."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine pulls in torch: imported when a command runs, so `fleet device runtime` stays light
    from fleet.engine.config import ExperimentConfig

# flag -> config field it overrides
CONFIG_FLAGS = {
    "name": "name",
    "output_dir": "output_dir",
    "model": "model.name",
    "weights": "model.weights",
    "dataset": "data.dataset",
    "data_root": "data.root",
    "input_size": "data.input_size",
    "method": "train.method",
    "rho": "train.rho",
    "epochs": "train.epochs",
    "batch_size": "train.batch_size",
    "lr": "train.lr",
    "interval": "train.interval",
    "profile": "hardware.profile",
    "threads": "hardware.threads",
    "seed": "train.seed",
    "device": "train.device",
    "memory_budget_mb": "hardware.memory_budget_mb",
    "spill_dir": "hardware.spill_dir",
}


def add_config_args(parser: argparse.ArgumentParser, *, default_config: str | None = None) -> None:
    parser.add_argument("--config", "-c", default=default_config, help="experiment YAML (see simulations/)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override any config field, e.g. train.lr=0.05",
    )
    g = parser.add_argument_group("config overrides")
    g.add_argument("--name")
    g.add_argument("--output-dir")
    g.add_argument("--model")
    g.add_argument("--weights", help="local checkpoint to start from")
    g.add_argument("--dataset")
    g.add_argument("--data-root")
    g.add_argument("--input-size", type=int)
    g.add_argument("--method", help="full, tl, bn_bias, prunetrain or elastic")
    g.add_argument("--rho", type=float, help="time budget as a fraction of full training (elastic)")
    g.add_argument("--epochs", type=int)
    g.add_argument("--batch-size", type=int)
    g.add_argument("--lr", type=float)
    g.add_argument("--interval", type=int)
    g.add_argument("--profile", help="device profile YAML from `fleet profile`")
    g.add_argument("--threads", type=int)
    g.add_argument("--seed", type=int)
    g.add_argument("--device", help="auto (a CUDA GPU where there is one), cpu or cuda")
    g.add_argument(
        "--memory-budget-mb", type=float, help="activation memory budget; steps follow a keep/recompute/page plan"
    )
    g.add_argument("--spill-dir", help="where paged-out activations are written")


def config_from_args(args: argparse.Namespace) -> ExperimentConfig:
    from fleet.engine.config import load_config, parse_override

    overrides = dict(parse_override(s) for s in args.set)
    for flag, path in CONFIG_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides[path] = value
    return load_config(args.config, overrides)


def model_kwargs(args: argparse.Namespace) -> dict:
    """The model flags the benchmark commands share, as keyword arguments of their entry functions."""
    return {"num_classes": args.num_classes, "in_channels": args.in_channels, "small_input": args.small_input}


def require_counts(args: argparse.Namespace, *flags: str) -> None:
    """Each named count flag (``repeats``, ``selections``, ...) is >= 1: a zero otherwise fails only
    after the model is built and measured (a median of no samples), or is silently ignored."""
    from fleet.base.errors import ConfigError

    for flag in flags:
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')}: {value} is not allowed; use an integer >= 1")


def set_overrides(args: argparse.Namespace) -> dict:
    """A bench's ``--set FIELD=VALUE`` overrides, plus ``--output-dir`` when given."""
    from fleet.engine.config import parse_override

    overrides = dict(parse_override(s) for s in args.set)
    if args.output_dir is not None:
        overrides["output_dir"] = args.output_dir
    return overrides


def add_combine_flags(p: argparse.ArgumentParser, what: str, default_out: str) -> None:
    """``--combine REPORT...`` and ``--out`` on a bench run in batches: ``what`` says how its reports pool."""
    p.add_argument("--combine", nargs="+", metavar="REPORT", help=f"pool the seeds of these reports ({what}) into one")
    p.add_argument("--out", help=f"with --combine: the combined report's path (default: {default_out})")

"""``fleet personalize``: all methods from one pretrained model, side by side."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from fleet.commands.common import add_config_args, config_from_args

if TYPE_CHECKING:  # the engine pulls in torch: imported when the command runs
    from fleet.engine.config import ExperimentConfig

DEFAULT_CONFIG = "simulations/personalize.yaml"


def _add(p: argparse.ArgumentParser) -> None:
    add_config_args(p, default_config=DEFAULT_CONFIG)
    p.add_argument("--methods", help="comma-separated subset of full,tl,bn_bias,prunetrain,elastic")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)


def register(sub: argparse._SubParsersAction) -> None:
    _add(sub.add_parser("personalize", help="personalize a pretrained model with every method"))


def register_bench(bench_sub: argparse._SubParsersAction) -> None:
    _add(bench_sub.add_parser("personalize", help="final accuracy and training time per method"))


def check_data(cfg: ExperimentConfig) -> None:
    """The model against the personalization data and, when a checkpoint is still to be made, the
    pretraining data: a mismatch is one line now instead of an IndexError after pretraining."""
    from fleet.engine.experiment import check_model_fits_data, load_data
    from fleet.engine.pretrain import checkpoint_path, pretrain_config

    check_model_fits_data(cfg, *load_data(cfg.data, cfg.train.seed))
    if cfg.model.weights is None and not checkpoint_path(cfg).is_file():
        pcfg = pretrain_config(cfg)
        check_model_fits_data(pcfg, *load_data(pcfg.data, pcfg.train.seed), classes_field="pretrain.classes")


def run(args: argparse.Namespace) -> int:
    import sys

    from fleet.bench.personalize import personalize, summary_table
    from fleet.bench.regimes import profile_overrides
    from fleet.engine.config import NULL

    if args.methods:
        args.set.append(f"methods=[{args.methods}]")
    if args.profile is not None:  # the config's reference profile, unless measured here or another file
        for key, value in profile_overrides(args.profile, None).items():
            args.set.append(f"{key}={'null' if value is NULL else value}")
        args.profile = None
    cfg = config_from_args(args)
    check_data(cfg)
    log = (
        (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else (lambda line: print(line, flush=True))
    )
    record, path = personalize(cfg, log=log)
    if args.json:
        figures = {
            m: {
                k: r.get(k)
                for k in (
                    "final_accuracy",
                    "train_time_s",
                    "predicted_time_s",
                    "time_vs_full",
                    "accuracy_vs_full_points",
                    "rho",
                    "probe_time_s",
                    "probe_share",
                )
            }
            for m, r in record["methods"].items()
        }
        head = {k: record[k] for k in ("start_accuracy", "profiling_time_s", "full_epoch_time_s")}
        print(json.dumps({**head, "methods": figures, "record": str(path)}, indent=2))
    else:
        print(summary_table(record))
        print(f"record: {path}  plot: {path.with_suffix('.png')}")
    return 0

"""``fleet profile --model M --batch-size B --input-size S --out device.yaml``

or ``fleet profile --config simulations/fleet.yaml --out device.yaml``: the model,
batch and input size of a config (an experiment or a fleet file; flags override it).
"""

from __future__ import annotations

import argparse
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure per-tensor training times on this device")
    p.add_argument(
        "--config", "-c", help="take model, batch and input size from this YAML (experiment or fleet config)"
    )
    p.add_argument("--model", help="model name (required without --config)")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--input-size", type=int)
    p.add_argument("--num-classes", type=int)
    p.add_argument("--in-channels", type=int)
    p.add_argument(
        "--small-input", action="store_true", default=None, help="the model's small-input stem (32x32 images)"
    )
    p.add_argument("--repeats", type=int, default=7, help="repeats per measurement; medians are kept")
    p.add_argument("--lr", type=float)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--memory-budget-mb", type=float, help="record this device's activation memory budget in the profile"
    )
    p.add_argument("--out", required=True, help="profile YAML to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from fleet.config import load_config
    from fleet.errors import ConfigError
    from fleet.experiment import make_model, trainer_options
    from fleet.models import model_meta
    from fleet.profiler import profile_device
    from fleet.trainer import make_optimizer

    if args.config is None and args.model is None:
        raise ConfigError("fleet profile: give --model NAME or --config FILE.yaml to say which model to profile")
    flags = {
        "model.name": args.model,
        "model.num_classes": args.num_classes,
        "model.in_channels": args.in_channels,
        "model.small_input": args.small_input,
        "data.input_size": args.input_size,
        "train.batch_size": args.batch_size,
        "train.lr": args.lr,
        "train.memory_budget_mb": args.memory_budget_mb,
    }
    cfg = load_config(args.config, {k: v for k, v in flags.items() if v is not None}, ignore_sections=("federation",))
    if args.threads:
        torch.set_num_threads(args.threads)
    model = make_model(cfg.model)
    size = cfg.data.input_size
    opts = trainer_options(cfg.train, size)
    start = time.perf_counter()
    profile = profile_device(
        model,
        model_meta(cfg.model.name, cfg.model.num_classes, cfg.model.in_channels, cfg.model.small_input),
        batch_size=cfg.train.batch_size,
        input_size=size,
        make_optimizer=lambda ps: make_optimizer(ps, opts),
        repeats=args.repeats,
    )
    profile.memory_budget_mb = cfg.train.memory_budget_mb
    path = profile.save(args.out)
    print(
        f"profiled {cfg.model.name} at batch {cfg.train.batch_size}, input {size}: {len(profile.tensors)} "
        f"tensors, forward {1000 * profile.forward_time:.1f} ms, "
        f"full step {1000 * profile.full_step_time:.1f} ms (fastest possible rho {profile.min_rho:.2f}); "
        f"took {time.perf_counter() - start:.1f}s; wrote {path}"
    )
    return 0

"""``fleet profile --model M --batch-size B --input-size S --out device.yaml``

or ``fleet profile --config simulations/fleet.yaml --out device.yaml``: the model,
batch and input size of a config (an experiment or a fleet file; flags override it).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from fleet.base.errors import ConfigError
from fleet.commands.common import require_counts


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
        "--device", help="auto (a CUDA GPU where there is one), cpu or cuda; default: the config's train.device"
    )
    p.add_argument(
        "--amp", action="store_true", default=None, help="measure in mixed precision (CUDA), for train.amp runs"
    )
    p.add_argument(
        "--memory-budget-mb", type=float, help="record this device's activation memory budget in the profile"
    )
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="record a device this many times slower than the one measured (e.g. a Pi class emulated from a "
        "faster host: the testbed's pi4 class runs a full step 7.1x slower than one core here); default 1",
    )
    p.add_argument("--note", default="", help="a line kept in the profile's host record: what the profile stands for")
    p.add_argument("--out", required=True, help="profile YAML to write")
    p.set_defaults(func=run)


def check_counts(args: argparse.Namespace) -> None:
    """``--threads 0`` would be silently ignored and ``--repeats 0`` fail after the model is built."""
    require_counts(args, "repeats", "threads")


def output_file(out: str) -> Path:
    """``--out`` as a file path whose folder exists (made when missing), checked before the profiling
    work rather than when the profile is saved after it."""
    if not out.strip():
        raise ConfigError("--out: empty path; give the profile's file path, e.g. --out device.yaml")
    path = Path(out).expanduser()
    if not path.name or path.is_dir():
        raise ConfigError(f"--out: {out} is a directory; give a file path in it, e.g. {path / 'device.yaml'}")
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(f"--out: {blocker} is a file, not a folder; give a path in a folder, e.g. device.yaml")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"--out: cannot create the folder {path.parent} ({exc.strerror or exc}); give a path in a writable folder"
        ) from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--out: the folder {path.parent} is not writable; give a path in a writable folder")
    return path


def run(args: argparse.Namespace) -> int:
    import torch

    from fleet.engine.accelerator import device_name, resolve_device
    from fleet.engine.config import load_config
    from fleet.engine.experiment import make_model
    from fleet.engine.models import model_meta
    from fleet.engine.profiler import profile_device
    from fleet.engine.trainer import make_optimizer

    if args.config is None and args.model is None:
        raise ConfigError("fleet profile: give --model NAME or --config FILE.yaml to say which model to profile")
    check_counts(args)
    if not args.scale >= 1:  # also refuses NaN
        raise ConfigError(f"--scale: {args.scale} is not allowed; use a slow-down factor >= 1 (1: as measured)")
    flags = {
        "model.name": args.model,
        "model.num_classes": args.num_classes,
        "model.in_channels": args.in_channels,
        "model.small_input": args.small_input,
        "data.input_size": args.input_size,
        "train.batch_size": args.batch_size,
        "train.lr": args.lr,
        "train.device": args.device,
        "train.amp": args.amp,
        "hardware.memory_budget_mb": args.memory_budget_mb,
    }
    # a fleet YAML's own sections and those of the tools above it (the testbed's): a profile reads none of them
    from fleet.federated.shared.config import SECTIONS, SECTIONS_ABOVE

    overrides = {k: v for k, v in flags.items() if v is not None}
    cfg = load_config(args.config, overrides, ignore_sections=SECTIONS + SECTIONS_ABOVE)
    out = output_file(args.out)
    device = resolve_device(cfg.train.device, "--device" if args.device is not None else "train.device")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = make_model(cfg.model)
    size = cfg.data.input_size
    start = time.perf_counter()
    profile = profile_device(
        model,
        model_meta(cfg.model.name, cfg.model.num_classes, cfg.model.in_channels, cfg.model.small_input),
        batch_size=cfg.train.batch_size,
        input_size=size,
        make_optimizer=lambda ps: make_optimizer(ps, cfg.train),
        repeats=args.repeats,
        device=device,
        amp=cfg.train.amp,
    )
    profile.memory_budget_mb = cfg.hardware.memory_budget_mb
    profile = profile.scaled(args.scale)
    if args.note:
        profile.host["note"] = args.note
    path = profile.save(out)
    print(
        f"profiled {cfg.model.name} at batch {cfg.train.batch_size}, input {size}: {len(profile.tensors)} "
        f"tensors, forward {1000 * profile.forward_time:.1f} ms, "
        f"full step {1000 * profile.full_step_time:.1f} ms (fastest possible rho {profile.min_rho:.2f}); "
        f"took {time.perf_counter() - start:.1f}s; wrote {path}"
        + ("" if device.type == "cpu" else f" (on {device_name(device)}, {profile.dtype})")
    )
    return 0

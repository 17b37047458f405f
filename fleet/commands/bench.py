"""``fleet bench timing`` and ``fleet bench speedup``: figures, printed."""

from __future__ import annotations

import argparse
import json

from fleet.commands.common import model_kwargs, require_counts


def _model_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--profile", help="device profile YAML (else one is measured now)")
    p.add_argument("--model", required=required)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--input-size", type=int, default=32)
    p.add_argument("--in-channels", type=int, default=3)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--small-input", action="store_true")
    p.add_argument("--threads", type=int)
    p.add_argument("--device", default="auto", help="auto (a CUDA GPU where there is one), cpu or cuda")
    p.add_argument("--amp", action="store_true", help="mixed precision on CUDA (a measured profile only)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def register_bench(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser("timing", help="predicted vs measured step time for random selections")
    _model_args(p, required=False)
    p.add_argument("--selections", type=int, default=10)
    p.add_argument("--repeats", type=int, default=15)
    p.set_defaults(func=run_timing)
    p = bench_sub.add_parser("speedup", help="elastic step time / full step time at rho")
    _model_args(p, required=False)
    p.add_argument("--rho", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=15)
    p.set_defaults(func=run_speedup)


def _device(args: argparse.Namespace):
    """The device ``--device`` names here (one line when it names CUDA on a machine without it)."""
    from fleet.engine.accelerator import resolve_device

    return resolve_device(args.device, "--device")


def _profile(args: argparse.Namespace, device):
    """The ``--profile`` file, refused when measured on another kind of device than ``device``; else one
    measured now on ``device``."""
    import torch

    from fleet.base.errors import ConfigError
    from fleet.bench.steps import measure_profile
    from fleet.engine.device_profile import DeviceProfile

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        profile = DeviceProfile.load(args.profile)
        profile.check_runs_on(device.type, None, f"--profile {args.profile}")
        return profile
    if not args.model:
        raise ConfigError("--model: needed when no --profile is given (e.g. --model resnet18)")
    from fleet.engine.config import config_from_dict

    config_from_dict(
        {
            "model": {"name": args.model},
            "data": {"input_size": args.input_size},
            "train": {"batch_size": args.batch_size, "device": args.device, "amp": args.amp},
        }
    )
    kwargs = model_kwargs(args)
    return measure_profile(args.model, args.batch_size, args.input_size, **kwargs, device=device, amp=args.amp)


def _emit(result: dict, as_json: bool, lines: list[str]) -> None:
    print(json.dumps(result, indent=2) if as_json else "\n".join(lines))


def run_timing(args: argparse.Namespace) -> int:
    from fleet.bench.timing import timing_bench

    require_counts(args, "selections", "repeats", "threads")
    device = _device(args)
    r = timing_bench(_profile(args, device), selections=args.selections, repeats=args.repeats, device=device)
    lines = [f"{'selected':>8} {'kmin':>5} {'predicted ms':>13} {'measured ms':>12} {'error':>7}"]
    for row in [r["full"], *r["selections"]]:
        lines.append(
            f"{row['selected']:8d} {row['kmin']:5d} {1000 * row['predicted_s']:13.1f} "
            f"{1000 * row['measured_s']:12.1f} {100 * row['relative_error']:6.1f}%"
        )
    lines.append(
        f"median |error| {100 * r['median_abs_relative_error']:.1f}%  "
        f"({100 * r['median_abs_relative_error_drift_corrected']:.1f}% after the machine's drift of "
        f"{r['machine_drift']:.2f}x since profiling)  ({r['model']}, batch {r['batch_size']}, input {r['input_size']})"
    )
    _emit(r, args.json, lines)
    return 0


def run_speedup(args: argparse.Namespace) -> int:
    from fleet.base.errors import ConfigError
    from fleet.bench.speedup import speedup_bench

    if not 0 < args.rho <= 1:
        raise ConfigError(f"--rho: {args.rho} is not allowed; use a number in (0, 1]")
    require_counts(args, "repeats", "threads")
    device = _device(args)
    r = speedup_bench(_profile(args, device), args.rho, repeats=args.repeats, device=device)
    lines = [
        f"{r['model']} rho={r['rho']}: trained {r['selected']}/{r['tensors']} tensors; "
        f"time fraction predicted {r['predicted_time_fraction']:.3f}, measured {r['measured_time_fraction']:.3f} "
        f"(speedup {1 / r['measured_time_fraction']:.2f}x; floor rho {r['min_rho']:.2f})"
    ]
    _emit(r, args.json, lines)
    return 0

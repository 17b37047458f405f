"""``fleet profile --model M --batch-size B --input-size S --out device.yaml``"""

from __future__ import annotations

import argparse
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure per-tensor training times on this device")
    p.add_argument("--model", required=True)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--input-size", type=int, default=32)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--in-channels", type=int, default=3)
    p.add_argument("--small-input", action="store_true", help="the model's small-input stem (32x32 images)")
    p.add_argument("--repeats", type=int, default=7, help="repeats per measurement; medians are kept")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--out", required=True, help="profile YAML to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from fleet.config import config_from_dict
    from fleet.experiment import make_model, model_meta, trainer_options
    from fleet.profiler import profile_device
    from fleet.trainer import make_optimizer

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = config_from_dict(
        {
            "model": {"name": args.model, "num_classes": args.num_classes, "in_channels": args.in_channels, "small_input": args.small_input},
            "data": {"input_size": args.input_size},
            "train": {"batch_size": args.batch_size, "lr": args.lr},
        }
    )
    model = make_model(cfg.model)
    opts = trainer_options(cfg.train, args.input_size)
    start = time.perf_counter()
    profile = profile_device(
        model,
        model_meta(cfg.model),
        batch_size=args.batch_size,
        input_size=args.input_size,
        make_optimizer=lambda ps: make_optimizer(ps, opts),
        repeats=args.repeats,
    )
    path = profile.save(args.out)
    print(
        f"profiled {args.model}: {len(profile.tensors)} tensors, forward {1000 * profile.forward_time:.1f} ms, "
        f"full step {1000 * profile.full_step_time:.1f} ms (fastest possible rho {profile.min_rho:.2f}); "
        f"took {time.perf_counter() - start:.1f}s; wrote {path}"
    )
    return 0

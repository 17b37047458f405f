"""``fleet device check``: what a device would train on, read from its own files, before it joins the fleet."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from fleet.commands import device_runtime, device_supernode

if TYPE_CHECKING:  # the reader pulls in torch; the CLI imports it only when the command runs
    from fleet.data.folders import OwnedData


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("device", help="a device: its own data, its warm runtime, its SuperNode")
    device_sub = p.add_subparsers(dest="device_command", required=True, metavar="ACTION")
    check = device_sub.add_parser(
        "check", help="read a device's image tree as the fleet would and print its label mapping and counts"
    )
    check.add_argument("--config", "-c", required=True, help="the fleet YAML (sets data.class_names)")
    check.add_argument(
        "--data-root", required=True, help="the device's images: <root>/<class>/*.png, <root>/train/<class>/..."
    )
    check.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="override a field, e.g. train.seed=1"
    )
    check.set_defaults(func=run_check)
    device_runtime.register(device_sub)
    device_supernode.register(device_sub)


def run_check(args: argparse.Namespace) -> int:
    from fleet.engine.config import parse_override
    from fleet.federated.shared.config import load_fleet_config
    from fleet.federated.shared.owned import owned_data

    cfg = load_fleet_config(args.config, dict(parse_override(s) for s in args.set))
    data = owned_data(cfg, args.data_root, "--data-root")
    own_test = data.layout == "split" and (Path(args.data_root).expanduser() / "test").is_dir()
    print(check_report(data, args.data_root, cfg.devices.test_fraction, own_test))
    if len(data.train) < cfg.train.batch_size:
        print(
            f"  warning: {len(data.train)} training images, fewer than one batch (train.batch_size "
            f"{cfg.train.batch_size}): every step repeats them, and the device will overfit its few images"
        )
    return 0


def check_report(data: OwnedData, root: str, test_fraction: float, own_test: bool) -> str:
    """The layout, label mapping (id -> class, held here or not), per-class counts, totals and the held-out share."""
    held = [name for name, (tr, te) in data.counts.items() if tr + te]
    width = max(len("class"), *(len(n) for n in data.counts))
    lines = [
        f"device data at {root} (layout: {data.layout})",
        f"  {'id':>3}  {'class':<{width}}  {'here':<4}  {'train':>6}  {'test':>5}",
    ]
    for i, (name, (tr, te)) in enumerate(data.counts.items()):
        lines.append(f"  {i:>3}  {name:<{width}}  {'yes' if tr + te else '-':<4}  {tr:>6}  {te:>5}")
    n_train, n_test = len(data.train), len(data.test)
    lines.append(f"  total: {len(held)} of {len(data.counts)} classes, {n_train} train + {n_test} test images")
    source = (
        "the device's own test/ folder" if own_test else f"held out per class (devices.test_fraction={test_fraction:g})"
    )
    lines.append(f"  test split: {n_test / max(n_train + n_test, 1):.1%} of the images, {source}")
    return "\n".join(lines)

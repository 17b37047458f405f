"""The fleet's starting checkpoint, trained on samples no device holds.

``start.samples`` images are set aside before partitioning (see
:func:`fleet.federated.shared.split.fleet_indices`), so the fleet fine-tunes a model that has
never seen its data, as a vendor would ship one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from fleet.engine.experiment import load_data, make_model
from fleet.engine.models import model_meta, save_checkpoint
from fleet.engine.pretrain import train_epochs
from fleet.federated.shared.config import FleetConfig
from fleet.federated.shared.split import fleet_indices


def pretrain_fleet_model(cfg: FleetConfig, out: Path, log: Callable[[str], None] = print) -> Path:
    train, test = load_data(cfg.data, cfg.train.seed)
    pre, _ = fleet_indices(cfg, train.labels.numpy())
    data = train.subset(pre)
    model = make_model(dataclasses.replace(cfg.model, weights=None), cfg.train.seed)
    train_cfg = dataclasses.replace(cfg.train, method="full")

    classes = "" if cfg.start.classes is None else f" of classes {cfg.start.classes}"

    def report(epoch: int, acc: float, loss: float, seconds: float) -> None:
        log(
            f"pretrain epoch {epoch + 1}/{cfg.start.epochs} on {len(data)} held-out samples{classes}: test "
            f"accuracy {100 * acc:.1f}%  loss {loss:.3f}  {seconds:.0f}s"
        )

    acc = train_epochs(model, train_cfg, cfg.data.input_size, data, test, cfg.start.epochs, report)
    m = cfg.model
    meta = {
        **model_meta(m.name, m.num_classes, m.in_channels, m.small_input),
        "pretrained_samples": len(data),
        "pretrain_classes": cfg.start.classes,
        "test_accuracy": acc,
    }
    save_checkpoint(model, out, meta)
    return out

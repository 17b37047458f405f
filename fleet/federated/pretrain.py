"""The fleet's starting checkpoint, trained on samples no device holds.

``federation.pretrained_samples`` images are set aside before partitioning (see
:func:`fleet.federated.device.fleet_indices`), so the fleet fine-tunes a model that has
never seen its data, as a vendor would ship one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from fleet.federated.split import fleet_indices
from fleet.experiment import load_data, make_model
from fleet.models import save_checkpoint
from fleet.pretrain import train_epochs
from fleet.trainer import TrainerOptions
from fleet.federated.config import FleetConfig


def pretrain_fleet_model(cfg: FleetConfig, out: Path, log: Callable[[str], None] = print) -> Path:
    fed = cfg.federation
    train, test = load_data(cfg.data, cfg.train.seed)
    pre, _ = fleet_indices(cfg, train.labels.numpy())
    data = train.subset(pre)
    model = make_model(dataclasses.replace(cfg.model, weights=None), cfg.train.seed)
    t = cfg.train
    options = TrainerOptions(method="full", lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay, batch_size=t.batch_size, input_size=cfg.data.input_size, seed=t.seed)

    classes = "" if fed.pretrain_classes is None else f" of classes {fed.pretrain_classes}"

    def report(epoch: int, acc: float, loss: float, seconds: float) -> None:
        log(f"pretrain epoch {epoch + 1}/{fed.pretrain_epochs} on {len(data)} held-out samples{classes}: test accuracy {100 * acc:.1f}%  loss {loss:.3f}  {seconds:.0f}s")

    acc = train_epochs(model, options, data, test, fed.pretrain_epochs, report)
    meta = {"model": cfg.model.name, "num_classes": cfg.model.num_classes, "in_channels": cfg.model.in_channels, "small_input": cfg.model.small_input, "pretrained_samples": len(data), "pretrain_classes": fed.pretrain_classes, "test_accuracy": acc}
    save_checkpoint(model, out, meta)
    return out

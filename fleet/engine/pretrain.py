"""``fleet pretrain``: the starting checkpoint personalization begins from.

There is no internet for ImageNet weights, so fleet trains its own on one
part of the data (by default other classes than the ones devices personalize
to), as a vendor would before shipping a model to the field.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from torch import nn

from fleet.data.datasets import ArrayDataset
from fleet.data.shift import ShiftConfig
from fleet.engine.config import ExperimentConfig, TrainConfig
from fleet.engine.experiment import check_model_fits_data, load_data, make_model
from fleet.engine.models import load_checkpoint_meta, model_meta, save_checkpoint
from fleet.engine.trainer import Trainer


def pretrain_seed(cfg: ExperimentConfig) -> int:
    """The seed the vendor's model is pretrained with: ``pretrain.seed``, else ``train.seed``."""
    return cfg.pretrain.seed if cfg.pretrain.seed is not None else cfg.train.seed


def checkpoint_path(cfg: ExperimentConfig) -> Path:
    """Where the pretrained model is cached; its name holds everything that makes it, the seed included
    (a cache shared by runs of several seeds would otherwise hand each the model of whichever ran first)."""
    if cfg.pretrain.checkpoint:
        return Path(cfg.pretrain.checkpoint)
    classes = "all" if cfg.pretrain.classes is None else "-".join(map(str, cfg.pretrain.classes))
    name = f"{cfg.model.name}-{cfg.data.dataset}-c{classes}-s{cfg.data.input_size}-r{pretrain_seed(cfg)}.pt"
    return Path(cfg.output_dir) / "pretrained" / name


def pretrain_config(cfg: ExperimentConfig) -> ExperimentConfig:
    """The same model on the pretraining part of the data, trained in full."""
    classes = cfg.pretrain.classes
    num_classes = len(classes) if classes is not None else cfg.model.num_classes
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, num_classes=num_classes, weights=None, reset_head=False),
        data=dataclasses.replace(  # unshifted: the vendor's data, not this device's camera
            cfg.data, classes=classes, train_per_class=cfg.pretrain.train_per_class, shift=ShiftConfig()
        ),
        train=dataclasses.replace(
            cfg.train, method="full", epochs=cfg.pretrain.epochs, lr=cfg.pretrain.lr, seed=pretrain_seed(cfg)
        ),
    )


def train_epochs(
    model: nn.Module,
    config: TrainConfig,
    input_size: int,
    train_ds: ArrayDataset,
    test_ds: ArrayDataset,
    epochs: int,
    report: Callable[[int, float, float, float], None],
) -> float:
    """Train ``model`` under ``config`` (its images resized to ``input_size``) for ``epochs``, evaluating after
    each; ``report(epoch, accuracy, loss, seconds)`` is called per epoch. Returns the last accuracy (0 without
    epochs)."""
    trainer = Trainer(model, config, input_size=input_size)
    accuracy = 0.0
    for epoch in range(epochs):
        start = time.perf_counter()
        stats = trainer.train_epoch(train_ds, epoch)
        accuracy = trainer.evaluate(test_ds)
        report(epoch, accuracy, stats.loss, time.perf_counter() - start)
    return accuracy


def pretrain(cfg: ExperimentConfig, out: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """Train and save a checkpoint whose meta records how it was made."""
    pcfg = pretrain_config(cfg)
    out = out or checkpoint_path(cfg)
    train_ds, test_ds = load_data(pcfg.data, pcfg.train.seed)
    check_model_fits_data(pcfg, train_ds, test_ds, classes_field="pretrain.classes")
    model = make_model(pcfg.model, pcfg.train.seed)
    log(
        f"pretraining {pcfg.model.name} on {len(train_ds)} {train_ds.name} samples (classes "
        f"{pcfg.data.classes or 'all'})"
    )

    def report(epoch: int, accuracy: float, loss: float, seconds: float) -> None:
        log(
            f"[  pretrain] epoch {epoch + 1}/{pcfg.train.epochs}  acc {100 * accuracy:5.1f}%  "
            f"loss {loss:.3f}  {seconds:6.1f}s"
        )

    accuracy = train_epochs(model, pcfg.train, pcfg.data.input_size, train_ds, test_ds, pcfg.train.epochs, report)
    meta = {
        **model_meta(pcfg.model.name, pcfg.model.num_classes, pcfg.model.in_channels, pcfg.model.small_input),
        "dataset": pcfg.data.dataset,
        "classes": pcfg.data.classes,
        "input_size": pcfg.data.input_size,
        "epochs": pcfg.train.epochs,
        "accuracy": accuracy,
    }
    save_checkpoint(model, out, meta)
    log(f"saved {out} (accuracy {100 * accuracy:.1f}% on held-out pretraining classes)")
    return out


def ensure_pretrained(cfg: ExperimentConfig, log: Callable[[str], None] = print) -> Path:
    """The cached checkpoint for ``cfg``, made on first use."""
    path = checkpoint_path(cfg)
    if path.is_file():
        meta = load_checkpoint_meta(path)
        log(f"using pretrained checkpoint {path} (accuracy {100 * float(meta.get('accuracy', 0)):.1f}%)")
        return path
    return pretrain(cfg, path, log)

"""A new device personalizes: a device that never took part starts from the fleet's final global model.

ElasticTrainer's claim is about exactly this moment: a device adapting a model to its own data
quickly. Here a device of the fleet's split (with its shift) that never trained in the run
personalizes from the global model with each method in turn (``full``, ``tl``, ``bn_bias``,
``elastic`` at ``rho``), and each method's accuracy on the device's held-out split is recorded
against the **device time** it has spent: its profile (times its tier) applied to what it
trained, plus its importance probes, as the fleet's simulated clock counts them. Flower-free:
the benchmark calls it after a run, on the run's final checkpoint.

Two accuracies per point:

* ``accuracy``: on the device's own held-out split, as every fleet device is scored. With a
  few hundred images a device, one image is a third of a point or more, the size of the
  differences between methods here.
* ``distribution_accuracy``: the same quantity, the accuracy on the device's data
  distribution, estimated from far more images: the dataset's whole test split turned into
  the device's domain, each class's accuracy weighted by the class's share of the device's
  own data. No image of it was trained on; only the label mix is the device's.

Batch orders. Each epoch shuffles the device's data, and on a few hundred images the order alone
moves a method's final accuracy by as much as the methods differ (seed 4 of ``fleet bench pfl``:
elastic 4.3 points below tl held-out in one order, 0.67 in another). With ``orders`` above 1 each
method trains once per order, from the same start, and its curve is the mean over them: the
figure of the method on this device, not of one shuffle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from fleet.base.errors import ConfigError
from fleet.data.datasets import ArrayDataset
from fleet.data.shift import device_shift, shift_dataset
from fleet.engine.device_profile import DeviceProfile
from fleet.engine.experiment import check_profile, load_data, model_with_weights
from fleet.engine.trainer import Trainer, predictions
from fleet.federated.on_device.device import tier_of
from fleet.federated.shared.config import FleetConfig
from fleet.federated.shared.split import DeviceData, device_data

METHODS = ("full", "tl", "bn_bias", "elastic")
ORDER_SEED_STEP = 7919  # batch order k shuffles with train.seed + k * this (order 0: train.seed, as one order did)


def personalize_newcomer(
    cfg: FleetConfig,
    weights: Mapping[str, torch.Tensor],
    partition_id: int,
    profile: DeviceProfile,
    *,
    epochs: int,
    methods: Sequence[str] = METHODS,
    rho: float = 0.5,
    lr: float | None = None,
    frozen_norm_stats: bool = True,
    orders: int = 1,
) -> dict[str, list[dict[str, float]]]:
    """Per method, the device's accuracy curve: ``[{"device_time_s", "accuracy", "distribution_accuracy"},
    ...]`` (the module docstring says which is which), starting at the global model's accuracies at time 0,
    one point per epoch over the device's training data.
    ``profile`` is the measured one; the device's tier scales it. ``lr`` (None: ``train.lr``) and
    ``frozen_norm_stats`` are the personalization's: a new device fine-tunes a model whose
    normalization statistics the fleet learned, on too few images for its batches' own. ``orders``: batch
    orders each method trains in, its curve their mean (the module docstring says why)."""
    if orders < 1:
        raise ConfigError(f"orders: {orders} is not allowed; use an integer >= 1 (one batch order or more)")
    data = device_data(cfg, partition_id)
    domain = distribution_test(cfg, partition_id, data)
    device = profile.scaled(tier_of(cfg, partition_id, {}))
    curves: dict[str, list[dict[str, float]]] = {}
    for i, method in enumerate(methods):
        runs = []
        for order in range(orders):
            model = model_with_weights(cfg.model, {k: v.clone() for k, v in weights.items()})
            if i == order == 0:  # a profile of another model or input would time the wrong tensors
                check_profile(
                    profile, model, cfg.train.batch_size, cfg.data.input_size, cfg.hardware.profile or "profile"
                )
            seed = cfg.train.seed + order * ORDER_SEED_STEP
            train = dataclasses.replace(cfg.train, method=method, rho=rho, lr=lr or cfg.train.lr, seed=seed)
            trainer = Trainer(model, train, device, input_size=cfg.data.input_size, frozen_norm_stats=frozen_norm_stats)
            runs.append(curve(trainer, data, domain, epochs))
        curves[method] = mean_curve(runs)
    return curves


def mean_curve(curves: Sequence[Sequence[Mapping[str, float]]]) -> list[dict[str, float]]:
    """Point by point, the mean of ``curves`` (of batch orders, devices or seeds) over the keys they all have
    and the points they all reach."""
    keys = [k for k in curves[0][0] if all(k in c[0] for c in curves)]
    return [{k: sum(c[i][k] for c in curves) / len(curves) for k in keys} for i in range(min(len(c) for c in curves))]


def curve(trainer: Trainer, data: DeviceData, domain: tuple[ArrayDataset, torch.Tensor], epochs: int) -> list[dict]:
    """``epochs`` of training on the device's data, its accuracies at the start and after each epoch."""

    def point(spent: float) -> dict[str, float]:
        held_out = trainer.evaluate(data.test)
        mixed = distribution_accuracy(trainer.model, *domain, trainer.input_size)
        trainer.train_mode()
        return {"device_time_s": spent, "accuracy": held_out, "distribution_accuracy": mixed}

    points, spent = [point(0.0)], 0.0
    for epoch in range(epochs):
        spent += trainer.train_epoch(data.train, epoch).predicted_time_s  # its probes included
        points.append(point(spent))
    return points


def distribution_test(cfg: FleetConfig, partition_id: int, data: DeviceData) -> tuple[ArrayDataset, torch.Tensor]:
    """The dataset's whole test split as device ``partition_id`` sees it (its shift), and the share of each
    class in the device's own data (train and held-out)."""
    _, test = load_data(dataclasses.replace(cfg.data, test_per_class=None), cfg.train.seed)
    if cfg.devices.shift.active:
        d = cfg.devices
        test = shift_dataset(
            test, device_shift(d.shift, partition_id, d.num_devices, cfg.model.num_classes, cfg.train.seed)
        )
    counts = torch.bincount(torch.cat([data.train.labels, data.test.labels]), minlength=test.num_classes)
    return test, counts.double() / counts.sum()


def distribution_accuracy(
    model: torch.nn.Module, test: ArrayDataset, mix: torch.Tensor, input_size: int | None
) -> float:
    """``sum_c mix_c * accuracy_c`` on ``test``: each class's accuracy weighted by its share ``mix`` (a class
    the test split lacks counts as 0, so a mix on it cannot score high by omission)."""
    hits = (predictions(model, test, input_size) == test.labels).double()
    correct = torch.zeros(len(mix), dtype=torch.float64).index_add_(0, test.labels, hits)
    seen = torch.bincount(test.labels, minlength=len(mix)).double()
    per_class = torch.where(seen > 0, correct / seen.clamp(min=1), torch.zeros_like(seen))
    return float((mix * per_class).sum())

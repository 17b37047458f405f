"""A new device personalizes: a device that never took part starts from the fleet's final global model.

ElasticTrainer's claim is about exactly this moment: a device adapting a model to its own data
quickly. Here a device of the fleet's split (with its shift) that never trained in the run
personalizes from the global model with each method in turn (``full``, ``tl``, ``bn_bias``,
``elastic`` at ``rho``), and each method's accuracy on the device's held-out split is recorded
against the **device time** it has spent: its profile (times its tier) applied to what it
trained, plus its importance probes, as the fleet's simulated clock counts them. Flower-free:
the benchmark calls it after a run, on the run's final checkpoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from fleet.engine.device_profile import DeviceProfile
from fleet.engine.experiment import check_profile, model_with_weights
from fleet.engine.trainer import Trainer
from fleet.federated.config import FleetConfig
from fleet.federated.device import tier_of
from fleet.federated.split import device_data

METHODS = ("full", "tl", "bn_bias", "elastic")


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
) -> dict[str, list[dict[str, float]]]:
    """Per method, the device's accuracy curve: ``[{"device_time_s", "accuracy"}, ...]``, starting at
    the global model's accuracy at time 0, one point per epoch over the device's training data.
    ``profile`` is the measured one; the device's tier scales it. ``lr`` (None: ``train.lr``) and
    ``frozen_norm_stats`` are the personalization's: a new device fine-tunes a model whose
    normalization statistics the fleet learned, on too few images for its batches' own."""
    data = device_data(cfg, partition_id)
    device = profile.scaled(tier_of(cfg, partition_id, {}))
    curves: dict[str, list[dict[str, float]]] = {}
    for i, method in enumerate(methods):
        model = model_with_weights(cfg.model, {k: v.clone() for k, v in weights.items()})
        if i == 0:  # a profile of another model or input would time the wrong tensors
            check_profile(profile, model, cfg.train.batch_size, cfg.data.input_size, cfg.hardware.profile or "profile")
        train = dataclasses.replace(cfg.train, method=method, rho=rho, lr=lr or cfg.train.lr)
        trainer = Trainer(model, train, device, input_size=cfg.data.input_size, frozen_norm_stats=frozen_norm_stats)
        points = [{"device_time_s": 0.0, "accuracy": trainer.evaluate(data.test)}]
        spent = 0.0
        for epoch in range(epochs):
            spent += trainer.train_epoch(data.train, epoch).predicted_time_s  # its probes included
            points.append({"device_time_s": spent, "accuracy": trainer.evaluate(data.test)})
        curves[method] = points
    return curves

"""The global model scored by the server on a balanced test set it holds.

Devices score the global model on their own held-out splits: tens of samples each, with
their label skew, so one round's figure moves by points from test noise alone (a few hundred
samples give a standard error of about 2 points). When the server holds the dataset,
as every simulation does, the data's own test split (``data.test_per_class`` per class,
never part of any device's data or of pretraining) gives the global model a balanced,
low-noise figure for benchmarks to compare. A deployed server usually holds no data, so
this is off unless ``evaluation.server_test`` asks for it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from fleet.base.errors import ConfigError
from fleet.data.datasets import ArrayDataset, batches
from fleet.engine.experiment import model_with_weights
from fleet.engine.trainer import accuracy
from fleet.federated.shared.config import FleetConfig
from fleet.federated.shared.split import datasets, fleet_indices


def server_test_set(cfg: FleetConfig) -> ArrayDataset:
    """The data's test split, as the config caps it (``data.test_per_class``)."""
    return datasets(cfg)[1]


def server_accuracy(cfg: FleetConfig, arrays: Mapping[str, np.ndarray], test: ArrayDataset) -> float:
    """Top-1 accuracy of the global model ``arrays`` on ``test``."""
    with torch.no_grad():
        return accuracy(global_model(cfg, arrays), test, cfg.data.input_size)


def global_model(cfg: FleetConfig, arrays: Mapping[str, np.ndarray]) -> torch.nn.Module:
    """The fleet's model holding ``arrays`` (copied: the server's arrays stay its own)."""
    return model_with_weights(cfg.model, {k: torch.from_numpy(np.array(v)) for k, v in arrays.items()})


REFERENCE_SAMPLES = 256  # the server's clean batch for judging updates: a few ms of forward pass per reply


def reference_set(cfg: FleetConfig) -> ArrayDataset:
    """A fixed sample of the data the server pretrained the start on (``start.samples``, held out from
    every device): the server's own clean data, which no device's update has seen."""
    train = datasets(cfg)[0]
    pre, _ = fleet_indices(cfg, train.labels.numpy())
    if len(pre) == 0:
        raise ConfigError(
            "robust.validate: judging replies needs the server's own held-out data; set start.samples > 0 or "
            "validate: null"
        )
    chosen = np.random.default_rng([cfg.train.seed, 11]).permutation(pre)[:REFERENCE_SAMPLES]
    return train.subset(np.sort(chosen))


def reference_loss(cfg: FleetConfig, arrays: Mapping[str, np.ndarray], data: ArrayDataset) -> float:
    """Mean cross-entropy of the model ``arrays`` on ``data`` (eval mode)."""
    model = global_model(cfg, arrays)
    model.eval()
    total = 0.0
    with torch.no_grad():
        for x, y in batches(data, REFERENCE_SAMPLES, shuffle=False, input_size=cfg.data.input_size):
            total += float(F.cross_entropy(model(x), y, reduction="sum"))
    return total / max(len(data), 1)

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

from fleet.data.datasets import ArrayDataset
from fleet.engine.experiment import model_with_weights
from fleet.engine.trainer import accuracy
from fleet.federated.config import FleetConfig
from fleet.federated.split import datasets


def server_test_set(cfg: FleetConfig) -> ArrayDataset:
    """The data's test split, as the config caps it (``data.test_per_class``)."""
    return datasets(cfg)[1]


def server_accuracy(cfg: FleetConfig, arrays: Mapping[str, np.ndarray], test: ArrayDataset) -> float:
    """Top-1 accuracy of the global model ``arrays`` on ``test``."""
    model = model_with_weights(cfg.model, {k: torch.from_numpy(np.array(v)) for k, v in arrays.items()})
    with torch.no_grad():
        return accuracy(model, test, cfg.data.input_size)

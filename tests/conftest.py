"""Shared small fixtures: a real model, real data and a real profile, kept tiny."""

from __future__ import annotations

import pytest
import torch

from fleet.data import load_dataset
from fleet.models import build_model
from fleet.profiler import profile_device
from fleet.trainer import TrainerOptions, make_optimizer

INPUT = 16
BATCH = 8


@pytest.fixture(scope="session")
def synthetic():
    return load_dataset("synthetic", "train"), load_dataset("synthetic", "test")


def small_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("resnet18", 10, in_channels=1)


@pytest.fixture(scope="session")
def small_profile():
    opts = TrainerOptions(batch_size=BATCH, input_size=INPUT)
    meta = {"name": "resnet18", "num_classes": 10, "in_channels": 1, "small_input": False}
    return profile_device(
        small_model(), meta, batch_size=BATCH, input_size=INPUT, make_optimizer=lambda ps: make_optimizer(ps, opts), repeats=3
    )

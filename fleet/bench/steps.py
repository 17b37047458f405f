"""Interleaved step timing shared by the timing benchmarks.

Every variant is measured interleaved with the others in one run (step by
step, round-robin), repeated, and summarized by medians, because a shared
machine can slow down severalfold for seconds at a time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from fleet.engine.config import TrainConfig
from fleet.engine.device_profile import DeviceProfile
from fleet.engine.models import build_model, input_channels, model_meta
from fleet.engine.profiler import profile_device, tensor_order
from fleet.engine.trainer import make_optimizer


class StepBench:
    """A model, its optimizer and one fixed batch: time steps that train a given mask."""

    def __init__(self, model: nn.Module, batch_size: int, input_size: int, num_classes: int, seed: int = 0):
        self.model = model.train()
        in_channels = input_channels(model)
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(batch_size, in_channels, input_size, input_size, generator=gen)
        self.y = torch.randint(0, num_classes, (batch_size,), generator=gen)
        order = tensor_order(model, self.x)
        self.names = [n for n, _, _ in order]
        self.params = [p for _, _, p in order]
        self.optimizer = make_optimizer(self.params, TrainConfig())

    def step(self, mask: Sequence[bool]) -> float:
        for p, m in zip(self.params, mask):
            p.requires_grad_(m)
            if not m:
                p.grad = None
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(self.model(self.x), self.y)
        if loss.requires_grad:
            loss.backward()
        self.optimizer.step()
        return time.perf_counter() - start

    def interleaved(self, masks: Sequence[Sequence[bool]], repeats: int, warmup: int = 2) -> list[float]:
        """Median step time of each mask, measured round-robin."""
        for _ in range(warmup):
            for m in masks:
                self.step(m)
        times: list[list[float]] = [[] for _ in masks]
        for _ in range(repeats):
            for i, m in enumerate(masks):
                times[i].append(self.step(m))
        return [statistics.median(t) for t in times]


def model_from_profile(profile: DeviceProfile) -> nn.Module:
    m = profile.model
    torch.manual_seed(0)
    return build_model(
        m["name"], int(m["num_classes"]), in_channels=int(m["in_channels"]), small_input=bool(m["small_input"])
    )


def measure_profile(
    model_name: str,
    batch_size: int,
    input_size: int,
    *,
    num_classes: int = 10,
    in_channels: int = 3,
    small_input: bool = False,
    repeats: int = 7,
) -> DeviceProfile:
    torch.manual_seed(0)
    model = build_model(model_name, num_classes, in_channels=in_channels, small_input=small_input)
    meta = model_meta(model_name, num_classes, in_channels, small_input)
    return profile_device(
        model,
        meta,
        batch_size=batch_size,
        input_size=input_size,
        make_optimizer=lambda ps: make_optimizer(ps, TrainConfig()),
        repeats=repeats,
    )

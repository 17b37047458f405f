"""Interleaved step timing shared by the timing benchmarks.

Every variant is measured interleaved with the others in one run (step by
step, round-robin), repeated, and summarized by medians, because a shared
machine can slow down severalfold for seconds at a time.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch
from torch import nn

from fleet.engine.accelerator import CUDA_WARMUP, Precision, clock_for, elapsed, on_device
from fleet.engine.config import TrainConfig
from fleet.engine.device_profile import DeviceProfile
from fleet.engine.models import build_model, input_channels, model_meta
from fleet.engine.profiler import profile_device, tensor_order
from fleet.engine.trainer import make_optimizer


class StepBench:
    """A model, its optimizer and one fixed batch: time steps that train a given mask.

    On a CUDA ``device`` the model and batch move there, steps are timed by CUDA events (the host's
    clock would time the launch queue), and ``amp`` runs them in mixed precision as training does."""

    def __init__(
        self,
        model: nn.Module,
        batch_size: int,
        input_size: int,
        num_classes: int,
        seed: int = 0,
        *,
        device: torch.device | None = None,
        amp: bool = False,
    ):
        self.device = device or torch.device("cpu")
        self.model = model.train()
        if self.device.type != "cpu":
            self.model.to(self.device)
        self.clock = clock_for(self.device)
        self.precision = Precision(self.device, amp)
        in_channels = input_channels(model)
        gen = torch.Generator().manual_seed(seed)
        self.x = on_device(torch.randn(batch_size, in_channels, input_size, input_size, generator=gen), self.device)
        self.y = on_device(torch.randint(0, num_classes, (batch_size,), generator=gen), self.device)
        order = tensor_order(model, self.x)
        self.names = [n for n, _, _ in order]
        self.params = [p for _, _, p in order]
        self.optimizer = make_optimizer(self.params, TrainConfig())

    def step(self, mask: Sequence[bool]) -> float:
        for p, m in zip(self.params, mask):
            p.requires_grad_(m)
            if not m:
                p.grad = None
        start = self.clock.stamp()
        self.optimizer.zero_grad(set_to_none=True)
        with self.precision.autocast():
            loss = nn.functional.cross_entropy(self.model(self.x), self.y)
        if loss.requires_grad:
            self.precision.backward(loss)
        if loss.requires_grad or self.precision.scaler is None:
            self.precision.step(self.optimizer)
        return elapsed(self.clock, start, self.clock.stamp())

    def interleaved(self, masks: Sequence[Sequence[bool]], repeats: int, warmup: int = 2) -> list[float]:
        """Median step time of each mask, measured round-robin (more warm-up on a GPU)."""
        if self.device.type != "cpu":
            warmup = max(warmup, CUDA_WARMUP)
        for _ in range(warmup):
            for m in masks:
                self.step(m)
        times: list[list[float]] = [[] for _ in masks]
        for _ in range(repeats):
            for i, m in enumerate(masks):
                times[i].append(self.step(m))
        return [statistics.median(t) for t in times]


def bench_for_profile(profile: DeviceProfile, seed: int = 0, device: torch.device | None = None) -> StepBench:
    """The profile's model and batch shape on ``device`` (the CPU when None), in the profile's precision."""
    return StepBench(
        model_from_profile(profile),
        profile.batch_size,
        profile.input_size,
        int(profile.model["num_classes"]),
        seed,
        device=device,
        amp=profile.dtype != "float32",
    )


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
    device: torch.device | None = None,
    amp: bool = False,
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
        device=device,
        amp=amp,
    )

"""Shared small fixtures: a real model, real data and profiles, kept tiny.

Tests that decide selections or budgets use ``proportional_profile``: timings computed from
tensor sizes, so the selected set is the same on any machine under any load. ``small_profile``
really measures this machine; only tests of the profiler itself (what a profile holds, not how
fast anything is) should use it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fleet.data.datasets import load_dataset
from fleet.engine.config import TrainConfig
from fleet.engine.device_profile import DeviceProfile, TensorTiming
from fleet.engine.models import build_model, input_channels, model_meta
from fleet.engine.profiler import profile_device, tensor_order
from fleet.engine.trainer import make_optimizer

INPUT = 16
BATCH = 8


@pytest.fixture(scope="session")
def synthetic():
    return load_dataset("synthetic", "train"), load_dataset("synthetic", "test")


SMALL_META = model_meta("resnet18", 10, 1, False)


def small_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("resnet18", 10, in_channels=1)


def proportional_profile(
    model: nn.Module,
    batch_size: int = BATCH,
    input_size: int = INPUT,
    *,
    meta: dict | None = None,
    dw_per_param: float = 1e-8,
    dy_per_param: float = 1e-9,
    forward_share: float = 0.15,
) -> DeviceProfile:
    """A ``DeviceProfile`` for ``model`` computed from sizes, not measured: the same on every machine.

    Each tensor's ``t_dw`` is ``dw_per_param`` seconds per element (``t_opt`` 0), each layer's
    ``t_dy`` (on its first tensor) ``dy_per_param`` per element of the layer's parameters, and
    the fixed ``t_fw`` is set so that it is ``forward_share`` of a full step (so ``min_rho`` is
    ``forward_share``). Tensor order, names and shapes are the model's own, so the profile passes
    ``check_matches``/``check_profile`` for ``batch_size`` and ``input_size``. ``meta`` is the
    profile's ``model`` dict (default: ``small_model``'s; give the real one for other models).
    """
    if not 0 < forward_share < 1:
        raise ValueError(f"forward_share must be in (0, 1), got {forward_share}")
    in_channels = input_channels(model)
    order = tensor_order(model, torch.zeros(1, in_channels, input_size, input_size))
    layer_size: dict[str, int] = {}
    for _, layer, p in order:
        layer_size[layer] = layer_size.get(layer, 0) + p.numel()
    tensors, seen = [], set()
    for name, layer, p in order:
        first = layer not in seen
        seen.add(layer)
        tensors.append(
            TensorTiming(
                name=name,
                layer=layer,
                shape=list(p.shape),
                t_dw=p.numel() * dw_per_param,
                t_opt=0.0,
                t_dy=layer_size[layer] * dy_per_param if first else 0.0,
            )
        )
    backward = sum(t.t_dw for t in tensors) + sum(t.t_dy for t in tensors[1:])  # a full step's backward
    return DeviceProfile(
        model=dict(meta if meta is not None else SMALL_META),
        batch_size=batch_size,
        input_size=input_size,
        t_fw=backward * forward_share / (1 - forward_share),
        tensors=tensors,
        threads=1,
        host={"hostname": "proportional", "machine": "synthetic"},
        created="2000-01-01T00:00:00+00:00",
    )


@pytest.fixture(scope="session")
def size_profile() -> DeviceProfile:
    """``proportional_profile`` of ``small_model()`` at the shared BATCH and INPUT."""
    return proportional_profile(small_model())


@pytest.fixture(scope="session")
def small_profile():
    """Really measured on this machine: its timings vary from run to run; assert structure only."""
    return profile_device(
        small_model(),
        dict(SMALL_META),
        batch_size=BATCH,
        input_size=INPUT,
        make_optimizer=lambda ps: make_optimizer(ps, TrainConfig(batch_size=BATCH)),
        repeats=3,
    )


def cli_refusal(capsys, argv: list[str]) -> tuple[int, str]:
    """``fleet ARGV`` run in this process (a console start costs ~4 s of imports): (exit status, stderr's last
    line). argparse's refusals raise SystemExit; fleet's own return 2."""
    from fleet.cli import main

    try:
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return status, err.strip().splitlines()[-1]

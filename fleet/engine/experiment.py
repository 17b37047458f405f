"""Glue from a validated config to the pieces one training run needs."""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fleet.base.errors import ConfigError
from fleet.data.datasets import ArrayDataset, check_fashion_mnist, load_dataset
from fleet.data.shift import device_shift, shift_dataset
from fleet.engine.accelerator import Precision, device_name, module_device, resolve_device
from fleet.engine.config import DataConfig, ExperimentConfig, ModelConfig, TrainConfig
from fleet.engine.device_profile import DeviceProfile
from fleet.engine.models import build_model, head_parameter_names, input_channels, model_meta
from fleet.engine.profiler import profile_device, tensor_order
from fleet.engine.trainer import make_optimizer


def cap_per_class(ds: ArrayDataset, per_class: int | None, seed: int) -> ArrayDataset:
    """A deterministic subset with at most ``per_class`` samples of each label."""
    if per_class is None:
        return ds
    rng = np.random.default_rng(seed)
    labels = ds.labels.numpy()
    keep = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        keep.append(rng.permutation(idx)[:per_class])
    return ds.subset(np.sort(np.concatenate(keep)))


def load_data(cfg: DataConfig, seed: int = 0) -> tuple[ArrayDataset, ArrayDataset]:
    if cfg.dataset == "fashion-mnist" and cfg.root is None:
        check_fashion_mnist()
    train = load_dataset(cfg.dataset, "train", root=cfg.root, classes=cfg.classes)
    test = load_dataset(cfg.dataset, "test", root=cfg.root, classes=cfg.classes)
    train, test = cap_per_class(train, cfg.train_per_class, seed), cap_per_class(test, cfg.test_per_class, seed + 1)
    if not cfg.shift.active:
        return train, test
    shift = device_shift(cfg.shift, cfg.domain, cfg.shift.domains or 2, train.num_classes, seed)
    return shift_dataset(train, shift), shift_dataset(test, shift)


def check_model_fits_data(cfg: ExperimentConfig, *datasets: ArrayDataset, classes_field: str = "data.classes") -> None:
    """Refuse a model whose head or stem does not fit the data, before any profiling or training.

    Otherwise the mismatch surfaces minutes later as an IndexError in the loss (a label beyond the
    head) or a RuntimeError in the first convolution (wrong channel count). ``data.input_size`` may
    differ from the stored image size (batches are resized); the channel count may not.
    ``classes_field`` names the setting that chose the labels (``pretrain.classes`` when pretraining).
    """
    for ds in datasets:
        labels = max(ds.num_classes, int(ds.labels.max()) + 1 if len(ds) else 0)
        if labels > cfg.model.num_classes:
            raise ConfigError(
                f"model.num_classes: {cfg.model.num_classes} is fewer than the {labels} labels of the data "
                f"({ds.name}); set model.num_classes to {labels}, or keep fewer labels with {classes_field}"
            )
        if ds.channels != cfg.model.in_channels:
            plural = "s" if ds.channels != 1 else ""
            raise ConfigError(
                f"model.in_channels: {cfg.model.in_channels} does not match the data ({ds.name}: {ds.channels} "
                f"channel{plural} per image); set model.in_channels to {ds.channels}"
            )


def make_model(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = build_model(
        cfg.name,
        cfg.num_classes,
        in_channels=cfg.in_channels,
        small_input=cfg.small_input,
        weights=cfg.weights,
        reset_head=cfg.reset_head,
    )
    if cfg.reset_head and cfg.weights is not None:
        # A new task's head starts fresh even when its shape matches the checkpoint's.
        for module_name in {n.rpartition(".")[0] for n in head_parameter_names(model)}:
            model.get_submodule(module_name).reset_parameters()
    return model


def model_with_weights(cfg: ModelConfig, weights: Mapping[str, torch.Tensor]) -> nn.Module:
    """The model of ``cfg`` holding exactly ``weights`` (every tensor, strict), which it takes over.

    A copy of a skeleton built once per process on the meta device, so no initializer runs and no
    ``model.weights`` file is read only to be overwritten: a simulated device builds its model for
    every message, and that cost (about 80 ms for a ResNet-18 with a pretrained start; 18 ms on meta,
    5 ms copied) was overhead on every round. A tensor of another float type is cast to the model's own."""
    model = copy.deepcopy(_skeleton(cfg.name, cfg.num_classes, cfg.in_channels, cfg.small_input))
    own = model.state_dict()
    weights = {k: v.to(own[k].dtype) if k in own and v.dtype != own[k].dtype else v for k, v in weights.items()}
    model.load_state_dict(weights, strict=True, assign=True)
    return model


def empty_model(cfg: ModelConfig) -> nn.Module:
    """The model of ``cfg`` with storage of its own, all zeros: what a device fills with the weights a message
    brings, once they are in (``Module.load_state_dict`` casts each into place; nothing is allocated then). Its
    pages are touched here, so that a device preparing its next message ahead of its bytes pays for them then."""
    model = copy.deepcopy(_skeleton(cfg.name, cfg.num_classes, cfg.in_channels, cfg.small_input)).to_empty(device="cpu")
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.zero_()
    return model


@functools.lru_cache(maxsize=4)
def _skeleton(name: str, num_classes: int, in_channels: int, small_input: bool) -> nn.Module:
    """The architecture on the meta device (no storage, no initial values), built once; never handed out itself."""
    with torch.device("meta"):
        return build_model(name, num_classes, in_channels=in_channels, small_input=small_input, weights=None)


def run_precision(train: TrainConfig) -> tuple[torch.device, str]:
    """The device ``train.device`` resolves to here, and the type its forward computes in (float16 under
    ``train.amp``): what a profile must have been measured on and in."""
    device = resolve_device(train.device)
    return device, Precision(device, train.amp).dtype


def check_profile(
    profile: DeviceProfile,
    model: nn.Module,
    batch_size: int,
    input_size: int,
    source: str,
    train: TrainConfig | None = None,
) -> None:
    """Refuse ``profile`` unless it was measured for ``model`` at this batch and input size, and (given the
    run's ``train`` section) on the device kind and in the precision the run trains on."""
    device, dtype = run_precision(train) if train is not None else (None, None)
    example = torch.zeros(1, input_channels(model), input_size, input_size, device=module_device(model))
    order = tensor_order(model, example)
    profile.check_matches(
        [n for n, _, _ in order],
        [list(p.shape) for _, _, p in order],
        batch_size=batch_size,
        input_size=input_size,
        source=source,
        device=None if device is None else device.type,
        dtype=dtype,
    )


def obtain_profile(
    cfg: ExperimentConfig, model: nn.Module, cache: Path | None = None, *, repeats: int = 7, log=print
) -> DeviceProfile:
    """The configured profile (checked against the model), else a cached or freshly measured one."""
    batch, size = cfg.train.batch_size, cfg.data.input_size
    if cfg.hardware.profile is not None:
        profile = DeviceProfile.load(cfg.hardware.profile, field="hardware.profile")
        check_profile(profile, model, batch, size, f"profile {cfg.hardware.profile} (hardware.profile)", cfg.train)
        return profile
    if cache is not None and cache.is_file():
        try:
            profile = DeviceProfile.load(cache)
            check_profile(profile, model, batch, size, str(cache), cfg.train)
            if profile.threads == torch.get_num_threads():
                return profile
        except Exception:  # a stale cache is simply re-measured
            pass
    device = resolve_device(cfg.train.device)
    where = "this device" if device.type == "cpu" else f"this device's {device_name(device)}"
    log(f"profiling {cfg.model.name} at batch {batch}, input {size} on {where} ...")
    profile = profile_device(
        model,
        model_meta(cfg.model.name, cfg.model.num_classes, cfg.model.in_channels, cfg.model.small_input),
        batch_size=batch,
        input_size=size,
        make_optimizer=lambda ps: make_optimizer(ps, cfg.train),
        repeats=repeats,
        seed=cfg.train.seed,
        device=device,
        amp=cfg.train.amp,
    )
    log(
        f"profiled in {profile.profiling_time_s:.1f}s: full step {1000 * profile.full_step_time:.0f} ms, "
        f"forward floor rho {profile.min_rho:.2f}"
    )
    if cache is not None:
        profile.save(cache)
    return profile

"""Devices whose inputs differ: a deterministic per-device shift of a shared dataset.

Splitting one dataset by label (Dirichlet, shards) gives devices another label mix but the
same camera. Real devices also differ in their inputs: another angle, other lighting, or
even another meaning of the same label. A shift gives each simulated device a fixed
transform of its images (and optionally its labels), applied alike to its training data
and its held-out split:

* **rotation**: the Rotated-MNIST construction, each domain turned by its own angle;
* **brightness and contrast**: each domain scales them by its own factor;
* **label permutation** (concept shift): each domain maps labels through its own fixed
  permutation.

Devices fall into ``domains`` domains (device i in domain i mod domains; by default each
device its own). Domain 0 is the unshifted data, so the shared starting model and the
server's test split stay meaningful for some devices. Everything is a pure function of the
config, the seed and the device's index: every device and the server compute the same shift
without anything being sent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from fleet.base.errors import ConfigError
from fleet.data.datasets import ArrayDataset


@dataclass
class ShiftConfig:
    """How far apart the devices' input domains are (all zero/false: no shift)."""

    rotation_deg: float = 0.0  # domains' angles are spread evenly over [0, rotation_deg] (Rotated-MNIST: 0-75)
    brightness: float = 0.0  # a domain scales brightness by a seeded factor in [1 - b, 1 + b]
    contrast: float = 0.0  # a domain scales contrast by a seeded factor in [1 - c, 1 + c]
    label_permutation: bool = False  # concept shift: a domain maps label y to its own fixed permutation of y
    domains: int | None = None  # device i is in domain i % domains; null: every device its own domain

    @property
    def active(self) -> bool:
        return bool(self.rotation_deg or self.brightness or self.contrast or self.label_permutation)


RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "rotation_deg": (lambda v: 0 <= v <= 180, "an angle in degrees in [0, 180]"),
    "brightness": (lambda v: 0 <= v < 1, "a number in [0, 1): factors spread over [1 - b, 1 + b]"),
    "contrast": (lambda v: 0 <= v < 1, "a number in [0, 1): factors spread over [1 - c, 1 + c]"),
    "domains": (lambda v: v is None or v >= 1, "an integer >= 1, or null (every device its own domain)"),
}


def check_shift(cfg: ShiftConfig, where: str, in_channels: int) -> None:
    """One-line ConfigError for a field out of range, or brightness/contrast on images that are neither grey nor
    colour (``where`` names the section: ``devices.shift`` or ``data.shift``)."""
    for name, (ok, allowed) in RULES.items():
        if not ok(getattr(cfg, name)):
            raise ConfigError(f"{where}.{name}: {getattr(cfg, name)!r} is not allowed; use {allowed}")
    if (cfg.brightness or cfg.contrast) and in_channels not in (1, 3):
        raise ConfigError(
            f"{where}: brightness and contrast need 1- or 3-channel images, and this data has "
            f"{in_channels} (model.in_channels); use rotation_deg or label_permutation only"
        )


@dataclass(frozen=True)
class DeviceShift:
    """One device's transform: what its camera and its labels do differently."""

    domain: int
    angle_deg: float = 0.0
    brightness: float = 1.0
    contrast: float = 1.0
    permutation: tuple[int, ...] | None = None  # label y becomes permutation[y]


def device_shift(cfg: ShiftConfig, device: int, num_devices: int, num_classes: int, seed: int) -> DeviceShift:
    """The shift of device ``device`` of ``num_devices``: the same on every machine, different between domains."""
    domains = cfg.domains or num_devices
    domain = device % domains
    if domain == 0 or not cfg.active:
        return DeviceShift(domain)
    rng = np.random.default_rng([seed, 29, domain])
    brightness, contrast = 1.0 + cfg.brightness * rng.uniform(-1, 1), 1.0 + cfg.contrast * rng.uniform(-1, 1)
    permutation = tuple(int(y) for y in rng.permutation(num_classes)) if cfg.label_permutation else None
    return DeviceShift(
        domain,
        angle_deg=cfg.rotation_deg * domain / max(1, domains - 1),
        brightness=float(brightness),
        contrast=float(contrast),
        permutation=permutation,
    )


def shift_dataset(ds: ArrayDataset, shift: DeviceShift) -> ArrayDataset:
    """``ds`` as the device sees it: its images turned and re-lit, its labels permuted."""
    # imported here: torchvision's transforms take about a second to import, and every config load imports
    # this module for ShiftConfig
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as F

    images, labels = ds.images, ds.labels
    if shift.angle_deg:
        images = F.rotate(images, shift.angle_deg, interpolation=InterpolationMode.BILINEAR, fill=0)
    if shift.brightness != 1.0:
        images = F.adjust_brightness(images, shift.brightness)
    if shift.contrast != 1.0:
        images = F.adjust_contrast(images, shift.contrast)
    if shift.permutation is not None:
        labels = torch.tensor(shift.permutation, dtype=torch.int64)[labels]
    return replace(ds, images=images.contiguous(), labels=labels, name=f"{ds.name} (domain {shift.domain})")

"""Device-owned data from the fleet config: each device reads its own image tree.

Thin glue between :mod:`fleet.data.folders` (the reader) and the fleet's config, so the deployed node
(``data-root`` in its node config), the simulation (``data.device_roots``) and ``fleet device check``
read a device's files with exactly the same settings. No Flower here: this runs on a device
before anything is sent.
"""

from __future__ import annotations

from pathlib import Path

from fleet.base.errors import ConfigError, DataError
from fleet.data.datasets import norm_stats
from fleet.data.folders import OwnedData, load_owned
from fleet.federated.shared.config import FleetConfig
from fleet.federated.shared.paths import resolve_path


def owned_data(cfg: FleetConfig, root: str | Path, field: str, cache_dir: Path | None = None) -> OwnedData:
    """The device's train and held-out test sets from the tree at ``root``; ``field`` names where ``root`` came from;
    with ``cache_dir``, its decoded images are kept there for the next process (:mod:`fleet.data.decoded`).

    The normalisation is the fleet's fixed one (:func:`fleet.data.datasets.norm_stats`), never the device's own.
    """
    channels = cfg.model.in_channels
    mean, std = norm_stats(cfg.data.dataset, channels)
    data = load_owned(
        root,
        cfg.data.class_names,
        channels=channels,
        size=cfg.data.input_size,
        mean=mean,
        std=std,
        test_fraction=cfg.devices.test_fraction,
        seed=cfg.train.seed,
        field=field,
        cache_dir=cache_dir,
    )
    if len(data.train) == 0 or len(data.test) == 0:
        raise DataError(
            f"{field}: {root} holds {len(data.train) + len(data.test)} images, too few for both a training split and "
            f"a held-out test split (devices.test_fraction {cfg.devices.test_fraction:g} of each class's); add "
            "images, a few per class at least"
        )
    return data


def device_roots(cfg: FleetConfig) -> list[Path]:
    """Simulation: the devices' own trees, the sorted non-hidden sub-folders of ``data.device_roots``."""
    if cfg.data.device_roots is None:
        raise ConfigError(
            "data.device_roots: not set; point it at a folder holding one sub-folder per device "
            "(<device>/<class>/*.png)"
        )
    folder = resolve_path(cfg.data.device_roots)
    if not folder.is_dir():
        raise DataError(
            f"data.device_roots: {folder} is not a folder; point it at a folder holding one sub-folder per device "
            "(<device>/<class>/*.png)"
        )
    devices = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not devices:
        raise DataError(
            f"data.device_roots: {folder} holds no device sub-folders; put each device's images in "
            f"{folder}/<device>/<class>/*.png"
        )
    return devices

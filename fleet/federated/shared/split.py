"""The fleet's deterministic data split: pretraining hold-out, one partition per device.

Every device (and the server, for pretraining) computes the same split from the
config alone, so a device needs only its partition id and nothing is sent or
downloaded. A simulation worker serves many devices, so the loaded dataset is
kept once per process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleet.base.errors import ConfigError
from fleet.data.datasets import ArrayDataset, class_dirs, image_files
from fleet.data.partition import partition_indices, split_train_test
from fleet.data.shift import device_shift, shift_dataset
from fleet.engine.experiment import load_data
from fleet.federated.shared.config import FleetConfig
from fleet.federated.shared.owned import device_roots, owned_data


@dataclass
class DeviceData:
    train: ArrayDataset
    test: ArrayDataset


MIN_PARTITION = 4  # a device holds out one test sample and trains on at least 2 (BatchNorm needs 2 per batch)
_DATA: dict[str, tuple[ArrayDataset, ArrayDataset]] = {}  # a simulation actor serves many devices
_OWNED: dict[str, DeviceData] = {}  # the last device-owned tree read in this process
_INDICES: dict[str, tuple[np.ndarray, list[np.ndarray]]] = {}  # the fleet's split, made once per process


def datasets(cfg: FleetConfig) -> tuple[ArrayDataset, ArrayDataset]:
    """The data's (train, test) splits, loaded once per process."""
    key = repr((cfg.data, cfg.train.seed))
    if key not in _DATA:
        _DATA.clear()
        _DATA[key] = load_data(cfg.data, cfg.train.seed)
    return _DATA[key]


def fleet_indices(cfg: FleetConfig, labels: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """(pretraining indices, one index array per device): disjoint, the same everywhere. A simulation worker
    serves many devices: it splits the fleet once (50 ms at 1,000 devices, for every message otherwise)."""
    d = cfg.devices
    key = repr((cfg.data, d.num_devices, d.partition, d.alpha, d.samples_per_device, cfg.start, cfg.train.seed))
    if key not in _INDICES:
        _INDICES.clear()
        _INDICES[key] = _split_fleet(cfg, labels)
    return _INDICES[key]


def _split_fleet(cfg: FleetConfig, labels: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    order = np.random.default_rng([cfg.train.seed, 7]).permutation(len(labels))
    pool = order if cfg.start.classes is None else order[np.isin(labels[order], cfg.start.classes)]
    pre = np.sort(pool[: cfg.start.samples])  # a start from other classes is held out from those alone
    rest = np.setdiff1d(order, pre)  # sorted
    parts = partition_indices(
        labels[rest],
        cfg.devices.num_devices,
        cfg.devices.partition,
        alpha=cfg.devices.alpha,
        seed=cfg.train.seed,
        min_partition_size=MIN_PARTITION,
    )
    parts = [rest[p] for p in parts]
    if cfg.devices.samples_per_device is not None:
        rng = np.random.default_rng([cfg.train.seed, 11])
        parts = [np.sort(rng.permutation(p)[: cfg.devices.samples_per_device]) for p in parts]
    return pre, parts


def device_data(cfg: FleetConfig, partition_id: int) -> DeviceData:
    """The device's own training data and held-out split."""
    train, _ = datasets(cfg)
    _, parts = fleet_indices(cfg, train.labels.numpy())
    tr, te = split_train_test(parts[partition_id], cfg.devices.test_fraction, seed=cfg.train.seed + partition_id)
    data = DeviceData(train.subset(tr), train.subset(te))
    if not cfg.devices.shift.active:
        return data
    shift = device_shift(
        cfg.devices.shift, partition_id, cfg.devices.num_devices, cfg.model.num_classes, cfg.train.seed
    )
    return DeviceData(shift_dataset(data.train, shift), shift_dataset(data.test, shift))


def own_device_data(cfg: FleetConfig, root: Path, field: str, cache_dir: Path | None = None) -> DeviceData:
    """A device's own files (its ImageFolder tree) and the split it holds out of them; read once per
    process for consecutive messages to the same device, and with ``cache_dir`` decoded once while the tree
    is unchanged (a deployed device's process lasts one message)."""
    if cfg.devices.shift.active:
        raise ConfigError(
            f"devices.shift: this device reads its own files ({field} {root}), which are already its own "
            "domain; drop devices.shift from the fleet's config"
        )
    key = repr((str(root), cfg.data, cfg.model.in_channels, cfg.devices.test_fraction, cfg.train.seed))
    if key not in _OWNED:
        _OWNED.clear()
        owned = owned_data(cfg, root, field, cache_dir)
        _OWNED[key] = DeviceData(owned.train, owned.test)
    return _OWNED[key]


def known_data_sizes(cfg: FleetConfig) -> dict[str, int]:
    """Each simulated device's training-set size by name, as the server can work it out itself: it caps
    the sample weight a reply may claim. Device folders: their image count (an upper bound)."""
    if cfg.data.device_roots:
        return {root.name: sum(len(image_files(root / c)) for c in class_dirs(root)) for root in device_roots(cfg)}
    train, _ = datasets(cfg)
    _, parts = fleet_indices(cfg, train.labels.numpy())
    sizes = {}
    for pid, part in enumerate(parts):
        tr, _ = split_train_test(part, cfg.devices.test_fraction, seed=cfg.train.seed + pid)
        sizes[f"device-{pid}"] = len(tr)
    return sizes

"""Each emulated device's own ImageFolder tree, written from the fleet's split.

A real device owns its data: the testbed writes partition ``i`` of the fleet's split (its training
images and the ones the split holds out, together) as PNG files under ``<root>/<device>/<class>/``, and
the device reads it through the device-owned-data path (node config ``data-root``), holding out its
own test split as a deployed device does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fleet.data.datasets import ArrayDataset
from fleet.federated.shared.config import FleetConfig
from fleet.federated.shared.split import device_data


def class_names(cfg: FleetConfig) -> list[str]:
    """The fleet's label space as folder names: ``data.class_names``, else class-0, class-1, ..."""
    return list(cfg.data.class_names or [f"class-{i}" for i in range(cfg.model.num_classes)])


def write_tree(data: ArrayDataset, names: list[str], root: Path, prefix: str = "") -> int:
    """``data`` as ``root/<class>/<prefix><n>.png``; returns how many images it wrote."""
    from PIL import Image

    images = data.images.numpy()
    labels = data.labels.numpy()
    for label in np.unique(labels):
        (root / names[int(label)]).mkdir(parents=True, exist_ok=True)
    for n, (img, label) in enumerate(zip(images, labels)):
        arr = img[0] if img.shape[0] == 1 else np.transpose(img, (1, 2, 0))
        Image.fromarray(np.ascontiguousarray(arr)).save(root / names[int(label)] / f"{prefix}{n}.png")
    return len(labels)


def write_device_trees(cfg: FleetConfig, devices: list[str], root: Path) -> dict[str, Path]:
    """Device ``i`` of ``devices`` gets partition ``i`` (train and held-out images together); its tree by name."""
    names = class_names(cfg)
    trees = {}
    for i, device in enumerate(devices):
        part = device_data(cfg, i)
        trees[device] = root / device
        write_tree(part.train, names, trees[device], "train-")
        write_tree(part.test, names, trees[device], "test-")
    return trees

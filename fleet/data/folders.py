"""A device's own images, read from the tree on the device and mapped by class name onto the fleet's labels.

In deployment each device (a Raspberry Pi) trains on the images it holds; in simulation each
sub-folder of ``data.device_roots`` plays one device. The fleet fixes its label space once
(``data.class_names``) and a device's class folders map onto it *by name*, so label 3 means the
same class on every device even when a device holds only some of the classes (the normal case).
Each device holds out its own test split, seeded and stratified, so every run sees the same split.

Layouts (detected, in this order):

* ``split``: ``root/train/<class>/*`` and, when present, ``root/test/<class>/*`` as the device's test split;
* ``idx``: MNIST-style ``train-images-idx3-ubyte[.gz]`` + ``train-labels-idx1-ubyte[.gz]`` in ``root``,
  labels being ids into ``class_names``;
* ``imagefolder``: ``root/<class>/*`` (images searched recursively inside each class folder).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fleet.base.errors import DataError
from fleet.data.datasets import IMAGE_EXTENSIONS, ArrayDataset, class_dirs, find_idx, image_files, read_idx, read_image
from fleet.data.decoded import cached_decode

IDX_IMAGES = "train-images-idx3-ubyte"
IDX_LABELS = "train-labels-idx1-ubyte"


@dataclass
class OwnedData:
    """One device's data: its training set, its own held-out test set, and what was found where."""

    train: ArrayDataset
    test: ArrayDataset
    layout: str  # "imagefolder" (root/<class>/*), "split" (root/train/<class>, optional root/test/<class>) or "idx"
    counts: dict[str, tuple[int, int]]  # class name -> (train images, test images); every fleet class, 0s if absent


@dataclass(frozen=True)
class _Spec:
    """What every reading step needs: the label space, the image format and the name errors start with."""

    names: tuple[str, ...]
    mode: str  # PIL mode: "L" for one channel, "RGB" for three
    size: int
    field: str
    cache_dir: Path | None  # where a folder's decoded images are kept between processes; None: not kept


def load_owned(
    root: str | Path,
    class_names: Sequence[str] | None,
    *,
    channels: int,
    size: int,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    test_fraction: float,
    seed: int,
    field: str,
    cache_dir: Path | None = None,
) -> OwnedData:
    """Read the device's tree at ``root`` into uint8 (N, C, size, size) train and test sets.

    ``field`` names the setting that pointed at ``root`` ("node config data-root", "data.device_roots")
    and starts every error message, so the user knows what to fix. ``mean``/``std`` are fixed by the
    fleet (:func:`fleet.data.datasets.norm_stats`), never measured here: every device must normalise alike.
    With ``cache_dir`` (the device's state directory) a folder's decoded images are kept there for the next
    process that reads the unchanged tree (:mod:`fleet.data.decoded`).
    """
    spec = _spec(class_names, channels, size, test_fraction, field, cache_dir)
    root = Path(root).expanduser()
    if not root.is_dir():
        raise DataError(
            f"{field}: {root} is not a folder; point it at the device's images laid out as {root}/<class>/*.png"
        )
    layout = detect_layout(root, spec.names)
    test: tuple[np.ndarray, np.ndarray] | None = None
    if layout == "idx":
        images, labels = _read_idx_tree(root, spec)
    elif layout == "split":
        images, labels = _read_folder(root / "train", spec)
        if (root / "test").is_dir():
            test = _read_folder(root / "test", spec)
    else:
        images, labels = _read_folder(root, spec)
    if test is None:
        tr, te = held_out(labels, test_fraction, seed)
        test, (images, labels) = (images[te], labels[te]), (images[tr], labels[tr])
    n = len(spec.names)
    train_counts, test_counts = np.bincount(labels, minlength=n), np.bincount(test[1], minlength=n)
    counts = {name: (int(train_counts[i]), int(test_counts[i])) for i, name in enumerate(spec.names)}
    return OwnedData(
        ArrayDataset(torch.from_numpy(images), torch.from_numpy(labels), n, tuple(mean), tuple(std), "owned"),
        ArrayDataset(torch.from_numpy(test[0]), torch.from_numpy(test[1]), n, tuple(mean), tuple(std), "owned"),
        layout,
        counts,
    )


def _spec(
    class_names: Sequence[str] | None,
    channels: int,
    size: int,
    test_fraction: float,
    field: str,
    cache_dir: Path | None,
) -> _Spec:
    if class_names is None:
        raise DataError(
            "data.class_names: not set; list the fleet's class names in order (e.g. [cat, dog, bird]) so each "
            "device's class folders map onto the same label ids"
        )
    if channels not in (1, 3):
        raise DataError(f"channels: got {channels!r}; device images are read as 1 (grayscale) or 3 (RGB) channels")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise DataError(f"size: got {size!r}; use a positive number of pixels")
    if not 0 < test_fraction < 1:
        raise DataError(f"test_fraction: got {test_fraction!r}; use a number in (0, 1)")
    return _Spec(tuple(class_names), "L" if channels == 1 else "RGB", size, field, cache_dir)


def detect_layout(root: Path, class_names: Sequence[str]) -> str:
    """ "split", "idx" or "imagefolder" for the tree at ``root`` (see the module docstring)."""
    if (root / "train").is_dir() and "train" not in class_names:  # a class named "train" is a class folder
        return "split"
    if any(p.name.endswith(("-images-idx3-ubyte", "-images-idx3-ubyte.gz")) for p in root.iterdir() if p.is_file()):
        return "idx"
    return "imagefolder"


def _read_folder(folder: Path, spec: _Spec) -> tuple[np.ndarray, np.ndarray]:
    """Every image of ``folder/<class>/``, classes in the fleet's order, files sorted: the same order every run."""
    files_by_class = _class_files(folder, spec)
    files = [f for files in files_by_class.values() for f in files]
    labels = np.asarray([spec.names.index(c) for c, fs in files_by_class.items() for _ in fs], dtype=np.int64)
    shape = (len(files), 1 if spec.mode == "L" else 3, spec.size, spec.size)

    def decode() -> np.ndarray:
        images = np.empty(shape, dtype=np.uint8)
        for i, path in enumerate(files):
            images[i] = read_image(path, spec.mode, shape[2:], spec.field)
        return images

    return cached_decode(folder, files, shape, spec.mode, spec.cache_dir, decode), labels


def _class_files(folder: Path, spec: _Spec) -> dict[str, list[Path]]:
    """Class name -> its image files, in ``spec.names`` order; unknown or empty class folders are errors."""
    found = class_dirs(folder)
    if not found:
        raise DataError(
            f"{spec.field}: no class folders in {folder}; lay the device's images out as {folder}/<class>/*.png "
            "with <class> one of data.class_names"
        )
    by_form = {unicodedata.normalize("NFC", n): n for n in spec.names}
    on_disk = {}  # class name -> its folder's name as stored (macOS stores names decomposed, NFD)
    for name in found:
        label = by_form.get(unicodedata.normalize("NFC", name))
        if label is None:
            near = [n for n in spec.names if n.lower() == name.lower()]
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise DataError(
                f"{spec.field}: class folder '{name}' in {folder} is not one of the fleet's classes "
                f"({', '.join(spec.names)}; data.class_names){hint}; rename or remove it"
            )
        on_disk[label] = name
    files = {name: image_files(folder / on_disk[name]) for name in spec.names if name in on_disk}
    for name, paths in files.items():
        if not paths:
            raise DataError(
                f"{spec.field}: class folder {folder / on_disk[name]} holds no images ({', '.join(IMAGE_EXTENSIONS)}); "
                "add the class's images or remove the folder"
            )
    return files


def _read_idx_tree(root: Path, spec: _Spec) -> tuple[np.ndarray, np.ndarray]:
    """The device's MNIST-style IDX pair; its labels are ids into the fleet's class names."""
    images_path, labels_path = find_idx(root, IDX_IMAGES), find_idx(root, IDX_LABELS)
    if images_path is None or labels_path is None:
        raise DataError(
            f"{spec.field}: {root} holds IDX files but not both {IDX_IMAGES}[.gz] and {IDX_LABELS}[.gz]; "
            "name the device's image and label files so"
        )
    images, labels = read_idx(images_path, spec.field), read_idx(labels_path, spec.field)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels) or not len(labels):
        raise DataError(
            f"{spec.field}: {images_path} {images.shape} and {labels_path} {labels.shape} do not pair up "
            "(need N images of HxW and N labels, N >= 1); replace them"
        )
    bad = labels[(labels < 0) | (labels >= len(spec.names))]
    if bad.size:
        raise DataError(
            f"{spec.field}: {labels_path} holds label {int(bad[0])} but data.class_names lists {len(spec.names)} "
            f"classes (ids 0..{len(spec.names) - 1}); fix the labels or data.class_names"
        )
    return _resize_arrays(images.astype(np.uint8), spec), labels.astype(np.int64)


def _resize_arrays(images: np.ndarray, spec: _Spec) -> np.ndarray:
    """(N, H, W) grayscale to (N, C, size, size) through PIL, exactly as image files are read."""
    from PIL import Image

    channels = 1 if spec.mode == "L" else 3
    out = np.empty((len(images), channels, spec.size, spec.size), dtype=np.uint8)
    for i, arr in enumerate(images):
        img = Image.fromarray(np.ascontiguousarray(arr)).convert(spec.mode)  # uint8 (H, W) is mode "L"
        if img.size != (spec.size, spec.size):
            img = img.resize((spec.size, spec.size), Image.BILINEAR)
        pixels = np.asarray(img, dtype=np.uint8)
        out[i] = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
    return out


def held_out(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices, each sorted: per class a seeded shuffle sends round(n * test_fraction) to test.

    Stratified so a device's test split has its class mix; a class with >= 2 images keeps at least one
    on each side, a single image stays in train. Each class draws from its own seeded stream, so the
    split of one class does not change when another class gains images.
    """
    train, test = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for label in np.unique(labels):
        idx = np.flatnonzero(labels == label)
        n = len(idx)
        n_test = min(max(int(round(n * test_fraction)), 1), n - 1) if n >= 2 else 0
        order = np.random.default_rng([seed % (1 << 64), int(label)]).permutation(idx)
        test.append(order[:n_test])
        train.append(order[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))

"""In-memory image datasets read from local files, and a fast batch iterator.

Devices have no internet, so nothing here downloads: every loader reads files
already on disk and says how to get them when they are missing.  Images stay
uint8 (4x smaller than float) until :func:`batches` normalises a whole batch.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fleet.base.errors import DataError

DATASET_NAMES: tuple[str, ...] = (
    "fashion-mnist",
    "fashion-mnist-torchvision",
    "mnist",
    "cifar10",
    "cifar100",
    "imagefolder",
    "digits",
    "synthetic",
)
SPLITS: tuple[str, ...] = ("train", "test")
_TORCHVISION_NAMES = {
    "mnist": "MNIST",
    "fashion-mnist-torchvision": "FashionMNIST",
    "cifar10": "CIFAR10",
    "cifar100": "CIFAR100",
}
FASHION_MNIST_ROOT = Path("/usr/share/datasets/fashion-mnist")
TORCHVISION_ROOT = Path("data")  # torchvision's customary ./data, relative to the working directory
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")

# Per-channel statistics of the training splits (the usual published constants).
_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
GRAY_MODES = ("1", "L", "LA", "I", "I;16", "F")  # PIL modes read as one channel


def norm_stats(dataset: str, channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Fixed normalisation constants for ``channels``-channel images of ``dataset``.

    Fixed rather than measured because every device must normalise the same way: a mean taken
    over one device's own images would shift its inputs relative to the other devices' and the
    shared model would see differently scaled data on each. Known datasets keep their published
    constants; anything else gets a neutral 0.5 / 0.25 per channel (uint8 images span [0, 1]).
    """
    stats = _STATS.get("fashion-mnist" if dataset == "fashion-mnist-torchvision" else dataset)
    if stats is not None and len(stats[0]) == channels:
        return stats
    return (0.5,) * channels, (0.25,) * channels


@dataclass
class ArrayDataset:
    """A whole split as two tensors, so batching is slicing rather than per-sample Python."""

    images: Tensor  # uint8, (N, C, H, W)
    labels: Tensor  # int64, (N,)
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    name: str

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise DataError(
                f"{self.name}: images must be uint8 (N, C, H, W), got {self.images.dtype} {tuple(self.images.shape)}"
            )
        if self.labels.dtype != torch.int64 or self.labels.shape != (self.images.shape[0],):
            raise DataError(
                f"{self.name}: labels must be int64 with one per image, got {self.labels.dtype} "
                f"{tuple(self.labels.shape)}"
            )
        if not len(self.mean) == len(self.std) == self.images.shape[1]:
            raise DataError(
                f"{self.name}: mean/std need one value per channel ({self.images.shape[1]}), got "
                f"{len(self.mean)}/{len(self.std)}"
            )

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def channels(self) -> int:
        return int(self.images.shape[1])

    @property
    def image_size(self) -> tuple[int, int]:
        return int(self.images.shape[2]), int(self.images.shape[3])

    def subset(self, indices: Sequence[int] | np.ndarray | Tensor) -> ArrayDataset:
        """A device's shard; keeps class count and normalisation of the parent."""
        if not isinstance(indices, Tensor):
            indices = np.asarray(indices, dtype=np.int64)
        idx = torch.as_tensor(indices, dtype=torch.long)
        return ArrayDataset(self.images[idx], self.labels[idx], self.num_classes, self.mean, self.std, self.name)


# ---------------------------------------------------------------- IDX files

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike, field: str = "data.root") -> np.ndarray:
    """Read an IDX file (MNIST's format), gzipped or raw, detected by content not name.

    ``field`` starts the error messages: the setting that pointed here."""
    p = Path(path)
    raw = p.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(
            f"{field}: {str(p)!r} is not an IDX file (bad magic {raw[:4].hex()}); re-install or re-download it"
        )
    ndim = raw[3]
    header = 4 + 4 * ndim
    shape = tuple(int(d) for d in np.frombuffer(raw[4:header], dtype=">u4"))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise DataError(
            f"{field}: {str(p)!r} is truncated ({len(raw) - header} of {expected} data bytes); re-install "
            "or re-download it"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def find_idx(root: Path, stem: str) -> Path | None:
    """``root/stem.gz`` or ``root/stem``, whichever exists (gzipped first)."""
    for candidate in (root / f"{stem}.gz", root / stem):
        if candidate.is_file():
            return candidate
    return None


def _fashion_missing(root: Path) -> list[str]:
    stems = [f"{s}-{k}-idx{d}-ubyte" for s in ("train", "t10k") for k, d in (("images", 3), ("labels", 1))]
    return [f"{s}.gz" for s in stems if find_idx(root, s) is None]


def _fashion_fix(root: Path, missing: Sequence[str]) -> str:
    return (
        f"data.root: fashion-mnist files not found under {root} (missing {', '.join(missing)}); install them with "
        f"`apt-get install dataset-fashion-mnist` (or `bash scripts/install.sh` as root), "
        f"or point data.root at a folder holding them"
    )


def _load_fashion_idx(root: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    prefix = "train" if split == "train" else "t10k"
    images_path = find_idx(root, f"{prefix}-images-idx3-ubyte")
    labels_path = find_idx(root, f"{prefix}-labels-idx1-ubyte")
    if images_path is None or labels_path is None:
        raise DataError(_fashion_fix(root, _fashion_missing(root) or [f"{prefix}-images-idx3-ubyte.gz"]))
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise DataError(
            f"data.root: {images_path} {images.shape} and {labels_path} {labels.shape} do not pair up; re-install them"
        )
    return images[:, None], labels


def check_fashion_mnist(root: str | os.PathLike = FASHION_MNIST_ROOT) -> Path:
    """``root`` if it holds the four Fashion-MNIST IDX files, else a DataError saying how to install them.

    Nothing is installed from here: that is scripts/install.sh's job (it installs
    dataset-fashion-mnist when run as root).
    """
    path = Path(root)
    missing = _fashion_missing(path)
    if missing:
        raise DataError(_fashion_fix(path, missing))
    return path


# ---------------------------------------------------------------- torchvision formats


def _torchvision_missing(name: str, root: Path, expected: str) -> DataError:
    return DataError(
        f"data.root: {name} files not found under {root} (expected {expected}); on a machine with internet run "
        f"torchvision.datasets.{name}({str(root)!r}, download=True) and copy the folder here, or point data.root at it"
    )


def _load_torchvision(name: str, root: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    import torchvision.datasets as tvd

    train = split == "train"
    if name in ("MNIST", "FashionMNIST"):
        expected = str(root / name / "raw" / ("train-images-idx3-ubyte" if train else "t10k-images-idx3-ubyte"))
    else:
        expected = str(root / ("cifar-10-batches-py" if name == "CIFAR10" else "cifar-100-python"))
    try:
        ds = getattr(tvd, name)(str(root), train=train, download=False)
    except RuntimeError as exc:  # torchvision's "Dataset not found or corrupted"
        raise _torchvision_missing(name, root, expected) from exc
    if name in ("MNIST", "FashionMNIST"):
        return ds.data.numpy()[:, None], ds.targets.numpy()
    return np.ascontiguousarray(ds.data.transpose(0, 3, 1, 2)), np.asarray(ds.targets)


# ---------------------------------------------------------------- image folders


def class_dirs(folder: Path) -> list[str]:
    """Names of the non-hidden sub-folders of ``folder``, sorted."""
    return sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))


def image_files(folder: Path) -> list[Path]:
    """Images anywhere below ``folder``, sorted; hidden files and folders (``.DS_Store``, macOS ``._x.png``
    forks, ``.thumbnails/``) are skipped since they are not the user's images."""
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.suffix.lower() in IMAGE_EXTENSIONS
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def read_image(path: Path, mode: str, size: tuple[int, int] | None, field: str = "data.root") -> np.ndarray:
    """One image as uint8 (C, H, W) in PIL ``mode`` ("L" or "RGB"), resized to ``size`` (W, H) unless None.

    A file PIL cannot open or decode (corrupt, truncated, not an image) is a one-line DataError
    naming it, so one bad file on a device never ends in a traceback.
    """
    from PIL import Image

    with _readable(path, field), Image.open(path) as img:
        img = img.convert(mode)
        if size is not None and img.size != size:
            img = img.resize(size, Image.BILINEAR)
        arr = np.asarray(img, dtype=np.uint8)
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


@contextmanager
def _readable(path: Path, field: str) -> Iterator[None]:
    """Turn whatever PIL raises on a bad file (corrupt, truncated, not an image) into one line naming it."""
    from PIL import Image

    try:
        yield
    except Image.UnidentifiedImageError:
        reason = "not an image format PIL recognises"
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        reason = " ".join((str(exc) or type(exc).__name__).split())
    else:
        return
    raise DataError(f"{field}: image {path} cannot be read ({reason}); remove or replace it")


def _image_mode(path: Path, field: str = "data.root") -> tuple[bool, tuple[int, int]]:
    """(grayscale?, (W, H)) of the first image, which fixes a dataset's channels and size."""
    from PIL import Image

    with _readable(path, field), Image.open(path) as img:
        return img.mode in GRAY_MODES, img.size


def _load_imagefolder(root: Path, split: str) -> tuple[np.ndarray, np.ndarray, int, tuple, tuple]:
    """ImageFolder layout root/<split>/<class>/*.png; the train split fixes classes, size, channels and stats."""
    split_dir = root / split
    if not split_dir.is_dir():
        raise DataError(f"data.root: {split_dir} is not a folder; lay images out as {root}/<train|test>/<class>/*.png")
    reference = root / "train" if (root / "train").is_dir() else split_dir
    classes = class_dirs(reference)
    extra = sorted(set(class_dirs(split_dir)) - set(classes))
    if extra:
        raise DataError(
            f"data.root: class folder {extra[0]!r} in {split_dir} is absent from {reference}; add it there or remove it"
        )
    if not classes:
        raise DataError(f"data.root: no images under {reference}; expected {reference}/<class>/*.png or *.jpg")
    by_class = {c: image_files(reference / c) for c in classes}
    empty = [c for c in classes if not by_class[c]]
    if empty:  # counted as a class, it would add a label no image carries
        raise DataError(
            f"data.root: class folder {reference / empty[0]} holds no images ({', '.join(IMAGE_EXTENSIONS)}); "
            "add the class's images or remove the folder"
        )
    ref_files = [f for c in classes for f in by_class[c]]
    gray, size = _image_mode(ref_files[0])
    mode = "L" if gray else "RGB"
    files, labels = [], []
    for label, cls in enumerate(classes):
        if (split_dir / cls).is_dir():
            found = by_class[cls] if split_dir == reference else image_files(split_dir / cls)
            files += found
            labels += [label] * len(found)
    if not files:
        raise DataError(f"data.root: no images under {split_dir}; expected {split_dir}/<class>/*.png or *.jpg")
    images = np.stack([read_image(f, mode, size) for f in files])
    sample = [ref_files[i] for i in np.linspace(0, len(ref_files) - 1, min(512, len(ref_files))).astype(int)]
    ref = images if reference == split_dir else np.stack([read_image(f, mode, size) for f in sample])
    flat = ref.transpose(1, 0, 2, 3).reshape(ref.shape[1], -1).astype(np.float64) / 255.0
    mean = tuple(float(m) for m in flat.mean(axis=1))
    std = tuple(max(float(s), 1e-3) for s in flat.std(axis=1))
    return images, np.asarray(labels, dtype=np.int64), len(classes), mean, std


# ---------------------------------------------------------------- digits and synthetic


def _load_digits(split: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise DataError(
            "data.dataset: 'digits' needs scikit-learn; `pip install scikit-learn` or pick another dataset"
        ) from exc
    bunch = load_digits()
    images = np.rint(bunch.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)[:, None]
    order = np.random.default_rng(0).permutation(len(images))
    cut = int(round(0.8 * len(images)))
    idx = order[:cut] if split == "train" else order[cut:]
    return images[np.sort(idx)], bunch.target[np.sort(idx)]


def make_synthetic(
    split: str,
    *,
    num_classes: int = 10,
    channels: int = 1,
    size: int = 16,
    train_size: int = 2000,
    test_size: int = 500,
    seed: int = 0,
) -> ArrayDataset:
    """Toy data a CNN can learn in seconds: one smooth pattern per class, shifted by up to 2 px, plus noise.

    The shifts keep a nearest-class-mean classifier around 90%, so training has headroom.
    """
    _check_split(split)
    sizes = {
        "num_classes": num_classes,
        "channels": channels,
        "size": size,
        "train_size": train_size,
        "test_size": test_size,
    }
    for field, value in sizes.items():
        if value < 1:
            raise DataError(f"synthetic.{field}: got {value}; use a positive integer")
    proto_rng = np.random.default_rng([seed, 0])
    coarse = torch.tensor(proto_rng.random((num_classes, channels, 4, 4)), dtype=torch.float32)
    protos = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False).numpy()
    lo = protos.min(axis=(1, 2, 3), keepdims=True)
    hi = protos.max(axis=(1, 2, 3), keepdims=True)
    protos = (protos - lo) / np.maximum(hi - lo, 1e-6) * 180.0 + 40.0

    n = train_size if split == "train" else test_size
    rng = np.random.default_rng([seed, 1 if split == "train" else 2])
    labels = np.arange(n) % num_classes
    rng.shuffle(labels)
    images = protos[labels]
    shifts = rng.integers(-2, 3, size=(n, 2))
    for dy, dx in {tuple(s) for s in shifts.tolist()}:
        sel = np.flatnonzero((shifts[:, 0] == dy) & (shifts[:, 1] == dx))
        images[sel] = np.roll(images[sel], (dy, dx), axis=(2, 3))
    images = images + rng.normal(0.0, 60.0, images.shape)
    images = np.clip(np.rint(images), 0, 255).astype(np.uint8)
    # Normalisation constants come from the train split so test data is scaled the same way.
    mean, std = _synthetic_stats(num_classes, channels, size, train_size, seed) if split != "train" else _stats(images)
    labels_t = torch.from_numpy(labels.astype(np.int64))
    return ArrayDataset(torch.from_numpy(images), labels_t, num_classes, mean, std, "synthetic")


def _stats(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    flat = images.transpose(1, 0, 2, 3).reshape(images.shape[1], -1).astype(np.float64) / 255.0
    return tuple(float(m) for m in flat.mean(axis=1)), tuple(max(float(s), 1e-3) for s in flat.std(axis=1))


def _synthetic_stats(num_classes: int, channels: int, size: int, train_size: int, seed: int) -> tuple[tuple, tuple]:
    train = make_synthetic(
        "train", num_classes=num_classes, channels=channels, size=size, train_size=train_size, seed=seed
    )
    return train.mean, train.std


# ---------------------------------------------------------------- public loader


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise DataError(f"data.split: got {split!r}; use 'train' or 'test'")


def _select_classes(
    images: np.ndarray, labels: np.ndarray, num_classes: int, classes: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    wanted = [int(c) for c in classes]
    if not wanted:
        raise DataError("data.classes: empty list; name at least one class label or leave it unset for all")
    if len(set(wanted)) != len(wanted):
        raise DataError(f"data.classes: {wanted} repeats a label; list each class once")
    bad = [c for c in wanted if not 0 <= c < num_classes]
    if bad:
        raise DataError(f"data.classes: label {bad[0]} is outside 0..{num_classes - 1}; pick labels the dataset has")
    remap = np.full(num_classes, -1, dtype=np.int64)
    remap[wanted] = np.arange(len(wanted))
    new = remap[labels]
    keep = new >= 0
    return images[keep], new[keep]


def load_dataset(
    name: str,
    split: str,
    *,
    root: str | os.PathLike | None = None,
    classes: Sequence[int] | None = None,
) -> ArrayDataset:
    """Load a split into memory; ``classes`` keeps those labels, renumbered 0..len-1 in the order given."""
    if name not in DATASET_NAMES:
        raise DataError(f"data.dataset: unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    _check_split(split)
    if name == "synthetic":
        ds = make_synthetic(split)
        images, labels, num_classes = ds.images.numpy(), ds.labels.numpy(), ds.num_classes
        mean, std = ds.mean, ds.std
    elif name == "fashion-mnist":
        images, labels = _load_fashion_idx(Path(root) if root is not None else FASHION_MNIST_ROOT, split)
        num_classes, (mean, std) = 10, _STATS["fashion-mnist"]
    elif name in _TORCHVISION_NAMES:
        tv_name = _TORCHVISION_NAMES[name]
        images, labels = _load_torchvision(tv_name, Path(root) if root is not None else TORCHVISION_ROOT, split)
        num_classes = 100 if name == "cifar100" else 10
        mean, std = _STATS["fashion-mnist" if name == "fashion-mnist-torchvision" else name]
    elif name == "imagefolder":
        if root is None:
            raise DataError(
                "data.root: 'imagefolder' needs a root; set data.root to a folder holding train/<class>/*.png"
            )
        images, labels, num_classes, mean, std = _load_imagefolder(Path(root), split)
    else:  # digits
        images, labels = _load_digits(split)
        num_classes, (mean, std) = 10, _stats(_load_digits("train")[0])
    labels = np.asarray(labels, dtype=np.int64)
    if classes is not None:
        images, labels = _select_classes(images, labels, num_classes, classes)
        num_classes = len(classes)
    return ArrayDataset(
        torch.from_numpy(np.ascontiguousarray(images, dtype=np.uint8)),
        torch.from_numpy(np.ascontiguousarray(labels)),
        num_classes,
        tuple(mean),
        tuple(std),
        name,
    )


# ---------------------------------------------------------------- batching


def batches(
    ds: ArrayDataset,
    batch_size: int,
    *,
    shuffle: bool,
    generator: torch.Generator | None = None,
    input_size: int | None = None,
    drop_last: bool = False,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield normalised float32 (x, y) batches; whole-batch tensor ops keep the CPU on the model, not the loader."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise DataError(f"train.batch_size: got {batch_size!r}; use a positive integer")
    if input_size is not None and (isinstance(input_size, bool) or not isinstance(input_size, int) or input_size < 1):
        raise DataError(
            f"data.input_size: got {input_size!r}; use a positive integer or leave it unset to keep the stored size"
        )
    n = len(ds)
    order = torch.randperm(n, generator=generator) if shuffle else None
    c = ds.channels
    scale = (1.0 / (255.0 * torch.tensor(ds.std, dtype=torch.float32))).view(1, c, 1, 1)
    shift = (torch.tensor(ds.mean, dtype=torch.float32) / torch.tensor(ds.std, dtype=torch.float32)).view(1, c, 1, 1)
    resize = input_size is not None and ds.image_size != (input_size, input_size)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        end = min(start + batch_size, n)
        if order is None:
            x, y = ds.images[start:end], ds.labels[start:end]
        else:
            idx = order[start:end]
            x, y = ds.images.index_select(0, idx), ds.labels.index_select(0, idx)
        x = x.to(torch.float32).mul_(scale).sub_(shift)
        if resize:
            x = F.interpolate(x, size=(input_size, input_size), mode="bilinear", align_corners=False)
        yield x, y

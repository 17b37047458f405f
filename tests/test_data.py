"""Datasets from local files and the batch iterator."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fleet.base.errors import DataError
from fleet.data.datasets import (
    DATASET_NAMES,
    FASHION_MNIST_ROOT,
    ArrayDataset,
    batches,
    check_fashion_mnist,
    load_dataset,
    make_synthetic,
    read_idx,
)


def _idx_bytes(arr: np.ndarray) -> bytes:
    code = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C}[arr.dtype]
    return bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()


def _write_idx(path: Path, arr: np.ndarray, gz: bool) -> None:
    data = _idx_bytes(arr)
    path.write_bytes(gzip.compress(data) if gz else data)


def _fake_mnist_dir(
    folder: Path, n_train: int = 30, n_test: int = 12, gz: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Write the four MNIST-style IDX files; the train pair gzipped (if gz), the test pair raw."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    train_x = rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8)
    train_y = (np.arange(n_train) % 10).astype(np.uint8)
    test_x = rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8)
    test_y = (np.arange(n_test) % 10).astype(np.uint8)[::-1].copy()
    suffix = ".gz" if gz else ""
    _write_idx(folder / f"train-images-idx3-ubyte{suffix}", train_x, gz)
    _write_idx(folder / f"train-labels-idx1-ubyte{suffix}", train_y, gz)
    _write_idx(folder / "t10k-images-idx3-ubyte", test_x, False)
    _write_idx(folder / "t10k-labels-idx1-ubyte", test_y, False)
    return train_x, test_y


# ---------------------------------------------------------------- IDX


@pytest.mark.parametrize("gz", [True, False])
def test_read_idx_round_trips(tmp_path: Path, gz: bool) -> None:
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    ints = np.array([[1, -2, 70000]], dtype=">i4")
    _write_idx(tmp_path / "a", images, gz)
    _write_idx(tmp_path / "b", ints, gz)
    got = read_idx(tmp_path / "a")
    assert got.dtype == np.uint8 and got.shape == (2, 3, 4) and np.array_equal(got, images)
    got = read_idx(tmp_path / "b")
    assert got.tolist() == [[1, -2, 70000]] and got.dtype.isnative


def test_read_idx_rejects_bad_and_truncated_files(tmp_path: Path) -> None:
    (tmp_path / "bad").write_bytes(b"\x1f\x00\x08\x01" + b"\x00" * 8)
    with pytest.raises(DataError, match="not an IDX file"):
        read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(_idx_bytes(np.zeros((4, 4), np.uint8))[:-3])
    with pytest.raises(DataError, match="truncated"):
        read_idx(tmp_path / "short")


def test_fashion_mnist_loader_reads_gz_and_raw(tmp_path: Path) -> None:
    train_x, test_y = _fake_mnist_dir(tmp_path)
    train = load_dataset("fashion-mnist", "train", root=tmp_path)
    test = load_dataset("fashion-mnist", "test", root=tmp_path)
    assert train.images.shape == (30, 1, 28, 28) and train.images.dtype == torch.uint8
    assert np.array_equal(train.images[:, 0].numpy(), train_x)
    assert train.labels.dtype == torch.int64 and train.labels[:12].tolist() == list(range(10)) + [0, 1]
    assert test.labels.tolist() == test_y.tolist()
    assert (train.num_classes, train.channels, train.mean, train.std) == (10, 1, (0.2860,), (0.3530,))


@pytest.mark.skipif(
    not (FASHION_MNIST_ROOT / "t10k-labels-idx1-ubyte.gz").exists(), reason="dataset-fashion-mnist not installed"
)
def test_real_debian_fashion_mnist() -> None:
    train = load_dataset("fashion-mnist", "train")
    test = load_dataset("fashion-mnist", "test")
    assert train.images.shape == (60000, 1, 28, 28) and len(test) == 10000
    assert sorted(train.labels.unique().tolist()) == list(range(10))
    assert torch.bincount(test.labels).tolist() == [1000] * 10
    pixels = train.images.float() / 255
    assert abs(float(pixels.mean()) - train.mean[0]) < 1e-3 and abs(float(pixels.std()) - train.std[0]) < 1e-3
    assert check_fashion_mnist() == FASHION_MNIST_ROOT


def test_torchvision_mnist_layout(tmp_path: Path) -> None:
    train_x, test_y = _fake_mnist_dir(tmp_path / "MNIST" / "raw", gz=False)
    train = load_dataset("mnist", "train", root=tmp_path)
    test = load_dataset("mnist", "test", root=tmp_path)
    assert train.images.shape == (30, 1, 28, 28) and np.array_equal(train.images[:, 0].numpy(), train_x)
    assert test.labels.tolist() == test_y.tolist() and test.mean == (0.1307,)


# ---------------------------------------------------------------- selection and subsets


def test_classes_are_kept_and_renumbered_in_given_order(tmp_path: Path) -> None:
    _fake_mnist_dir(tmp_path)
    full = load_dataset("fashion-mnist", "train", root=tmp_path)
    part = load_dataset("fashion-mnist", "train", root=tmp_path, classes=[7, 5, 6])
    assert part.num_classes == 3 and len(part) == 9  # 30 samples, labels cycle 0..9: three each
    keep = (full.labels == 5) | (full.labels == 6) | (full.labels == 7)
    assert torch.equal(part.images, full.images[keep])
    expected = {7: 0, 5: 1, 6: 2}
    assert part.labels.tolist() == [expected[int(v)] for v in full.labels[keep]]


@pytest.mark.parametrize("classes,text", [([], "empty"), ([1, 1], "repeats"), ([3, 10], "label 10 is outside 0..9")])
def test_bad_class_selection(classes: list[int], text: str) -> None:
    with pytest.raises(DataError, match=f"data.classes: .*{text}"):
        load_dataset("synthetic", "test", classes=classes)


def test_subset_keeps_metadata() -> None:
    ds = load_dataset("synthetic", "test")
    sub = ds.subset(np.array([4, 0, 4]))
    assert len(sub) == 3 and torch.equal(sub.images[0], ds.images[4]) and torch.equal(sub.images[1], ds.images[0])
    assert (sub.num_classes, sub.mean, sub.std, sub.name) == (ds.num_classes, ds.mean, ds.std, ds.name)
    assert len(ds.subset([])) == 0


def test_array_dataset_validates_tensors() -> None:
    with pytest.raises(DataError, match="uint8"):
        ArrayDataset(torch.zeros(2, 1, 4, 4), torch.zeros(2, dtype=torch.int64), 2, (0.5,), (0.5,), "x")
    with pytest.raises(DataError, match="one per image"):
        ArrayDataset(
            torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.zeros(3, dtype=torch.int64), 2, (0.5,), (0.5,), "x"
        )


# ---------------------------------------------------------------- batches


def _tiny() -> ArrayDataset:
    images = torch.arange(10 * 2 * 4 * 4, dtype=torch.int64).remainder(256).to(torch.uint8).view(10, 2, 4, 4)
    return ArrayDataset(images, torch.arange(10), 10, (0.5, 0.25), (0.5, 0.125), "tiny")


def test_batches_normalise_in_order_without_shuffle() -> None:
    ds = _tiny()
    out = list(batches(ds, 4, shuffle=False))
    assert [len(y) for _, y in out] == [4, 4, 2]
    x, y = out[0]
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape == (4, 2, 4, 4)
    assert y.tolist() == [0, 1, 2, 3]
    raw = ds.images[:4].float() / 255
    expected = torch.stack([(raw[:, 0] - 0.5) / 0.5, (raw[:, 1] - 0.25) / 0.125], dim=1)
    assert torch.allclose(x, expected, atol=1e-5)
    assert [len(y) for _, y in batches(ds, 4, shuffle=False, drop_last=True)] == [4, 4]


def test_batches_resize_to_input_size() -> None:
    ds = load_dataset("synthetic", "test")
    x, _ = next(batches(ds, 8, shuffle=False, input_size=32))
    assert x.shape == (8, 1, 32, 32)
    same, _ = next(batches(ds, 8, shuffle=False, input_size=16))
    plain, _ = next(batches(ds, 8, shuffle=False))
    assert torch.equal(same, plain)
    # bilinear resize preserves the mean of a smooth image closely
    assert abs(float(x.mean()) - float(plain.mean())) < 0.05


def test_shuffle_is_seeded_and_covers_every_sample_once() -> None:
    ds = _tiny()

    def order(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [int(v) for _, y in batches(ds, 3, shuffle=True, generator=gen) for v in y]

    a, b, c = order(7), order(7), order(8)
    assert a == b and sorted(a) == list(range(10))
    assert a != c and a != list(range(10))
    # images travel with their labels
    gen = torch.Generator().manual_seed(7)
    for x, y in batches(ds, 3, shuffle=True, generator=gen):
        ref = next(batches(ds.subset(y), 3, shuffle=False))[0]
        assert torch.equal(x, ref)


@pytest.mark.parametrize(
    "kwargs,field", [({"batch_size": 0}, "train.batch_size"), ({"batch_size": 2, "input_size": 0}, "data.input_size")]
)
def test_batches_reject_bad_sizes(kwargs: dict, field: str) -> None:
    with pytest.raises(DataError, match=field):
        next(batches(_tiny(), shuffle=False, **kwargs))


# ---------------------------------------------------------------- synthetic, digits, imagefolder


def test_synthetic_is_deterministic_and_learnable() -> None:
    train, test = load_dataset("synthetic", "train"), load_dataset("synthetic", "test")
    again = load_dataset("synthetic", "train")
    assert torch.equal(train.images, again.images) and torch.equal(train.labels, again.labels)
    assert (len(train), len(test), train.num_classes, train.images.shape[1:]) == (2000, 500, 10, (1, 16, 16))
    assert train.mean == test.mean and train.std == test.std
    assert torch.bincount(train.labels).tolist() == [200] * 10
    assert not torch.equal(train.images[:500], test.images)
    means = torch.stack([train.images[train.labels == c].float().flatten(1).mean(0) for c in range(10)])
    pred = torch.cdist(test.images.float().flatten(1), means).argmin(1)
    accuracy = float((pred == test.labels).float().mean())
    assert 0.8 < accuracy < 1.0  # learnable, but not trivially separable


def test_make_synthetic_is_configurable() -> None:
    ds = make_synthetic("train", num_classes=3, channels=3, size=8, train_size=30, seed=5)
    assert ds.images.shape == (30, 3, 8, 8) and ds.num_classes == 3 and len(ds.mean) == 3
    other = make_synthetic("train", num_classes=3, channels=3, size=8, train_size=30, seed=6)
    assert not torch.equal(ds.images, other.images)


def test_digits_needs_sklearn_or_loads_split() -> None:
    try:
        import sklearn  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match="scikit-learn"):
            load_dataset("digits", "train")
        return
    train, test = load_dataset("digits", "train"), load_dataset("digits", "test")
    assert len(train) + len(test) == 1797 and len(test) == 359
    assert train.images.shape[1:] == (1, 8, 8) and int(train.images.max()) == 255


def test_imagefolder(tmp_path: Path) -> None:
    from PIL import Image

    for split, per_class in (("train", 3), ("test", 1)):
        for cls, value in (("cat", 40), ("dog", 200)):
            folder = tmp_path / split / cls
            folder.mkdir(parents=True)
            for i in range(per_class):
                size = (6, 4) if (split, cls, i) == ("test", "dog", 0) else (4, 4)  # odd size gets resized
                Image.new("RGB", size, (value, value + i, 0)).save(folder / f"{i}.png")
    train = load_dataset("imagefolder", "train", root=tmp_path)
    test = load_dataset("imagefolder", "test", root=tmp_path)
    assert train.images.shape == (6, 3, 4, 4) and train.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert test.images.shape == (2, 3, 4, 4) and test.labels.tolist() == [0, 1]
    assert int(test.images[1, 0, 0, 0]) == 200
    assert test.mean == train.mean and abs(train.mean[2]) < 1e-9
    assert abs(train.mean[0] - (40 + 200) / 2 / 255) < 1e-6

    (tmp_path / "test" / "bird").mkdir()
    with pytest.raises(DataError, match="class folder 'bird'"):
        load_dataset("imagefolder", "test", root=tmp_path)


# ---------------------------------------------------------------- errors


def test_unknown_name_and_bad_split() -> None:
    with pytest.raises(DataError) as info:
        load_dataset("imagenet", "train")
    assert "data.dataset" in str(info.value) and all(n in str(info.value) for n in DATASET_NAMES)
    with pytest.raises(DataError, match="data.split: got 'val'; use 'train' or 'test'"):
        load_dataset("synthetic", "val")


@pytest.mark.parametrize(
    "name", ["fashion-mnist", "mnist", "fashion-mnist-torchvision", "cifar10", "cifar100", "imagefolder"]
)
def test_missing_files_say_how_to_fix(tmp_path: Path, name: str) -> None:
    with pytest.raises(DataError) as info:
        load_dataset(name, "train", root=tmp_path / "empty")
    msg = str(info.value)
    assert msg.startswith("data.root:") and str(tmp_path / "empty") in msg and "\n" not in msg
    if name == "fashion-mnist":
        assert "missing train-images-idx3-ubyte.gz" in msg and "apt-get install dataset-fashion-mnist" in msg
    elif name != "imagefolder":
        assert "download=True" in msg


def test_imagefolder_needs_root() -> None:
    with pytest.raises(DataError, match="data.root: 'imagefolder' needs a root"):
        load_dataset("imagefolder", "train")


def test_check_fashion_mnist_names_missing_files_and_install_command(tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        check_fashion_mnist(tmp_path)
    msg = str(info.value)
    assert "\n" not in msg and str(tmp_path) in msg
    for stem in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        assert f"{stem}.gz" in msg
    assert "`apt-get install dataset-fashion-mnist`" in msg and "scripts/install.sh" in msg and "data.root" in msg
    _fake_mnist_dir(tmp_path)
    assert check_fashion_mnist(tmp_path) == tmp_path


def test_check_fashion_mnist_names_only_what_is_missing(tmp_path: Path) -> None:
    _fake_mnist_dir(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match=r"\(missing t10k-labels-idx1-ubyte\.gz\)"):
        check_fashion_mnist(tmp_path)


def test_check_fashion_mnist_never_installs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even as root, with apt-get present and the default root empty, the loader only reports."""
    import os
    import shutil
    import subprocess

    import fleet.data.datasets

    def refuse(*args, **kwargs):
        raise AssertionError(f"the data loader tried to run {args[0] if args else kwargs}")

    for name in ("run", "call", "check_call", "check_output", "Popen"):
        monkeypatch.setattr(subprocess, name, refuse)
    monkeypatch.setattr(shutil, "which", lambda cmd, *a, **k: f"/usr/bin/{cmd}")
    monkeypatch.setattr(os, "geteuid", lambda: 0, raising=False)
    monkeypatch.setattr(fleet.data.datasets, "FASHION_MNIST_ROOT", tmp_path)
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        check_fashion_mnist(tmp_path)
    assert not (tmp_path / "train-images-idx3-ubyte.gz").exists()

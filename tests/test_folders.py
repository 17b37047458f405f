"""Device-owned data: a device's image tree mapped by class name onto the fleet's label space."""

from __future__ import annotations

import gzip
import struct
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from fleet.base.errors import ConfigError, DataError
from fleet.cli import main
from fleet.data.datasets import _STATS, load_dataset, norm_stats
from fleet.data.folders import OwnedData, held_out, load_owned
from fleet.engine.config import config_from_dict
from fleet.federated.shared.config import fleet_config_from_dict
from fleet.federated.shared.owned import device_roots, owned_data
from fleet.federated.shared.paths import APP_ROOT

# Fashion-MNIST's classes in label order ('T-shirt/top' holds a '/', which no folder name can).
NAMES = ["tshirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"]
FIELD = "node config data-root"


@pytest.fixture(scope="module")
def fashion() -> dict[str, np.ndarray]:
    """A dozen real 28x28 Fashion-MNIST images per class, keyed by class name."""
    ds = load_dataset("fashion-mnist", "train")
    images, labels = ds.images[:2000, 0].numpy(), ds.labels[:2000].numpy()
    return {name: images[labels == i][:12] for i, name in enumerate(NAMES)}


def write_tree(folder: Path, fashion: dict[str, np.ndarray], counts: dict[str, int]) -> None:
    """``folder/<class>/NNN.png`` from the real images of each class (a misspelt 'Sneaker' gets sneakers)."""
    for name, n in counts.items():
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(fashion[name.lower()][i]).save(folder / name / f"{i:03d}.png")


def load(root: Path, **kw) -> OwnedData:
    args = dict(channels=1, size=16, mean=(0.5,), std=(0.25,), test_fraction=0.25, seed=0, field=FIELD)
    return load_owned(root, kw.pop("class_names", NAMES), **{**args, **kw})


def as_set(images: torch.Tensor) -> set[bytes]:
    return {img.numpy().tobytes() for img in images}


# ---------------------------------------------------------------- mapping, counts, split


def test_labels_map_by_name_and_counts(tmp_path: Path, fashion) -> None:
    write_tree(tmp_path, fashion, {"sneaker": 5, "bag": 7})
    data = load(tmp_path)
    assert data.layout == "imagefolder"
    assert sorted(set(data.train.labels.tolist()) | set(data.test.labels.tolist())) == [7, 8]
    assert data.counts["sneaker"] == (4, 1) and data.counts["bag"] == (5, 2)  # round(5/4) = 1, round(7/4) = 2
    assert list(data.counts) == NAMES and all(data.counts[n] == (0, 0) for n in NAMES if n not in ("sneaker", "bag"))
    assert data.train.images.shape == (9, 1, 16, 16) and data.test.images.shape == (3, 1, 16, 16)
    assert data.train.images.dtype == torch.uint8 and data.train.num_classes == 10 == data.test.num_classes
    assert (data.train.mean, data.train.std, data.train.name) == ((0.5,), (0.25,), "owned")


def test_a_folder_name_stored_decomposed_matches_its_class(tmp_path: Path, fashion) -> None:
    """macOS stores 'décor' as 'de' + a combining accent (NFD): the same name to a reader, and to fleet."""
    names = [*NAMES[:-1], unicodedata.normalize("NFC", "bo\u0302te")]  # 'boîte', composed as typed in YAML
    decomposed = unicodedata.normalize("NFD", names[-1])
    assert decomposed != names[-1]
    (tmp_path / decomposed).mkdir()
    for i in range(4):
        Image.fromarray(fashion["boot"][i]).save(tmp_path / decomposed / f"{i:03d}.png")
    write_tree(tmp_path, fashion, {"bag": 4})
    data = load(tmp_path, class_names=names)
    assert data.counts[names[-1]] == (3, 1) and data.counts["bag"] == (3, 1)


def test_images_are_the_files_pixels(tmp_path: Path, fashion) -> None:
    write_tree(tmp_path, fashion, {"bag": 6, "coat": 4})
    data = load(tmp_path, size=28)
    for label, name, n in ((8, "bag", 6), (4, "coat", 4)):
        got = as_set(data.train.images[data.train.labels == label]) | as_set(
            data.test.images[data.test.labels == label]
        )
        assert got == {img[None].tobytes() for img in fashion[name][:n]}


def test_resize_and_rgb(tmp_path: Path, fashion) -> None:
    write_tree(tmp_path, fashion, {"dress": 4, "shirt": 4})
    data = load(tmp_path, channels=3, size=20, mean=(0.5,) * 3, std=(0.25,) * 3)
    assert data.train.images.shape == (6, 3, 20, 20) and data.test.images.shape == (2, 3, 20, 20)
    rgb = data.train.images
    assert torch.equal(rgb[:, 0], rgb[:, 1]) and torch.equal(rgb[:, 1], rgb[:, 2])  # grey source, grey RGB
    assert rgb.float().std() > 10  # real content, not a blank


def test_split_is_deterministic_and_stratified(tmp_path: Path, fashion) -> None:
    write_tree(tmp_path, fashion, {"tshirt": 12, "trouser": 10, "boot": 2, "sandal": 1})
    first, again, other = load(tmp_path), load(tmp_path), load(tmp_path, seed=1)
    assert torch.equal(first.train.images, again.train.images) and torch.equal(first.test.labels, again.test.labels)
    assert torch.equal(first.test.images, again.test.images)
    assert as_set(first.test.images) != as_set(other.test.images)
    assert first.counts == other.counts  # the seed picks which images, not how many
    assert first.counts["tshirt"] == (9, 3) and first.counts["trouser"] == (8, 2)
    assert first.counts["boot"] == (1, 1)  # >= 2 images: one on each side
    assert first.counts["sandal"] == (1, 0)  # a single image trains
    assert not as_set(first.train.images) & as_set(first.test.images)


def test_held_out_per_class_streams() -> None:
    labels = np.array([0] * 10 + [1] * 10)
    train, test = held_out(labels, 0.3, seed=5)
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(20)) and len(test) == 6
    more = np.array([0] * 10 + [1] * 10 + [0] * 4)  # class 0 gains images: class 1's split stays
    _, test_more = held_out(more, 0.3, seed=5)
    assert [i for i in test.tolist() if i >= 10] == [i for i in test_more.tolist() if 10 <= i < 20]


def test_split_layout_uses_the_devices_test_folder(tmp_path: Path, fashion) -> None:
    write_tree(tmp_path / "train", fashion, {"coat": 6, "bag": 5})
    write_tree(tmp_path / "test", fashion, {"bag": 2, "pullover": 3})
    data = load(tmp_path)
    assert data.layout == "split"
    assert (data.counts["coat"], data.counts["bag"], data.counts["pullover"]) == ((6, 0), (5, 2), (0, 3))
    assert data.test.labels.tolist() == [2, 2, 2, 8, 8]
    held = load(tmp_path / "train")  # a plain tree: held out
    assert held.layout == "imagefolder" and held.counts["coat"] == (4, 2)
    (tmp_path / "test").rename(tmp_path / "elsewhere")
    assert load(tmp_path).counts["coat"] == (4, 2)


def _idx_bytes(arr: np.ndarray) -> bytes:
    return bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()


def test_idx_layout(tmp_path: Path, fashion) -> None:
    images = np.concatenate([fashion["bag"][:8], fashion["boot"][:4]])
    labels = np.array([8] * 8 + [9] * 4, dtype=np.uint8)
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(images)))
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx_bytes(labels))
    data = load(tmp_path, size=28)
    assert data.layout == "idx" and data.counts["bag"] == (6, 2) and data.counts["boot"] == (3, 1)
    assert as_set(data.train.images) | as_set(data.test.images) == {img[None].tobytes() for img in images}
    assert load(tmp_path).train.images.shape[2:] == (16, 16)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx_bytes(np.array([8] * 11 + [12], dtype=np.uint8)))
    with pytest.raises(DataError) as info:
        load(tmp_path)
    msg = str(info.value)
    assert msg.startswith(FIELD) and "train-labels-idx1-ubyte" in msg and "label 12" in msg and "\n" not in msg


# ---------------------------------------------------------------- bad trees: one line naming the place


def _bad_trees(root: Path, fashion) -> dict[str, tuple[Path, str]]:
    """Case -> (root to load, text the message must name)."""
    write_tree(root / "unknown", fashion, {"bag": 3, "Sneaker": 2})
    write_tree(root / "empty", fashion, {"bag": 3})
    (root / "empty" / "coat" / ".hidden").mkdir(parents=True)
    (root / "empty" / "coat" / ".hidden" / "x.png").write_bytes(b"")
    write_tree(root / "corrupt", fashion, {"bag": 3})
    (root / "corrupt" / "bag" / "x.png").write_bytes(b"not a png at all")
    write_tree(root / "truncated", fashion, {"bag": 3})
    whole = (root / "truncated" / "bag" / "000.png").read_bytes()
    (root / "truncated" / "bag" / "000.png").write_bytes(whole[: len(whole) // 2])
    (root / "nothing").mkdir()
    (root / "nothing" / "loose.png").write_bytes(whole)
    (root / "a-file").write_text("x")
    return {
        "missing": (root / "missing", f"{root / 'missing'} is not a folder"),
        "file": (root / "a-file", f"{root / 'a-file'} is not a folder"),
        "unknown": (root / "unknown", "class folder 'Sneaker' in"),
        "empty": (root / "empty", f"class folder {root / 'empty' / 'coat'} holds no images"),
        "corrupt": (root / "corrupt", f"image {root / 'corrupt' / 'bag' / 'x.png'} cannot be read"),
        "truncated": (root / "truncated", f"image {root / 'truncated' / 'bag' / '000.png'} cannot be read"),
        "nothing": (root / "nothing", f"no class folders in {root / 'nothing'}"),
    }


def test_bad_trees_raise_one_line_naming_the_place(tmp_path: Path, fashion) -> None:
    for case, (root, named) in _bad_trees(tmp_path, fashion).items():
        with pytest.raises(DataError) as info:
            load(root)
        msg = str(info.value)
        assert msg.startswith(f"{FIELD}: ") and named in msg and "\n" not in msg, (case, msg)
        if case == "unknown":
            assert "(tshirt, trouser, " in msg and "data.class_names" in msg and "did you mean 'sneaker'" in msg
    with pytest.raises(DataError, match=r"^data\.class_names: not set; list the fleet's class names"):
        load(tmp_path / "unknown", class_names=None)


def test_hidden_entries_are_ignored(tmp_path: Path, fashion) -> None:
    write_tree(tmp_path, fashion, {"bag": 4})
    (tmp_path / ".cache").mkdir()
    (tmp_path / "bag" / "._000.png").write_bytes(b"macOS resource fork")
    (tmp_path / "bag" / "notes.txt").write_text("not an image")
    write_tree(tmp_path / "bag" / "more", fashion, {"bag": 2})  # nested inside the class folder: found
    assert load(tmp_path).counts["bag"] == (4, 2)


# ---------------------------------------------------------------- data.py: shared reader, stats


def test_imagefolder_corrupt_image_and_empty_class(tmp_path: Path, fashion) -> None:
    write_tree(tmp_path / "train", fashion, {"bag": 3, "coat": 3})
    assert load_dataset("imagefolder", "train", root=tmp_path).num_classes == 2
    (tmp_path / "train" / "boot").mkdir()
    with pytest.raises(DataError) as info:
        load_dataset("imagefolder", "train", root=tmp_path)
    assert str(info.value).startswith(f"data.root: class folder {tmp_path / 'train' / 'boot'} holds no images")
    (tmp_path / "train" / "boot").rmdir()
    bad = tmp_path / "train" / "coat" / "x.png"
    bad.write_bytes(b"\x89PNG garbage")
    with pytest.raises(DataError) as info:
        load_dataset("imagefolder", "train", root=tmp_path)
    msg = str(info.value)
    assert msg.startswith(f"data.root: image {bad} cannot be read (") and "remove or replace it" in msg
    assert "\n" not in msg


def test_norm_stats_are_fixed_per_dataset() -> None:
    assert norm_stats("fashion-mnist", 1) == _STATS["fashion-mnist"]
    assert norm_stats("cifar10", 3) == _STATS["cifar10"]
    assert norm_stats("fashion-mnist", 3) == ((0.5,) * 3, (0.25,) * 3)  # known dataset, other channel count
    assert norm_stats("imagefolder", 1) == ((0.5,), (0.25,))


# ---------------------------------------------------------------- config


def test_config_validates_class_names_and_device_roots() -> None:
    ok = config_from_dict({"data": {"class_names": NAMES, "device_roots": "devices"}})
    assert ok.data.class_names == NAMES and ok.data.device_roots == "devices"
    cases = [
        ({"data": {"class_names": ["a", "a"]}, "model": {"num_classes": 2}}, "data.class_names: ['a', 'a']"),
        ({"data": {"class_names": ["a/b", "c"]}, "model": {"num_classes": 2}}, "without '/'"),
        ({"data": {"class_names": [".a", "b"]}, "model": {"num_classes": 2}}, "not starting with '.'"),
        ({"data": {"class_names": ["", "b"]}, "model": {"num_classes": 2}}, "non-empty"),
        ({"data": {"class_names": ["a"]}, "model": {"num_classes": 2}}, ">= 2"),
        ({"data": {"class_names": ["a", "b", "c"]}}, "data.class_names: lists 3 classes but model.num_classes is 10"),
        ({"data": {"device_roots": "devices"}}, "data.device_roots: needs data.class_names"),
    ]
    for data, text in cases:
        for build in (config_from_dict, fleet_config_from_dict):
            with pytest.raises(ConfigError) as info:
                build(data)
            assert text in str(info.value) and "\n" not in str(info.value), (data, str(info.value))


def test_device_roots_lists_the_device_folders(tmp_path: Path) -> None:
    for name in ("pi-b", "pi-a", ".hidden"):
        (tmp_path / "devices" / name).mkdir(parents=True)
    (tmp_path / "devices" / "readme.txt").write_text("x")
    cfg = fleet_config_from_dict({"data": {"class_names": NAMES, "device_roots": str(tmp_path / "devices")}})
    assert device_roots(cfg) == [tmp_path / "devices" / "pi-a", tmp_path / "devices" / "pi-b"]
    for target, text in (("missing", "is not a folder"), ("devices/pi-a", "holds no device sub-folders")):
        cfg.data.device_roots = str(tmp_path / target)
        with pytest.raises(DataError, match=rf"^data\.device_roots: {tmp_path / target} {text}"):
            device_roots(cfg)
    cfg.data.device_roots = None
    with pytest.raises(ConfigError, match=r"^data\.device_roots: not set"):
        device_roots(cfg)


def test_owned_data_takes_the_fleet_settings(tmp_path: Path, fashion) -> None:
    write_tree(tmp_path, fashion, {"bag": 8})
    cfg = fleet_config_from_dict(
        {"data": {"dataset": "fashion-mnist", "class_names": NAMES, "input_size": 24}, "train": {"seed": 3}}
    )
    data = owned_data(cfg, tmp_path, "data.device_roots")
    assert data.train.images.shape[1:] == (1, 24, 24) and data.counts["bag"] == (6, 2)
    assert (data.train.mean, data.train.std) == _STATS["fashion-mnist"]
    assert torch.equal(data.test.images, load(tmp_path, size=24, seed=3).test.images)


# ---------------------------------------------------------------- fleet device check


@pytest.fixture
def fleet_yaml(tmp_path: Path) -> Path:
    data = yaml.safe_load((APP_ROOT / "simulations" / "fleet-tiny.yaml").read_text())
    data["data"]["class_names"] = NAMES
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_device_check_prints_mapping_and_counts(tmp_path: Path, fashion, fleet_yaml: Path, capsys) -> None:
    write_tree(tmp_path / "pi", fashion, {"sneaker": 8, "bag": 4})
    assert main(["device", "check", "--config", str(fleet_yaml), "--data-root", str(tmp_path / "pi")]) == 0
    out = capsys.readouterr().out
    assert "layout: imagefolder" in out
    rows = {
        line.split()[1]: line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()
    }
    assert rows["sneaker"] == ["7", "sneaker", "yes", "6", "2"] and rows["bag"] == ["8", "bag", "yes", "3", "1"]
    assert rows["tshirt"] == ["0", "tshirt", "-", "0", "0"] and len(rows) == 10
    assert "2 of 10 classes, 9 train + 3 test images" in out
    assert "25.0% of the images" in out and "devices.test_fraction=0.25" in out
    assert "warning: 9 training images, fewer than one batch (train.batch_size 16)" in out
    argv = ["device", "check", "-c", str(fleet_yaml), "--data-root", str(tmp_path / "pi"), "--set", "train.seed=4"]
    assert main(argv) == 0


def test_a_device_too_small_to_hold_out_a_test_split_is_refused(tmp_path, fashion, fleet_yaml, capsys) -> None:
    write_tree(tmp_path / "one", fashion, {"bag": 1})
    assert main(["device", "check", "--config", str(fleet_yaml), "--data-root", str(tmp_path / "one")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --data-root: {tmp_path / 'one'} holds 1 images, too few for both a training split")


def test_device_check_bad_trees_exit_2_with_one_line(tmp_path: Path, fashion, fleet_yaml: Path, capsys) -> None:
    cases = _bad_trees(tmp_path / "trees", fashion)
    for case in ("unknown", "empty", "corrupt", "missing"):
        root, named = cases[case]
        assert main(["device", "check", "--config", str(fleet_yaml), "--data-root", str(root)]) == 2, case
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --data-root: ") and named in lines[0], (case, lines)
        assert captured.out == ""

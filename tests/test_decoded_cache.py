"""A deployed device's decoded images, kept in its state directory between messages (fleet.data.decoded)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import fleet.data.folders as folders
from fleet.base.errors import DataError
from tests.test_folders import NAMES, load, write_tree


@pytest.fixture(scope="module")
def fashion() -> dict[str, np.ndarray]:
    """A dozen random 28x28 images per class: the cache must hand back exactly what decoding gives."""
    rng = np.random.default_rng(0)
    return {name: rng.integers(0, 256, (12, 28, 28), dtype=np.uint8) for name in NAMES}


def no_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any image decode: what is loaded now must come from the cache."""

    def refuse(*_a, **_k):
        raise AssertionError("an image was decoded although the tree is unchanged")

    monkeypatch.setattr(folders, "read_image", refuse)


def same(a, b) -> bool:
    return torch.equal(a.train.images, b.train.images) and torch.equal(a.test.images, b.test.images)


def test_an_unchanged_tree_is_read_from_the_cache_exactly(tmp_path: Path, fashion, monkeypatch) -> None:
    tree, cache = tmp_path / "tree", tmp_path / "state" / "decoded"
    write_tree(tree, fashion, {"sneaker": 6, "bag": 9})
    first = load(tree, cache_dir=cache)
    assert len(list(cache.glob("*.npy"))) == 1
    no_decoding(monkeypatch)
    again = load(tree, cache_dir=cache)
    assert same(first, again)
    assert torch.equal(first.train.labels, again.train.labels) and again.counts == first.counts


def test_an_added_or_replaced_image_is_decoded_again(tmp_path: Path, fashion) -> None:
    tree, cache = tmp_path / "tree", tmp_path / "decoded"
    write_tree(tree, fashion, {"sneaker": 6, "bag": 9})
    load(tree, cache_dir=cache)
    Image.fromarray(fashion["bag"][11]).save(tree / "bag" / "999.png")  # added
    added = load(tree, cache_dir=cache)
    assert len(added.train) + len(added.test) == 16
    assert same(added, load(tree))
    target = tree / "bag" / "000.png"
    Image.fromarray(255 - fashion["bag"][0]).save(target)  # re-saved: new content, new change time
    os.utime(target, ns=(target.stat().st_atime_ns, target.stat().st_mtime_ns + 1_000_000))
    assert same(load(tree, cache_dir=cache), load(tree))
    assert len(list(cache.glob("*.npy"))) == 1  # one entry per folder: the older ones removed


def test_a_damaged_or_foreign_cache_entry_means_decoding_again(tmp_path: Path, fashion) -> None:
    tree, cache = tmp_path / "tree", tmp_path / "decoded"
    write_tree(tree, fashion, {"sneaker": 6, "bag": 9})
    truth = load(tree)
    load(tree, cache_dir=cache)
    (entry,) = cache.glob("*.npy")
    for bad in (b"not numpy", b""):
        entry.write_bytes(bad)
        assert same(load(tree, cache_dir=cache), truth)
    np.save(entry, np.zeros((3, 1, 16, 16), dtype=np.float32))  # another shape and dtype
    assert same(load(tree, cache_dir=cache), truth)
    np.save(entry, np.array([{"x": 1}], dtype=object), allow_pickle=True)  # a pickle is never loaded
    assert same(load(tree, cache_dir=cache), truth)


def test_an_unwritable_cache_only_costs_the_decoding(tmp_path: Path, fashion) -> None:
    tree = tmp_path / "tree"
    write_tree(tree, fashion, {"sneaker": 6, "bag": 9})
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder would be")
    assert same(load(tree, cache_dir=blocked / "decoded"), load(tree))


def test_a_corrupt_image_is_still_refused_with_a_cache(tmp_path: Path, fashion) -> None:
    tree, cache = tmp_path / "tree", tmp_path / "decoded"
    write_tree(tree, fashion, {"sneaker": 6, "bag": 9})
    (tree / "bag" / "003.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(DataError, match="003.png cannot be read"):
        load(tree, cache_dir=cache)
    assert not cache.exists() or not list(cache.glob("*.npy"))


def test_a_deployed_device_keeps_its_images_in_its_state_directory(tmp_path: Path, fashion) -> None:
    from fleet.federated.on_device.tasks import DECODED_DIR, Device
    from fleet.federated.shared import split
    from fleet.federated.shared.config import fleet_config_from_dict

    write_tree(tmp_path / "pi", fashion, {"bag": 8, "sneaker": 4})
    cfg = fleet_config_from_dict({"data": {"dataset": "fashion-mnist", "class_names": NAMES, "input_size": 16}})
    node = {"data-root": str(tmp_path / "pi"), "state-dir": str(tmp_path / "state"), "device-name": "pi"}
    for long_lived, kept in ((True, 0), (False, 1)):
        split._OWNED.clear()  # as a new process
        device = Device.from_configs(cfg, node, long_lived=long_lived)
        assert len(device.data().train) == 9
        assert len(list((device.state_dir / DECODED_DIR).glob("*.npy"))) == kept, long_lived


def test_a_file_gone_since_the_listing_is_decodings_own_error(tmp_path: Path, fashion) -> None:
    from fleet.data.decoded import cached_decode

    gone = tmp_path / "bag" / "gone.png"
    with pytest.raises(DataError, match="gone.png cannot be read"):
        cached_decode(
            tmp_path,
            [gone],
            (1, 1, 16, 16),
            "L",
            tmp_path / "decoded",
            lambda: folders.read_image(gone, "L", (16, 16), "x"),
        )

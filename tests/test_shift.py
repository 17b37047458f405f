"""Devices whose inputs differ: the shift of each device's data is fixed by the config and its index."""

from __future__ import annotations

import pytest
import torch

from fleet.base.errors import ConfigError
from fleet.data.datasets import ArrayDataset
from fleet.data.shift import ShiftConfig, device_shift, shift_dataset
from fleet.federated.shared.config import load_fleet_config

TINY = "simulations/fleet-tiny.yaml"
SHIFT = {
    "devices.shift.rotation_deg": 60,
    "devices.shift.brightness": 0.3,
    "devices.shift.contrast": 0.3,
    "devices.shift.label_permutation": True,
}


def images(n: int = 32) -> ArrayDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.zeros(n, 1, 16, 16, dtype=torch.uint8)
    x[:, :, 4:12, 7:9] = torch.randint(100, 255, (n, 1, 8, 2), generator=gen, dtype=torch.uint8)  # a bar
    return ArrayDataset(x, torch.arange(n) % 10, 10, (0.5,), (0.5,), "bars")


def test_a_device_shift_is_the_same_everywhere_and_differs_between_domains():
    cfg = ShiftConfig(rotation_deg=60, brightness=0.3, contrast=0.3, label_permutation=True, domains=4)
    shifts = [device_shift(cfg, i, 8, 10, seed=0) for i in range(8)]
    assert shifts == [device_shift(cfg, i, 8, 10, seed=0) for i in range(8)]  # recomputed: identical
    assert shifts[0].angle_deg == 0 and shifts[0].permutation is None  # domain 0 is the unshifted data
    assert [s.angle_deg for s in shifts[:4]] == [0, 20, 40, 60]  # the Rotated-MNIST construction
    assert shifts[5] == shifts[1] and shifts[1] != shifts[2]  # device i is in domain i % 4
    assert sorted(shifts[1].permutation) == list(range(10)) and shifts[1].permutation != shifts[2].permutation
    assert 0.7 <= shifts[2].brightness <= 1.3 and shifts[2].brightness != shifts[3].brightness
    assert device_shift(ShiftConfig(rotation_deg=60), 3, 8, 10, 0).angle_deg == pytest.approx(60 * 3 / 7)


def test_shifted_images_turn_and_labels_follow_the_permutation():
    ds = images()
    cfg = ShiftConfig(rotation_deg=90, label_permutation=True, domains=2)
    out = shift_dataset(ds, device_shift(cfg, 1, 2, 10, seed=0))
    rows, cols = out.images[0, 0].nonzero(as_tuple=True)
    assert int(rows.max() - rows.min()) < int(cols.max() - cols.min())  # the upright bar now lies flat
    perm = device_shift(cfg, 1, 2, 10, seed=0).permutation
    assert out.labels.tolist() == [perm[y] for y in ds.labels.tolist()]
    assert out.images.dtype == torch.uint8 and out.images.shape == ds.images.shape
    assert torch.equal(shift_dataset(ds, device_shift(cfg, 0, 2, 10, seed=0)).images, ds.images)


def test_a_fleet_device_trains_and_tests_on_its_own_domain(tmp_path):
    from fleet.federated.shared.split import device_data

    plain = load_fleet_config(TINY, {"output_dir": str(tmp_path)})
    cfg = load_fleet_config(TINY, {"output_dir": str(tmp_path), **SHIFT})
    for pid in (1, 2):
        before, after = device_data(plain, pid), device_data(cfg, pid)
        shift = device_shift(cfg.devices.shift, pid, cfg.devices.num_devices, 10, cfg.train.seed)
        for split in ("train", "test"):  # the same transform on both splits
            assert torch.equal(getattr(after, split).images, shift_dataset(getattr(before, split), shift).images)
            assert not torch.equal(getattr(after, split).images, getattr(before, split).images)
    assert torch.equal(device_data(cfg, 1).train.images, device_data(cfg, 1).train.images)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"devices.shift.rotation_deg": -5}, "devices.shift.rotation_deg: -5.0 is not allowed"),
        ({"devices.shift.contrast": 1.5}, "devices.shift.contrast: 1.5 is not allowed"),
        ({"devices.shift.brightness": 0.2, "model.in_channels": 4}, "brightness and contrast need 1- or 3-"),
    ],
)
def test_a_shift_the_data_cannot_take_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_fleet_config(TINY, overrides)
    assert "\n" not in str(err.value)


def test_a_shift_on_devices_that_read_their_own_folders_is_refused(tmp_path):
    for name in ("dev-a", "dev-b"):
        (tmp_path / name / "shirt").mkdir(parents=True)
    overrides = {"data.device_roots": str(tmp_path), "data.class_names": [str(i) for i in range(10)], **SHIFT}
    with pytest.raises(ConfigError, match="devices.shift: the devices read their own folders"):
        load_fleet_config(TINY, overrides)


def test_fleet_train_reads_its_own_domain_and_pretrains_on_unshifted_data(tmp_path, capsys):
    import json

    from fleet.cli import main
    from fleet.engine.config import load_config
    from fleet.engine.experiment import load_data
    from fleet.engine.pretrain import pretrain_config

    text = (
        f"name: t\noutput_dir: {tmp_path}\nmodel: {{name: resnet18, in_channels: 1}}\n"
        "data: {dataset: synthetic, input_size: 16, train_per_class: 8, test_per_class: 4}\n"
        "train: {method: tl, epochs: 1, batch_size: 8}\n"
    )
    (tmp_path / "c.yaml").write_text(text)
    turned = {"data.shift.rotation_deg": 90, "data.shift.label_permutation": True}
    cfg = load_config(tmp_path / "c.yaml", turned)
    plain = load_data(load_config(tmp_path / "c.yaml").data)
    shifted = load_data(cfg.data)
    shift = device_shift(cfg.data.shift, 1, 2, 10, seed=0)
    assert shift.angle_deg == 90 and shift.permutation is not None  # domain 1 of 2: the whole rotation
    for before, after in zip(plain, shifted):  # training and test data alike
        assert torch.equal(after.images, shift_dataset(before, shift).images)
        assert torch.equal(after.labels, torch.tensor(shift.permutation)[before.labels])
        assert not torch.equal(after.images, before.images)
    assert not pretrain_config(cfg).data.shift.active  # the vendor's model never saw this camera
    assert torch.equal(
        load_data(load_config(tmp_path / "c.yaml", {**turned, "data.domain": 0}).data)[0].images, plain[0].images
    )  # domain 0 is the unshifted data
    assert main(["train", "-c", str(tmp_path / "c.yaml"), "--set", "data.shift.rotation_deg=45"]) == 0
    record = json.loads((tmp_path / "t" / "train-tl.json").read_text())
    assert record["config"]["data"]["shift"]["rotation_deg"] == 45


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.domain=2", "data.domain: 2 is not allowed; use an integer in [0, 2)"),
        ("data.shift.rotation_deg=200", "data.shift.rotation_deg: 200.0 is not allowed"),
        ("data.shift.domains=0", "data.shift.domains: 0 is not allowed"),
    ],
)
def test_a_single_device_shift_it_cannot_take_is_one_line_and_exit_2(tmp_path, capsys, override, message):
    from fleet.cli import main

    (tmp_path / "c.yaml").write_text(f"name: t\noutput_dir: {tmp_path}\ndata: {{dataset: synthetic}}\n")
    assert main(["train", "-c", str(tmp_path / "c.yaml"), "--set", override]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_a_fleet_refuses_a_single_device_shift():
    with pytest.raises(ConfigError, match="^data.shift: a fleet gives each device its own domain with devices.shift"):
        load_fleet_config(TINY, {"data.shift.rotation_deg": 30})

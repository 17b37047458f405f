"""Model zoo: shapes, stems, weights loading and checkpoints."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from fleet.base.errors import ModelError
from fleet.engine.models import (
    MODEL_NAMES,
    build_model,
    head_parameter_names,
    input_channels,
    load_checkpoint_meta,
    model_meta,
    save_checkpoint,
)


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("small_input,in_channels", [(True, 1), (False, 3)])
def test_every_model_maps_32px_batch_to_logits(name: str, small_input: bool, in_channels: int) -> None:
    torch.manual_seed(0)
    model = build_model(name, 7, in_channels=in_channels, small_input=small_input)
    out = _forward(model, torch.randn(2, in_channels, 32, 32))
    assert out.shape == (2, 7)
    assert torch.isfinite(out).all()
    # the head is the last Linear and really produces the 7 logits
    head = model.get_parameter(head_parameter_names(model)[0])
    assert head.shape[0] == 7


def test_in_channels_without_small_input_keeps_stem_geometry() -> None:
    model = build_model("resnet18", 10, in_channels=1)
    assert model.conv1.in_channels == 1
    assert model.conv1.kernel_size == (7, 7) and model.conv1.stride == (2, 2)
    assert isinstance(model.maxpool, nn.MaxPool2d)
    assert _forward(model, torch.randn(2, 1, 32, 32)).shape == (2, 10)


def test_small_input_stems() -> None:
    resnet = build_model("resnet18", 10, small_input=True)
    assert resnet.conv1.kernel_size == (3, 3)
    assert resnet.conv1.stride == (1, 1) and resnet.conv1.padding == (1, 1)
    assert isinstance(resnet.maxpool, nn.Identity)
    for name in ("mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0"):
        stem = build_model(name, 10, small_input=True).features[0][0]
        assert stem.stride == (1, 1), name
        assert build_model(name, 10).features[0][0].stride == (2, 2), name
    vgg = build_model("vgg11_bn", 10, small_input=True)
    linears = [m for m in vgg.classifier if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(512, 10)]
    assert isinstance(vgg.avgpool, nn.AdaptiveAvgPool2d) and vgg.avgpool.output_size == 1
    # small_input keeps resnet features at 4x4 before pooling for a 32x32 image (stride 8 total)
    feats = {}
    resnet.layer4.register_forward_hook(lambda m, i, o: feats.setdefault("x", o))
    _forward(resnet, torch.randn(2, 3, 32, 32))
    assert feats["x"].shape[-2:] == (4, 4)


def test_build_is_deterministic_under_manual_seed() -> None:
    for name in ("resnet18", "vgg11_bn"):
        torch.manual_seed(3)
        a = build_model(name, 10, in_channels=1, small_input=True).state_dict()
        torch.manual_seed(3)
        b = build_model(name, 10, in_channels=1, small_input=True).state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_small_vgg_is_initialised_like_torchvision() -> None:
    torch.manual_seed(0)
    vgg = build_model("vgg11_bn", 10, small_input=True)
    for m in vgg.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert torch.equal(m.running_mean, torch.zeros_like(m.running_mean))
            assert torch.equal(m.running_var, torch.ones_like(m.running_var))
            assert int(m.num_batches_tracked) == 0
    w = vgg.classifier[0].weight.detach()
    assert abs(float(w.std()) - 0.01) < 0.002
    conv = vgg.features[0].weight.detach()  # kaiming fan_out: std = sqrt(2 / (64 * 9))
    assert abs(float(conv.std()) - (2 / (64 * 9)) ** 0.5) < 0.01


def test_unknown_name_lists_choices() -> None:
    with pytest.raises(ModelError) as info:
        build_model("resnet19", 10)
    msg = str(info.value)
    assert "model.name" in msg and "'resnet19'" in msg and "resnet18" in msg and "vgg11_bn" in msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    "kwargs,field", [({"num_classes": 0}, "model.num_classes"), ({"in_channels": 0}, "model.in_channels")]
)
def test_bad_sizes_name_the_field(kwargs: dict, field: str) -> None:
    args = {"num_classes": 10, **kwargs}
    with pytest.raises(ModelError, match=field):
        build_model("mobilenet_v3_small", args.pop("num_classes"), **args)


def test_weights_round_trip_through_checkpoint(tmp_path) -> None:
    torch.manual_seed(1)
    src = build_model("mobilenet_v3_small", 5, in_channels=1, small_input=True)
    path = tmp_path / "deep" / "dir" / "ckpt.pt"
    meta = {**model_meta("mobilenet_v3_small", 5, 1, True), "accuracy": 0.5}
    save_checkpoint(src, path, meta)
    assert load_checkpoint_meta(path) == meta
    assert [p.name for p in path.parent.iterdir()] == ["ckpt.pt"]  # no temp file left behind

    torch.manual_seed(2)
    dst = build_model("mobilenet_v3_small", 5, in_channels=1, small_input=True, weights=path)
    a, b = src.state_dict(), dst.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randn(2, 1, 32, 32)
    assert torch.equal(_forward(src, x), _forward(dst, x))


def test_raw_state_dict_is_accepted(tmp_path) -> None:
    src = build_model("resnet18", 10, in_channels=1, small_input=True)
    torch.save(src.state_dict(), tmp_path / "raw.pt")
    dst = build_model("resnet18", 10, in_channels=1, small_input=True, weights=tmp_path / "raw.pt")
    assert torch.equal(src.conv1.weight, dst.conv1.weight)
    with pytest.raises(ModelError, match="no fleet meta"):
        load_checkpoint_meta(tmp_path / "raw.pt")


def test_mismatched_weights_name_the_tensor(tmp_path) -> None:
    path = tmp_path / "five.pt"
    save_checkpoint(build_model("resnet18", 5, in_channels=1), path, {})
    with pytest.raises(ModelError) as info:
        build_model("resnet18", 10, in_channels=1, weights=path)
    msg = str(info.value)
    assert msg.startswith(
        f"weights file '{path}' does not fit resnet18(num_classes=10, in_channels=1, small_input=False)"
    )
    assert "shape of fc.weight is (5, 512) in the file, (10, 512) in the model" in msg
    assert "0 missing, 0 unexpected keys" in msg and "reset_head=True" in msg
    assert "\n" not in msg

    with pytest.raises(ModelError) as info:  # a different architecture: keys do not line up
        build_model("mobilenet_v3_small", 5, in_channels=1, weights=path)
    msg = str(info.value)
    assert "missing from the file" in msg and "reset_head" not in msg


def test_reset_head_loads_backbone_into_new_head(tmp_path) -> None:
    torch.manual_seed(0)
    src = build_model("mobilenet_v2", 5, small_input=True)
    path = tmp_path / "pre.pt"
    save_checkpoint(src, path, {"num_classes": 5})
    torch.manual_seed(1)
    fresh = build_model("mobilenet_v2", 10, small_input=True)
    torch.manual_seed(1)
    dst = build_model("mobilenet_v2", 10, small_input=True, weights=path, reset_head=True)
    head = set(head_parameter_names(dst))
    a, b, f = src.state_dict(), dst.state_dict(), fresh.state_dict()
    for key in b:
        if key in head:
            assert b[key].shape[0] == 10 and torch.equal(b[key], f[key]), key
        else:
            assert torch.equal(a[key], b[key]), key


def test_reset_head_still_rejects_backbone_mismatch(tmp_path) -> None:
    path = tmp_path / "rgb.pt"
    save_checkpoint(build_model("resnet18", 5, small_input=True), path, {})
    with pytest.raises(ModelError, match=r"shape of conv1\.weight is \(64, 3, 3, 3\) in the file, \(64, 1, 3, 3\)"):
        build_model("resnet18", 10, in_channels=1, small_input=True, weights=path, reset_head=True)


def test_missing_and_garbage_weight_files(tmp_path) -> None:
    missing = tmp_path / "nope.pt"
    with pytest.raises(ModelError, match=f"model.weights: file '{missing}' not found"):
        build_model("resnet18", 10, weights=missing)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ModelError, match="cannot read") as info:
        build_model("resnet18", 10, weights=garbage)
    assert "\n" not in str(info.value)
    listy = tmp_path / "list.pt"
    torch.save([1, 2, 3], listy)
    with pytest.raises(ModelError, match="holds no state_dict"):
        build_model("resnet18", 10, weights=listy)


def test_head_parameter_names() -> None:
    assert head_parameter_names(build_model("resnet18", 10)) == ["fc.weight", "fc.bias"]
    assert head_parameter_names(build_model("mobilenet_v2", 10)) == ["classifier.1.weight", "classifier.1.bias"]
    assert head_parameter_names(build_model("mobilenet_v3_small", 10)) == ["classifier.3.weight", "classifier.3.bias"]


def test_checkpoint_meta_must_be_plain(tmp_path) -> None:
    model = build_model("mobilenet_v3_small", 2, small_input=True)
    with pytest.raises(ModelError, match=r"meta\.root is a PosixPath|meta\.root is a WindowsPath"):
        save_checkpoint(model, tmp_path / "c.pt", {"root": tmp_path})
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("small_input,in_channels", [(True, 1), (False, 3), (False, 2)])
def test_input_channels_reads_the_stem(name: str, small_input: bool, in_channels: int) -> None:
    assert input_channels(build_model(name, 4, in_channels=in_channels, small_input=small_input)) == in_channels


def test_input_channels_without_conv_says_so() -> None:
    with pytest.raises(ModelError, match="Sequential has no Conv2d"):
        input_channels(nn.Sequential(nn.Flatten(), nn.Linear(4, 2)))


def test_model_meta_rebuilds_the_model() -> None:
    meta = model_meta("resnet18", 6, 1, True)
    assert meta == {"name": "resnet18", "num_classes": 6, "in_channels": 1, "small_input": True}
    model = build_model(
        meta["name"], meta["num_classes"], in_channels=meta["in_channels"], small_input=meta["small_input"]
    )
    assert input_channels(model) == 1


def test_a_model_with_given_weights_holds_them_exactly_and_trains(tmp_path) -> None:
    """Built on the meta device: the configured start file is not read (here it does not exist) and
    every tensor is the given one, cast to the model's dtype."""
    from fleet.engine.config import ModelConfig
    from fleet.engine.experiment import model_with_weights

    source = build_model("resnet18", 10, in_channels=1, small_input=True)
    weights = {k: v.clone().double() if v.is_floating_point() else v.clone() for k, v in source.state_dict().items()}
    gone = str(tmp_path / "gone.pt")
    cfg = ModelConfig(name="resnet18", num_classes=10, in_channels=1, small_input=True, weights=gone)
    model = model_with_weights(cfg, weights)
    for name, value in model.state_dict().items():
        assert not value.is_meta and value.dtype == source.state_dict()[name].dtype
        assert torch.equal(value, source.state_dict()[name])
    assert all(p.requires_grad for p in model.parameters())
    model(torch.randn(2, 1, 16, 16)).sum().backward()
    assert model.fc.weight.grad is not None
    with pytest.raises(RuntimeError, match="fc.weight"):
        model_with_weights(cfg, {**weights, "fc.weight": torch.zeros(3, 3)})
    # copied from one skeleton per process: a second model shares nothing with the first, and the failed load above
    # left nothing behind in the skeleton
    other = model_with_weights(cfg, {k: torch.zeros_like(v) for k, v in weights.items()})
    assert not any(p.data_ptr() == q.data_ptr() for p, q in zip(model.parameters(), other.parameters()))
    assert torch.count_nonzero(other.fc.weight) == 0 and torch.equal(model.fc.weight, source.fc.weight)

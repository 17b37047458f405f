"""Model zoo: torchvision architectures adapted to small inputs and local weights.

Everything is built from scratch (``weights=None``) because devices have no
internet; pretrained weights come only from local files.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torchvision.models as tvm
from torch import nn

from fleet.base.atomic import write_atomic
from fleet.base.errors import ModelError

MODEL_NAMES: tuple[str, ...] = (
    "resnet18",
    "resnet34",
    "resnet50",
    "mobilenet_v2",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "vgg11_bn",
)

_RESNETS = ("resnet18", "resnet34", "resnet50")


def _describe(name: str, num_classes: int, in_channels: int, small_input: bool) -> str:
    return f"{name}(num_classes={num_classes}, in_channels={in_channels}, small_input={small_input})"


def _check_args(name: str, num_classes: int, in_channels: int) -> None:
    if name not in MODEL_NAMES:
        raise ModelError(f"model.name: unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ModelError(f"model.num_classes: got {num_classes!r}; use a positive integer (the dataset's class count)")
    if isinstance(in_channels, bool) or not isinstance(in_channels, int) or in_channels < 1:
        raise ModelError(f"model.in_channels: got {in_channels!r}; use a positive integer (1 for grayscale, 3 for RGB)")


def _init_like_torchvision(model: nn.Module) -> None:
    """Re-run torchvision's VGG init so a meta-built model matches a normal build."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
            m.reset_running_stats()
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)


def _small_vgg11_bn(num_classes: int) -> nn.Module:
    """VGG for ~32x32 inputs; built on 'meta' so the unused 100M-weight FC stack costs nothing."""
    with torch.device("meta"):
        model = tvm.vgg11_bn(weights=None, num_classes=num_classes, init_weights=False)
    model.avgpool = nn.AdaptiveAvgPool2d(1)
    model.classifier = nn.Sequential(nn.Linear(512, num_classes))
    model.to_empty(device="cpu")
    _init_like_torchvision(model)
    return model


def _first_conv(model: nn.Module) -> tuple[nn.Module, str, nn.Conv2d]:
    """(parent, attribute, conv) of the stem convolution."""
    for qualname, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            parent_name, _, attr = qualname.rpartition(".")
            return model.get_submodule(parent_name), attr, module
    raise AssertionError("model has no Conv2d")  # every zoo model has one


def _replace_stem(model: nn.Module, in_channels: int, stride: int | None, kernel_3x3: bool) -> None:
    parent, attr, old = _first_conv(model)
    kernel, padding = ((3, 3), (1, 1)) if kernel_3x3 else (old.kernel_size, old.padding)
    new = nn.Conv2d(
        in_channels,
        old.out_channels,
        kernel_size=kernel,
        stride=old.stride if stride is None else stride,
        padding=padding,
        dilation=old.dilation,
        groups=old.groups,
        bias=old.bias is not None,
        padding_mode=old.padding_mode,
    )
    nn.init.kaiming_normal_(new.weight, mode="fan_out", nonlinearity="relu")
    if new.bias is not None:
        nn.init.zeros_(new.bias)
    setattr(parent, attr, new)


def _head(model: nn.Module) -> tuple[str, nn.Linear]:
    """The classifier head: the last Linear module (fc or classifier[-1] in every zoo model)."""
    last: tuple[str, nn.Linear] | None = None
    for qualname, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last = (qualname, module)
    if last is None:
        raise ModelError(f"model: {type(model).__name__} has no Linear head; use one of {', '.join(MODEL_NAMES)}")
    return last


def head_parameter_names(model: nn.Module) -> list[str]:
    """Names of the head's parameters, so trainers can freeze or reset the rest."""
    prefix, head = _head(model)
    return [f"{prefix}.{name}" for name, _ in head.named_parameters()]


def input_channels(model: nn.Module) -> int:
    """Channels the model takes in: those of its first Conv2d (the stem)."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            return module.in_channels
    raise ModelError(
        f"model: {type(model).__name__} has no Conv2d, so its input channels are unknown; use one of "
        f"{', '.join(MODEL_NAMES)}"
    )


def model_meta(name: str, num_classes: int, in_channels: int, small_input: bool) -> dict:
    """What rebuilds a zoo model: the ``model`` dict of a device profile and the core of a checkpoint's meta."""
    return {"name": name, "num_classes": num_classes, "in_channels": in_channels, "small_input": small_input}


def build_model(
    name: str,
    num_classes: int,
    *,
    in_channels: int = 3,
    small_input: bool = False,
    weights: str | os.PathLike | None = None,
    reset_head: bool = False,
) -> nn.Module:
    """Build a zoo model; ``small_input`` keeps 32x32 images from shrinking to nothing in the stem."""
    _check_args(name, num_classes, in_channels)
    if name == "vgg11_bn" and small_input:
        model = _small_vgg11_bn(num_classes)
    else:
        model = getattr(tvm, name)(weights=None, num_classes=num_classes)

    if small_input and name in _RESNETS:
        _replace_stem(model, in_channels, stride=1, kernel_3x3=True)
        model.maxpool = nn.Identity()
    elif small_input and name != "vgg11_bn":
        _replace_stem(model, in_channels, stride=1, kernel_3x3=False)
    elif in_channels != 3:
        _replace_stem(model, in_channels, stride=None, kernel_3x3=False)

    if weights is not None:
        desc = _describe(name, num_classes, in_channels, small_input)
        _load_weights(model, weights, desc, reset_head=reset_head)
    return model


def _read_state(path: str | os.PathLike) -> Any:
    p = Path(path)
    if not p.is_file():
        raise ModelError(
            f"model.weights: file {str(p)!r} not found; pass a local .pt file saved by fleet or torch.save"
        )
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for corrupt or unsafe files; its text is long
        raise ModelError(
            f"model.weights: cannot read {str(p)!r} as a weights-only torch file ({type(exc).__name__}); "
            "pass a state_dict saved with torch.save or a fleet checkpoint"
        ) from exc


def _extract_state_dict(obj: Any, path: str | os.PathLike) -> Mapping[str, torch.Tensor]:
    if isinstance(obj, Mapping) and "model" in obj and isinstance(obj["model"], Mapping):
        obj = obj["model"]
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ModelError(
            f"model.weights: {str(path)!r} holds no state_dict; save model.state_dict() or use fleet's save_checkpoint"
        )
    return obj


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(d) for d in t.shape) + ")"


def _load_weights(model: nn.Module, path: str | os.PathLike, desc: str, *, reset_head: bool) -> None:
    state = dict(_extract_state_dict(_read_state(path), path))
    own = model.state_dict()
    head_prefix = _head(model)[0] + "."
    head_keys = {k for k in own if k.startswith(head_prefix)}

    if reset_head:
        for key in head_keys:
            if key in state and state[key].shape != own[key].shape:
                del state[key]
                state[key] = own[key]

    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    wrong = [k for k in own if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        issues = [f"shape of {k} is {_shape(state[k])} in the file, {_shape(own[k])} in the model" for k in wrong]
        issues += [f"{k} missing from the file" for k in missing]
        issues += [f"{k} unexpected in the file" for k in unexpected]
        hint = ""
        if wrong and set(wrong) <= head_keys and not missing and not unexpected:
            hint = "; pass reset_head=True to load only the backbone"
        raise ModelError(
            f"weights file {str(path)!r} does not fit {desc}: {'; '.join(issues[:3])}; "
            f"{len(missing)} missing, {len(unexpected)} unexpected keys{hint}"
        )
    model.load_state_dict(state, strict=True)


_META_TYPES = (str, int, float, bool, type(None))


def _check_meta(value: Any, where: str) -> None:
    """weights_only loading accepts only plain containers, so reject the rest at save time."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ModelError(f"checkpoint meta: key {k!r} in {where} is not a str; use string keys")
            _check_meta(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_meta(v, f"{where}[{i}]")
    elif not isinstance(value, _META_TYPES):
        raise ModelError(
            f"checkpoint meta: {where} is a {type(value).__name__}; store str/int/float/bool/None/list/dict values"
        )


def save_checkpoint(model: nn.Module, path: str | os.PathLike, meta: dict) -> None:
    """Write {"model", "meta"} atomically so a crash never leaves a half-written checkpoint."""
    _check_meta(meta, "meta")
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    write_atomic(path, lambda fh: torch.save({"model": state, "meta": dict(meta)}, fh), binary=True)


def load_checkpoint_meta(path: str | os.PathLike) -> dict:
    """The meta dict of a fleet checkpoint, e.g. to rebuild the model it belongs to."""
    obj = _read_state(path)
    if not isinstance(obj, Mapping) or not isinstance(obj.get("meta"), dict):
        raise ModelError(
            f"model.weights: {str(path)!r} has no fleet meta; it is a bare state_dict, so pass the model "
            "config explicitly"
        )
    return dict(obj["meta"])

"""Experiment configs: YAML files loaded into typed, validated dataclasses.

Every field is checked on load; a bad one raises :class:`ConfigError` with one
line naming the field, its value and what is allowed. Command-line flags
override fields through dotted paths (``train.rho=0.4``), validated the same way.
"""

from __future__ import annotations

import dataclasses
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fleet.base.errors import ConfigError, FleetError
from fleet.base.numbers import is_real
from fleet.data.shift import ShiftConfig, check_shift
from fleet.engine.accelerator import DEVICES
from fleet.engine.yaml_text import load_yaml

METHODS = ("full", "tl", "bn_bias", "prunetrain", "elastic")


@dataclass
class ModelConfig:
    """The network: a torchvision architecture with a resized head and stem, weights from local files only."""

    # resnet18, resnet34, resnet50, mobilenet_v2, mobilenet_v3_small, efficientnet_b0 or vgg11_bn (checked when the
    # model is built, fleet/engine/models.py)
    name: str = "resnet18"
    num_classes: int = 10  # outputs of the head: the data's classes (data.classes: as many as it keeps)
    in_channels: int = 1  # 1 for grayscale, 3 for RGB; another count replaces the first convolution
    # fit the network to small inputs (e.g. 32x32), which would shrink to nothing: a stride-1 stem (ResNets: 3x3, no
    # max-pool; vgg11_bn: pooled to a one-layer head)
    small_input: bool = False
    weights: str | None = None  # local checkpoint file (``fleet pretrain`` writes one)
    reset_head: bool = False  # load a backbone whose head has another shape


@dataclass
class DataConfig:
    """What the model trains and is tested on: local files only, nothing is downloaded."""

    # fashion-mnist (Debian's IDX files), fashion-mnist-torchvision, mnist, cifar10, cifar100 (torchvision's files on
    # disk), imagefolder (data.root), digits (scikit-learn) or synthetic (tests); checked when the data is loaded
    dataset: str = "fashion-mnist"
    root: str | None = None  # None: the dataset's default location
    input_size: int = 32  # images are resized to this many pixels square in every batch; profiles are taken at it
    classes: list[int] | None = None  # keep these labels (remapped to 0..n-1)
    train_per_class: int | None = None  # cap training samples per class (a device's small local set)
    test_per_class: int | None = None  # cap test samples per class (null: the whole test split)
    # The fleet's label space in order, shared by every device: a device's class folders map onto it
    # by name, so label ids agree across the fleet even when a device holds only some classes.
    class_names: list[str] | None = None
    # Simulation: one sub-folder per device, each a device's own image tree named for the device
    # (a natural per-user partition, like LEAF's FEMNIST writers).
    device_roots: str | None = None
    # One device's own input domain (fleet/data/shift.py), for `fleet train` and `fleet personalize`: its images turned
    # and re-lit as domain `domain` of `shift.domains` (null: 2, so domain 1 is turned by the whole rotation_deg),
    # in training and testing alike. Pretraining stays unshifted: the vendor's model has not seen this device's
    # camera. A fleet gives each device its domain with devices.shift instead.
    shift: ShiftConfig = field(default_factory=ShiftConfig)
    domain: int = 1  # which of data.shift's domains this device's data is in (0: unshifted)


@dataclass
class TrainConfig:
    """How a model is trained: by `fleet train` and `fleet personalize`, and by every fleet device (its optimizer,
    batch, seed, profile and memory budget; a round's length is federation.local_steps)."""

    # what `fleet train` trains: full, tl (head only), bn_bias (norm, bias and head tensors), prunetrain (full
    # training with an L1 group penalty) or elastic (the tensors that fit rho); a fleet's devices follow
    # federation.strategy instead
    method: str = "elastic"
    epochs: int = 5  # passes over the training data (`fleet train`, `fleet personalize`)
    batch_size: int = 32  # samples per training step; a device profile is measured at this batch size
    lr: float = 0.01  # SGD learning rate
    momentum: float = 0.9  # SGD momentum
    weight_decay: float = 5e-4  # SGD weight decay
    rho: float = 0.5  # time budget as a fraction of full training (elastic)
    interval: int = 1  # re-select every `interval` epochs or steps
    interval_unit: str = "epoch"  # what `interval` counts: epoch or step
    # samples an importance probe uses (null: a whole batch). The probe trains every tensor for a step and takes
    # another gradient, so fewer samples make it cheaper and noisier (its cost: `fleet bench personalize`)
    probe_samples: int | None = None
    # train: the probe's two passes are two training steps on one batch, kept, so only their difference from elastic
    # steps is spent (Trainer.training_probe). restore: the spec's probe, a step on every tensor that is undone, then
    # a second gradient (2 full steps plus copies). train by default: it costs the round less and trained to a higher
    # accuracy (docs/results.md, "The probe's cost")
    probe: str = "train"
    prunetrain_lambda: float = 1e-4  # L1 group penalty weight (prunetrain)
    seed: int = 0  # seeds the model's initialization, shuffling and caps; in a fleet also the split and sampling
    # where the model, its batches, optimizer and importance probes live: auto (a CUDA GPU where torch sees one, else
    # the CPU), cpu or cuda (an error on a machine without one). A profile is measured on, and only valid for, one
    # kind: a CPU profile is refused for a CUDA run and the other way round (docs/gpu.md)
    device: str = "auto"
    # mixed precision on CUDA: autocast to float16 with a gradient scaler, about twice the throughput on tensor cores.
    # The profile must be measured in the same precision (its dtype), or it is refused. Needs a CUDA device
    amp: bool = False


@dataclass
class HardwareConfig:
    """What the device offers the training: its threads, its measured profile and its activation memory."""

    threads: int | None = None  # torch threads; None keeps torch's default
    profile: str | None = None  # device profile YAML; None measures one before training
    memory_budget_mb: float | None = None  # activation memory budget (POET-style plan); None: unlimited
    spill_dir: str | None = None  # where paged activations go; None: a folder in the system temp dir


@dataclass
class PretrainConfig:
    """How the starting checkpoint is made (no internet for ImageNet weights)."""

    classes: list[int] | None = None  # labels to pretrain on; None: all
    train_per_class: int | None = None  # cap pretraining samples per class; None: all
    epochs: int = 2  # passes over the pretraining data
    lr: float = 0.05  # SGD learning rate of pretraining
    # the vendor's seed; None: train.seed. A bench fixes it so that every personalization seed starts from one model
    seed: int | None = None
    checkpoint: str | None = None  # where it is cached; None: <output_dir>/pretrained/<model>-<dataset>-...-r<seed>.pt


@dataclass
class ExperimentConfig:
    """One experiment on one device: the model, its data, its training and its starting checkpoint."""

    name: str = "experiment"  # the run's folder under output_dir (runs/<name>/)
    output_dir: str = "runs"  # where runs are written, one folder per run name
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    methods: list[str] = field(default_factory=lambda: list(METHODS))  # compared by `fleet personalize`


LABELS_RULE = (
    lambda v: v is None or (len(v) >= 2 and len(set(v)) == len(v) and min(v) >= 0),
    "a list of >= 2 distinct labels >= 0",
)
_OPTIONAL_COUNT = (lambda v: v is None or v >= 1, "an integer >= 1 or null")


def _folder_name(name: str) -> bool:
    """A class name must be usable as one folder name: not empty, no '/', not hidden (hidden entries are skipped)."""
    return bool(name.strip()) and "/" not in name and not name.startswith(".")


# A run's name becomes one folder under output_dir (and ``<name>.<timestamp>`` when a run is kept
# aside): one plain path component, so '..' cannot climb out of output_dir and '.' cannot be output_dir itself.
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def _run_name(name: str) -> bool:
    return isinstance(name, str) and RUN_NAME.fullmatch(name) is not None


CLASS_NAMES_RULE = (
    lambda v: v is None or (len(v) >= 2 and len(set(v)) == len(v) and all(_folder_name(n) for n in v)),
    "a list of >= 2 distinct non-empty class names without '/' and not starting with '.', or null",
)

# Checks beyond the type: field path -> (predicate, what is allowed).
RULES: dict[str, tuple[typing.Callable[[Any], bool], str]] = {  # by dotted path; a section may own its RULES
    "model.num_classes": (lambda v: v >= 2, "an integer >= 2"),
    "model.in_channels": (lambda v: v >= 1, "an integer >= 1"),
    "data.input_size": (lambda v: 8 <= v <= 1024, "an integer from 8 to 1024"),
    "data.classes": LABELS_RULE,
    "data.train_per_class": _OPTIONAL_COUNT,
    "data.test_per_class": _OPTIONAL_COUNT,
    "data.class_names": CLASS_NAMES_RULE,
    "data.device_roots": (lambda v: v is None or bool(v.strip()), "a folder path or null"),
    "train.method": (lambda v: v in METHODS, "one of " + ", ".join(METHODS)),
    "train.epochs": (lambda v: v >= 1, "an integer >= 1"),
    "train.batch_size": (lambda v: v >= 1, "an integer >= 1"),
    "train.lr": (lambda v: 0 < v < 10, "a number in (0, 10)"),
    "train.momentum": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "train.weight_decay": (lambda v: v >= 0, "a number >= 0"),
    "train.rho": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "train.interval": (lambda v: v >= 1, "an integer >= 1"),
    "train.probe_samples": (lambda v: v is None or v >= 2, "an integer >= 2 (BatchNorm needs 2), or null"),
    "train.probe": (lambda v: v in ("restore", "train"), "'restore' or 'train'"),
    "train.interval_unit": (lambda v: v in ("epoch", "step"), "'epoch' or 'step'"),
    "train.prunetrain_lambda": (lambda v: v >= 0, "a number >= 0"),
    "train.device": (lambda v: v in DEVICES, "one of " + ", ".join(DEVICES)),
    "hardware.threads": _OPTIONAL_COUNT,
    "hardware.memory_budget_mb": (lambda v: v is None or v > 0, "a positive number of MB or null"),
    "pretrain.classes": LABELS_RULE,
    "pretrain.train_per_class": _OPTIONAL_COUNT,
    "pretrain.epochs": (lambda v: v >= 1, "an integer >= 1"),
    "pretrain.lr": (lambda v: 0 < v < 10, "a number in (0, 10)"),
    "pretrain.seed": (lambda v: v is None or v >= 0, "an integer >= 0 or null"),
    "methods": (lambda v: len(v) >= 1 and all(m in METHODS for m in v), "a list drawn from " + ", ".join(METHODS)),
    "name": (
        _run_name,
        "a plain folder name: 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit (e.g. my-run)",
    ),
}


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        if dataclasses.is_dataclass(item):
            return "a list of mappings of fields (docs/config.md lists them)"
        return f"a list (each item {_type_name(item)})"
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args:
        return " or ".join(_type_name(a) for a in args) + (" or null" if type(None) in typing.get_args(tp) else "")
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(path, value, option)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: {shown(value)} is not {_type_name(tp)}")
    if dataclasses.is_dataclass(tp):  # e.g. one of a list of sections
        return build_dataclass(tp, value, path)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{path}: {shown(value)} is not a list")
        return [_coerce(f"{path}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if tp is float:
        if not is_real(value):
            raise ConfigError(f"{path}: {shown(value)} is not a finite number")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: {shown(value)} is not an integer")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: {shown(value)} is not true or false")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: {shown(value)} is not a string")
        return value
    raise TypeError(f"unsupported config type {tp} at {path}")


def _allows_null(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


Rule = tuple[typing.Callable[[Any], bool], str]  # (is the value allowed, what is allowed, said in the error)


def rule_of(cls: type, name: str, path: str) -> Rule | None:
    """A field's rule: its section's own (``RULES`` on the section's dataclass, by field name), else the
    experiment's (:data:`RULES`, by dotted path)."""
    own = getattr(cls, "RULES", None)
    return own.get(name) if own is not None else RULES.get(path)


def _field_value(path: str, raw: Any, tp: Any, rule: Rule | None) -> Any:
    """One field's checked value. A null for a field that needs a value is named as such (rather than
    "None is not a number"), since it comes from an empty YAML entry or ``--set FIELD=null``."""
    allowed = rule[1] if rule is not None else _type_name(tp)
    if raw is None and not _allows_null(tp):
        raise ConfigError(f"{path}: null is not allowed, the field needs a value; use {allowed}")
    try:
        value = _coerce(path, raw, tp)
    except ConfigError as exc:  # the type is wrong: say what would be right
        if not str(exc).startswith(f"{path}: "):
            raise  # a field inside it (a list of sections) is wrong, and its own error says what is allowed
        raise ConfigError(f"{exc}; use {allowed}") from None
    if rule is not None and not rule[0](value):
        raise ConfigError(f"{path}: {shown(value)} is not allowed; use {rule[1]}")
    return value


def build_dataclass(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of fields, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(f"{where}: unknown field; allowed here: {', '.join(sorted(names))}")
    values = {}
    for f in dataclasses.fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            values[f.name] = build_dataclass(tp, data.get(f.name), path)
            continue
        if f.name in data:
            values[f.name] = _field_value(path, data[f.name], tp, rule_of(cls, f.name, path))
    obj = cls(**values)
    for f in dataclasses.fields(cls):  # defaults must pass the rules too
        path = f"{prefix}.{f.name}" if prefix else f.name
        rule = rule_of(cls, f.name, path)
        if rule is not None and not rule[0](getattr(obj, f.name)):
            raise ConfigError(f"{path}: {shown(getattr(obj, f.name))} is not allowed; use {rule[1]}")
    if isinstance(obj, ExperimentConfig):  # the fleet's config too: FleetConfig is an ExperimentConfig
        check_experiment(obj)
    return obj


def check_experiment(cfg: ExperimentConfig) -> None:
    """Checks that span sections, so one field alone cannot express them."""
    check_shift(cfg.data.shift, "data.shift", cfg.model.in_channels)
    if cfg.train.amp and cfg.train.device == "cpu":
        raise ConfigError(
            "train.amp: true needs a CUDA device, and train.device is cpu; set train.amp to false, "
            "or train.device to cuda (or auto) on a machine with a CUDA GPU"
        )
    domains = cfg.data.shift.domains or 2
    if not 0 <= cfg.data.domain < domains:
        raise ConfigError(
            f"data.domain: {cfg.data.domain} is not allowed; use an integer in [0, {domains}) "
            "(one of data.shift.domains, 0 being unshifted)"
        )
    names = cfg.data.class_names
    if names is not None and len(names) != cfg.model.num_classes:
        raise ConfigError(
            f"data.class_names: lists {len(names)} classes but model.num_classes is {cfg.model.num_classes}; "
            "name every class of the model once, in label order, or change model.num_classes"
        )
    if cfg.data.device_roots is not None and names is None:
        raise ConfigError(
            "data.device_roots: needs data.class_names to map each device's class folders onto shared label ids; "
            "list the fleet's class names in order under data.class_names"
        )


class _Null:
    """``--set FIELD=null``: set the field to None. A plain None in an overrides mapping means "not given"
    (flags left unset), so an explicit null needs its own marker to get through :func:`apply_overrides`."""

    def __repr__(self) -> str:
        return "null"


NULL: Any = _Null()


def parse_override(text: str) -> tuple[str, Any]:
    """``train.rho=0.4`` -> ("train.rho", 0.4), the value read as YAML; ``null`` -> :data:`NULL`.

    An empty value is refused rather than dropped: the user asked for a change that would not happen."""
    if "=" not in text:
        raise ConfigError(f"--set {text}: expected FIELD=VALUE; write e.g. --set train.rho=0.4")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or not all(key.split(".")):
        raise ConfigError(f"--set {text}: {key!r} is not a field path; write e.g. --set train.rho=0.4")
    if not raw.strip():
        raise ConfigError(
            f"--set {text}: empty value; give a value (e.g. --set {key}=VALUE), or null to clear a field that allows it"
        )
    try:
        value = load_yaml(raw)
    except yaml.YAMLError:
        value = raw
    return key, NULL if value is None else value


def apply_overrides(data: dict, overrides: dict[str, Any]) -> dict:
    """Set dotted paths in a raw config mapping (before validation).

    None means "not given" and is skipped (unset flags); :data:`NULL` sets the field to None."""
    for key, value in overrides.items():
        if value is None:
            continue
        parts = key.split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:  # absent, or an empty section in the YAML file
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"{key}: {where} is a field, not a section; set {where}=VALUE instead")
            node = child
        node[parts[-1]] = None if value is NULL else value
    return data


SHOWN_CHARS = 80  # a bad value quoted in an error: enough to recognise it, never a whole file's worth


def shown(value: Any) -> str:
    """``repr(value)`` for an error message, cut to :data:`SHOWN_CHARS` (a 100,000-item list is one line too)."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = SHOWN_CHARS
    text = short.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


# Fields that moved between sections: old dotted path -> new one. A config that still uses the old path is told
# the new one in its error, rather than that the field is unknown.
MOVED: dict[str, str] = {f"train.{f}": f"hardware.{f}" for f in ("threads", "profile", "memory_budget_mb", "spill_dir")}


def check_moved(data: dict, moved: dict[str, str], source: str | Path | None = None) -> None:
    """One line naming the new place of the first moved field ``data`` still uses: in the file ``source`` (a
    saved run's fleet-config.yaml too, which no ``--set`` can change), else in the ``--set`` flags."""
    for old, new in moved.items():
        section, name = old.split(".")
        part = data.get(section)
        if isinstance(part, dict) and name in part:
            new_section, new_name = new.split(".")
            if source is None:
                raise ConfigError(f"{old}: moved to {new}; write --set {new}=VALUE (docs/config.md lists every field)")
            raise ConfigError(
                f"config file {source}: {old}: moved to {new}; in that file, write it under `{new_section}:` as "
                f"`{new_name}:` (docs/config.md lists every section)"
            )


def config_from_dict(data: dict | None, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    data = apply_overrides(dict(data or {}), overrides or {})
    check_moved(data, MOVED)
    return build_dataclass(ExperimentConfig, data, "")


def read_text_file(path: Path, what: str, fix: str, error: type[FleetError] = ConfigError) -> str:
    """A text file's content, or one line naming ``what`` failed and how to fix it: a YAML file saved in
    another encoding (Latin-1, UTF-16) or unreadable would otherwise end in a traceback."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        byte = f"byte 0x{exc.object[exc.start]:02x} at offset {exc.start}"
        raise error(f"{what} is not UTF-8 text ({byte}); {fix}") from None
    except OSError as exc:
        raise error(f"{what} cannot be read ({exc.strerror or exc}); make it readable by this user") from None


def read_yaml_mapping(path: str | Path, shown: str | Path | None = None, *, what: str | None = None) -> dict:
    """A config file's sections, or a one-line ConfigError saying what is wrong with the file
    (named as ``shown``, the path the user gave, when ``path`` is where it was looked up; or as ``what``, the
    field that named another YAML file, e.g. a class's trace, which no config's sections describe)."""
    path = Path(path)
    label = what or f"config file {shown or path}"
    if not path.is_file():
        raise ConfigError(f"{label} not found; pass an existing YAML file (see simulations/)")
    text = read_text_file(path, label, "save it as UTF-8 YAML (see simulations/)")
    try:
        data = load_yaml(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        fix = "mend that line" if mark else "mend the file"
        raise ConfigError(f"{label} is not valid YAML{where}: {problem}; {fix}") from None
    if not isinstance(data, dict):
        layout = "its fields" if what else "sections (model, data, train)"
        example = "see simulations/" if what else "write it as `section:` blocks like simulations/personalize.yaml"
        raise ConfigError(f"{label}: expected a mapping of {layout}, got {type(data).__name__}; {example}")
    return data


def load_config(
    path: str | Path | None, overrides: dict[str, Any] | None = None, *, ignore_sections: tuple[str, ...] = ()
) -> ExperimentConfig:
    """Read a YAML experiment file (or only defaults when ``path`` is None).

    ``ignore_sections``: sections another tool owns (a fleet file's ``federation``)."""
    data = read_yaml_mapping(path) if path is not None else {}
    check_moved(data, MOVED, path)
    for section in ignore_sections:
        data.pop(section, None)
    return config_from_dict(data, overrides)


def config_to_dict(config: Any) -> dict:
    return dataclasses.asdict(config)

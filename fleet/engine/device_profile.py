"""A device's timing profile: the YAML file ``fleet profile`` writes, and the
timing model that predicts a step's cost from it (docs/algorithms.md section 1)."""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from fleet.base.atomic import write_text_atomic
from fleet.base.errors import ProfileMismatchError
from fleet.base.numbers import is_real
from fleet.engine.config import SHOWN_CHARS, read_text_file, shown
from fleet.engine.yaml_text import YamlRefused, load_yaml

FORMAT_VERSION = 1


@dataclass
class TensorTiming:
    """One trainable tensor: its layer and what training it costs."""

    name: str
    layer: str
    shape: list[int]
    t_dw: float  # weight-gradient time, seconds
    t_opt: float  # optimizer update time, seconds
    t_dy: float  # input-gradient time of its layer; non-zero only on a layer's first tensor


def _number(v: object, low: float, strict: bool) -> bool:
    """A real number (:func:`~fleet.base.numbers.is_real`) above ``low`` (or at it, unless ``strict``)."""
    if not is_real(v):
        return False
    return v > low if strict else v >= low


def first_problem(profile: DeviceProfile) -> str | None:
    """The first field of a loaded profile whose type or value no measurement gives, else None: a string
    time crashed the timing model, and a negative speed factor predicted negative steps and selected nothing."""
    for key in ("t_fw", "speed_factor"):
        if not _number(getattr(profile, key), 0, strict=True):
            return f"{key} {shown(getattr(profile, key))} is not a positive number of seconds or factor"
    for key in ("model", "host", "calibration"):
        if not isinstance(getattr(profile, key), dict):
            return f"{key} {shown(getattr(profile, key))} is not a mapping"
    for key in ("batch_size", "input_size"):
        v = getattr(profile, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            return f"{key} {shown(v)} is not a whole number >= 1"
    for t in profile.tensors:
        for key in ("t_dw", "t_opt", "t_dy"):
            if not _number(getattr(t, key), 0, strict=False):
                return f"tensor {shown(t.name)}: {key} {shown(getattr(t, key))} is not a number of seconds >= 0"
        shape_ok = isinstance(t.shape, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in t.shape)
        if not (isinstance(t.name, str) and isinstance(t.layer, str) and shape_ok):
            return f"tensor {shown(t.name)}: its name, layer or shape is not text, text and a list of whole numbers"
    return None


@dataclass
class DeviceProfile:
    """Measured costs of training each tensor of one model on one device."""

    model: dict  # name, num_classes, in_channels, small_input
    batch_size: int
    input_size: int
    t_fw: float  # fixed cost of any step: forward, loss, optimizer call
    tensors: list[TensorTiming]
    dtype: str = "float32"  # what the forward computes in: float16 for a profile measured under train.amp
    device: str = "cpu"  # the kind of device it was measured on (cpu, cuda); a profile holds only there
    threads: int = 1
    host: dict = field(default_factory=dict)
    repeats: int = 0
    optimizer: str = "sgd"
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    speed_factor: float = 1.0  # > 1 for a simulated slower device tier
    profiling_time_s: float = 0.0  # what measuring this profile cost
    calibration: dict = field(default_factory=dict)  # real step / sum of pieces, forward and backward (applied)
    memory_budget_mb: float | None = None  # the device's activation memory budget; fleet plans every step under it

    # --- the timing model -------------------------------------------------
    @property
    def t_dw(self) -> list[float]:
        """Weight-gradient plus optimizer time per tensor: what selecting it adds."""
        return [(t.t_dw + t.t_opt) * self.speed_factor for t in self.tensors]

    @property
    def t_dy(self) -> list[float]:
        """Input-gradient time per tensor, on each layer's first tensor."""
        return [t.t_dy * self.speed_factor for t in self.tensors]

    @property
    def forward_time(self) -> float:
        return self.t_fw * self.speed_factor

    def step_time(self, mask: Sequence[bool]) -> float:
        """Predicted seconds of one training step that trains the tensors in ``mask``."""
        from fleet.engine.selection import selection_cost

        return self.forward_time + selection_cost(mask, self.t_dw, self.t_dy)

    @property
    def full_step_time(self) -> float:
        return self.step_time([True] * len(self.tensors))

    def backward_budget(self, rho: float) -> float:
        """Seconds left for backward work when a step may take ``rho * T_full``."""
        return rho * self.full_step_time - self.forward_time

    @property
    def min_rho(self) -> float:
        """No selection is faster than the forward pass."""
        return self.forward_time / self.full_step_time

    def scaled(self, factor: float) -> DeviceProfile:
        """The same device slowed down by ``factor`` (a simulated slower tier)."""
        return replace(self, speed_factor=self.speed_factor * factor)

    # --- checks -----------------------------------------------------------
    def check_matches(
        self,
        tensor_names: Sequence[str],
        tensor_shapes: Sequence[Sequence[int]],
        *,
        batch_size: int | None = None,
        input_size: int | None = None,
        source: str = "the profile",
        device: str | None = None,
        dtype: str | None = None,
    ) -> None:
        """Refuse a profile measured for another model, batch or input size, or (given ``device``, ``dtype``)
        on another kind of device or in another precision."""
        self.check_runs_on(device, dtype, source)
        fix = f"re-run `fleet profile` for this model (it was measured on {self.describe()})"
        names = [t.name for t in self.tensors]
        if list(tensor_names) != names:
            missing = [n for n in tensor_names if n not in set(names)]
            extra = [n for n in names if n not in set(tensor_names)]
            detail = (
                f"{len(tensor_names)} tensors in the model, {len(names)} in the profile"
                + (f"; first not profiled: {missing[0]}" if missing else "")
                + (f"; first unknown to the model: {extra[0]}" if extra else "")
                + ("; same names in another order" if not missing and not extra else "")
            )
            raise ProfileMismatchError(f"{source} does not match the model: {detail}; {fix}")
        for t, shape in zip(self.tensors, tensor_shapes):
            if list(shape) != list(t.shape):
                raise ProfileMismatchError(
                    f"{source} does not match the model: {t.name} has shape {list(shape)} in the model, "
                    f"{t.shape} in the profile; {fix}"
                )
        if batch_size is not None and batch_size != self.batch_size:
            raise ProfileMismatchError(
                f"{source} was measured at batch size {self.batch_size}, training uses {batch_size}; "
                f"set the batch size to {self.batch_size} or {fix}"
            )
        if input_size is not None and input_size != self.input_size:
            raise ProfileMismatchError(
                f"{source} was measured at input size {self.input_size}, training uses {input_size}; {fix}"
            )

    def check_runs_on(self, device: str | None, dtype: str | None, source: str = "the profile") -> None:
        """Refuse a profile measured on another kind of device (a CPU's times for a GPU run say nothing of
        it, and the other way round) or in another precision than the run trains in; None: not checked."""
        if device is not None and device != self.device:
            raise ProfileMismatchError(
                f"{source} was measured on {self.device}, training runs on {device}; "
                f"re-run `fleet profile --device {device}` on this machine, or set train.device to {self.device}"
            )
        if dtype is not None and dtype != self.dtype:
            amp = "true" if self.dtype != "float32" else "false"
            raise ProfileMismatchError(
                f"{source} was measured in {self.dtype}, training runs in {dtype}; re-run `fleet profile` "
                f"with the run's train.amp, or set train.amp to {amp}"
            )

    def describe(self) -> str:
        m = self.model
        return f"{m.get('name')} batch {self.batch_size} input {self.input_size} on {self.host.get('hostname', '?')}"

    # --- files ------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d = {"fleet_profile": FORMAT_VERSION, **d}
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "profile") -> DeviceProfile:
        if not isinstance(d, dict) or d.get("fleet_profile") != FORMAT_VERSION:
            raise ProfileMismatchError(
                f"{source} is not a fleet device profile (format {FORMAT_VERSION}); create one with `fleet profile`"
            )
        d = dict(d)
        d.pop("fleet_profile")
        try:
            tensors = [TensorTiming(**t) for t in d.pop("tensors")]
            profile = cls(tensors=tensors, **d)
        except (TypeError, KeyError) as exc:
            raise ProfileMismatchError(
                f"{source} is malformed ({str(exc)[:SHOWN_CHARS]}); re-create it with `fleet profile`"
            ) from None
        problem = first_problem(profile)
        if problem is not None:
            raise ProfileMismatchError(f"{source}: {problem}; re-create it with `fleet profile`")
        mb = profile.memory_budget_mb
        if mb is not None and not _number(mb, 0, strict=True):  # is_real: 10**400 made isfinite overflow
            raise ProfileMismatchError(
                f"{source}: memory_budget_mb {shown(mb)} is not allowed; use a positive number of MB or remove it"
            )
        return profile

    def save(self, path: str | os.PathLike) -> Path:
        if Path(path).is_dir():  # os.replace onto a folder: IsADirectoryError after all the measuring
            raise ProfileMismatchError(f"profile file {path} is a directory; save the profile to a file path")
        return write_text_atomic(path, yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None))

    @classmethod
    def load(cls, path: str | os.PathLike, *, field: str | None = None) -> DeviceProfile:
        """Read a profile file; every problem is one line, starting with ``field`` (the setting that
        named the file, e.g. ``hardware.profile``) when given."""
        path = Path(path)
        what = f"{field}: profile file {path}" if field else f"profile file {path}"
        if path.is_dir():
            raise ProfileMismatchError(f"{what} is a directory; give the profile file (`fleet profile --out FILE`)")
        if not path.is_file():
            raise ProfileMismatchError(f"{what} not found; create it with `fleet profile --out {path}`")
        text = read_text_file(path, what, "re-create it with `fleet profile`", ProfileMismatchError)
        try:
            data = load_yaml(text)
        except yaml.YAMLError as exc:
            line = getattr(getattr(exc, "problem_mark", None), "line", None)
            where = f" at line {line + 1}" if line is not None else ""
            why = f": {exc.problem}" if isinstance(exc, YamlRefused) else ""
            raise ProfileMismatchError(
                f"{what} is not valid YAML{where}{why}; re-create it with `fleet profile`"
            ) from None
        return cls.from_dict(data, source=f"{field}: profile {path}" if field else f"profile {path}")

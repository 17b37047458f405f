"""One edge device of the fleet: its identity, tier, timing profile, memory budget and saved state.

Everything here is read from the fleet config and the device's node config (both untrusted), so
each lookup validates what it reads and names the field in its error.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fleet.base.atomic import load_torch, torch_bytes, write_atomic
from fleet.base.errors import ConfigError
from fleet.engine.accelerator import resolve_device
from fleet.engine.device_profile import DeviceProfile
from fleet.engine.experiment import check_profile, make_model, obtain_profile, run_precision
from fleet.federated.on_device.state_lock import reading, write_locked, writes_held
from fleet.federated.shared import keys
from fleet.federated.shared.classes import bandwidth_of, class_of
from fleet.federated.shared.config import FleetConfig, run_dir
from fleet.federated.shared.names import DEVICES_DIR
from fleet.federated.shared.owned import device_roots
from fleet.federated.shared.paths import resolve_path
from fleet.memory.budgeted import MemoryBudget

PROFILES_DIR = "profiles"  # under node config state-dir: what a device measured of itself, for every run


def tier_of(cfg: FleetConfig, partition_id: int | None, node_config: dict[str, Any]) -> float:
    """The device's speed tier: ``tier`` in the node config, else the config's tiers in turn for a
    simulation-style device, else 1 (a real device runs at its own profile's speed)."""
    if keys.NODE_TIER in node_config:
        tier = _number(node_config[keys.NODE_TIER])
        if not tier > 0:
            raise ConfigError(
                f"node config tier: {node_config[keys.NODE_TIER]!r} is not allowed; "
                "use a slow-down factor > 0 (1 = as profiled)"
            )
        return tier
    if partition_id is None:
        return 1.0
    cls = class_of(cfg, partition_id)
    if cls is not None and cls.fedscale is not None:
        return cls.fedscale.tier(cfg.train.seed, partition_id)  # its client's speed against the trace's median
    if cls is not None:
        return 1.0 if cls.profile is not None else cls.tier  # a class's own profile is its real speed
    tiers = cfg.devices.tiers
    return float(tiers[partition_id % len(tiers)])


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return float("nan")


def threads_of(cfg: FleetConfig, node_config: dict[str, Any]) -> int:
    """Torch threads for the device's ClientApp: node config ``threads`` (its cores), else
    ``simulation.client_threads``."""
    if keys.NODE_THREADS not in node_config:
        return cfg.simulation.client_threads
    threads = _number(node_config[keys.NODE_THREADS])
    if not (math.isfinite(threads) and threads == int(threads) and 1 <= threads <= 1024):
        raise ConfigError(
            f"node config threads: {node_config[keys.NODE_THREADS]!r} is not allowed; use a whole number of "
            "threads from 1 to 1024 (its cores)"
        )
    return int(threads)


def train_device_of(cfg: FleetConfig, node_config: dict[str, Any]) -> str:
    """Where the device trains: node config ``device`` (auto, cpu or cuda; its operator knows its hardware),
    else ``train.device``. Resolved here, so a ``cuda`` request on a host without CUDA is refused when the
    device joins, in one line, rather than failing in its first round."""
    if keys.NODE_DEVICE not in node_config:
        requested, where = cfg.train.device, "train.device"
    else:
        requested, where = str(node_config[keys.NODE_DEVICE]).strip().lower(), "node config device"
    resolve_device(requested, where)
    return requested


def uplink_of(cfg: FleetConfig, node_config: dict[str, Any], partition_id: int | None) -> float:
    """The device's uplink in bytes/s, which it plans its upload at: node config ``uplink-mbps`` (its
    operator knows its link), else its simulated class's, else the fleet's ``devices.bandwidth_mbps``.
    A device that assumed the fleet's rate on a slower link trained and uploaded more than its deadline
    allowed (docs/testbed.md)."""
    if keys.NODE_UPLINK_MBPS not in node_config:
        return bandwidth_of(cfg, partition_id)
    mbps = _number(node_config[keys.NODE_UPLINK_MBPS])
    if not (math.isfinite(mbps) and 0.01 <= mbps <= 100_000):
        raise ConfigError(
            f"node config uplink-mbps: {node_config[keys.NODE_UPLINK_MBPS]!r} is not allowed; use the device's "
            "uplink in Mbit/s, from 0.01 to 100000"
        )
    return mbps * 1e6 / 8


def partition_of(cfg: FleetConfig, node_config: dict[str, Any]) -> int | None:
    """The device's slice of the shared dataset (simulation-style split), or None for a device
    that reads its own files (node config ``data-root``) and has no partition."""
    if keys.NODE_PARTITION_ID not in node_config:
        if node_config.get(keys.NODE_DATA_ROOT):
            return None
        raise ConfigError(
            "node config: neither data-root nor partition-id; start the SuperNode with --node-config "
            "\"data-root='/path/to/images'\" (the device's own data) or \"partition-id=0\" (a shared dataset's slice)"
        )
    raw = node_config[keys.NODE_PARTITION_ID]
    pid = _number(raw)
    if not (math.isfinite(pid) and pid == int(pid) and 0 <= pid < cfg.devices.num_devices):
        raise ConfigError(
            f"node config partition-id: {raw!r} is outside 0..{cfg.devices.num_devices - 1} "
            "(devices.num_devices); pick a partition the fleet has"
        )
    return int(pid)


def data_root_of(cfg: FleetConfig, node_config: dict[str, Any], partition_id: int | None) -> tuple[Path, str] | None:
    """Where the device's own files are, and the field that said so; None: a slice of the shared dataset."""
    if node_config.get(keys.NODE_DATA_ROOT):
        return Path(str(node_config[keys.NODE_DATA_ROOT])).expanduser(), "node config data-root"
    if cfg.data.device_roots and partition_id is not None:
        roots = device_roots(cfg)
        if partition_id >= len(roots):
            raise ConfigError(
                f"data.device_roots: {cfg.data.device_roots} holds {len(roots)} device folders, "
                f"fewer than device {partition_id} needs; set devices.num_devices to {len(roots)}"
            )
        return roots[partition_id], "data.device_roots"
    return None


MEASURED_PROFILE = "device-profile.yaml"  # in a device's profile folder: what it measured of itself, kept


def device_profile(
    cfg: FleetConfig,
    model: nn.Module | None,
    node_config: dict[str, Any],
    profile_dir: Path,
    partition_id: int | None = None,
) -> DeviceProfile:
    """This device's measured profile (node config ``profile``, its class's, or the config's), before its tier.

    A device with none measures itself once and keeps the result in ``profile_dir`` (:func:`profile_dir_of`).
    """
    cls = None if partition_id is None else class_of(cfg, partition_id)
    class_profile = None if cls is None else cls.profile
    path = configured_profile(cfg, node_config, partition_id)
    if path:
        where = "node config profile" if node_config.get(keys.NODE_PROFILE) else "hardware.profile"
        if not node_config.get(keys.NODE_PROFILE) and class_profile:
            where = f"devices.device_classes ({cls.name})"
        base = _checked_profile(resolve_path(str(path)), cfg, model, f"profile {path} ({where})")
    else:
        if model is None:
            model = make_model(cfg.model, cfg.train.seed)
        base = obtain_profile(cfg, model, profile_dir / MEASURED_PROFILE, repeats=5, log=lambda s: None)
    return base


def configured_profile(cfg: FleetConfig, node_config: dict[str, Any], partition_id: int | None) -> str | None:
    """The profile file a device is given (node config ``profile``, its class's, or ``hardware.profile``)."""
    cls = None if partition_id is None else class_of(cfg, partition_id)
    return node_config.get(keys.NODE_PROFILE) or (None if cls is None else cls.profile) or cfg.hardware.profile


def profile_known(cfg: FleetConfig, node_config: dict[str, Any], profile_dir: Path, partition_id: int | None) -> bool:
    """Whether :func:`device_profile` would read a profile rather than measure one (a measurement times real
    steps, so it must run on the model the device trains, not on one prepared ahead with no values yet)."""
    return bool(configured_profile(cfg, node_config, partition_id)) or (profile_dir / MEASURED_PROFILE).is_file()


_PROFILES: dict[tuple, DeviceProfile] = {}  # (file, its mtime and size, what it was checked against) -> profile


def _checked_profile(path: Path, cfg: FleetConfig, model: nn.Module | None, source: str) -> DeviceProfile:
    """The profile file, loaded and (with ``model``) checked against the model once per process while
    the file is unchanged: a simulation worker serves every message of hundreds of devices from the
    same file, and parsing and checking it again took about 60 ms of each. Callers must not change
    the returned profile (``scaled`` makes a new one)."""
    try:
        st = path.stat()
    except OSError:
        return DeviceProfile.load(path)  # names the missing file
    checked = None if model is None else (repr(cfg.model), cfg.train.batch_size, cfg.data.input_size)
    key = (str(path), st.st_mtime_ns, st.st_size, checked)
    if key not in _PROFILES:
        profile = DeviceProfile.load(path)
        if model is not None:
            check_profile(profile, model, cfg.train.batch_size, cfg.data.input_size, source)
        if len(_PROFILES) >= 64:
            _PROFILES.clear()
        _PROFILES[key] = profile
    device, dtype = run_precision(cfg.train)  # where this device trains, which a node config may set
    _PROFILES[key].check_runs_on(device.type, dtype, source)
    return _PROFILES[key]


def memory_budget_of(
    cfg: FleetConfig, partition_id: int | None, node_config: dict[str, Any], profile: DeviceProfile
) -> float | None:
    """The device's activation memory budget in MB (None: unlimited), from the first that sets one:
    node config ``memory-budget-mb``, the device profile's ``memory_budget_mb``,
    ``devices.memory_budgets_mb`` (device i takes entry i % len; 0 = unlimited), ``hardware.memory_budget_mb``."""
    if keys.NODE_MEMORY_BUDGET_MB in node_config:
        try:
            mb = float(node_config[keys.NODE_MEMORY_BUDGET_MB])
        except (TypeError, ValueError):
            mb = float("nan")
        if not mb > 0:
            raise ConfigError(
                f"node config memory-budget-mb: {node_config[keys.NODE_MEMORY_BUDGET_MB]!r} is not allowed; "
                "use a positive number of MB"
            )
        return mb
    if profile.memory_budget_mb is not None:
        return float(profile.memory_budget_mb)
    budgets = cfg.devices.memory_budgets_mb
    if budgets and partition_id is not None:
        mb = float(budgets[partition_id % len(budgets)])
        return mb if mb > 0 else None
    return cfg.hardware.memory_budget_mb


def device_memory(
    cfg: FleetConfig,
    model: nn.Module,
    budget_mb: float,
    state_dir: Path,
    node_config: dict[str, Any],
    profile_dir: Path,
) -> MemoryBudget:
    """Plans for this device's budget; its memory profile is measured once and kept in ``profile_dir``
    (:func:`profile_dir_of`)."""
    shape = (cfg.train.batch_size, cfg.model.in_channels, cfg.data.input_size, cfg.data.input_size)
    spill = node_config.get(keys.NODE_SPILL_DIR) or cfg.hardware.spill_dir or str(state_dir / "spill")
    return MemoryBudget.measure(
        model,
        shape,
        budget_mb,
        str(spill),
        model_name=cfg.model.name,
        cache=profile_dir / "memory-profile.json",
        flag="memory-budget-mb",
        device=resolve_device(train_device_of(cfg, node_config)),
    )


def profile_dir_of(cfg: FleetConfig, name: str, node_config: dict[str, Any]) -> Path:
    """Where a device keeps what it measures of itself, its timing and memory profiles: with node config
    ``state-dir``, its ``profiles`` folder, shared by every run on the device (a pi4 measures both in about 90 s
    at 48 px); else the run's state directory. A profile depends on the device and the model, not the run: each
    is checked against the run's model, batch, input size, threads and kind of device as it is read, and
    measured again where it does not match."""
    root = state_root_of(node_config)
    return root / PROFILES_DIR if root else state_dir_of(cfg, name, node_config)


def state_root_of(node_config: dict[str, Any]) -> Path | None:
    """Node config ``state-dir`` as a path (None: unset): every run's state and the device's profiles under it."""
    root = node_config.get(keys.NODE_STATE_DIR)
    return Path(str(root)).expanduser() if root else None


def check_state_root(node_config: dict[str, Any]) -> None:
    """Node config ``state-dir``, made if missing and checked writable at join: a file there, or a folder the
    device cannot make or write, was a bare OSError in the first round that saved state (or in the memory
    measurement), not a refusal naming the key."""
    path = state_root_of(node_config)
    if path is None:
        return
    root = node_config[keys.NODE_STATE_DIR]
    try:
        path.mkdir(parents=True, exist_ok=True)
        writable = os.access(path, os.W_OK | os.X_OK)
    except (OSError, ValueError) as e:  # a file in its way, no permission, a NUL in the name
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(
            f"node config state-dir: {str(root)!r} cannot be made ({why}); point it at a folder the device can "
            "write, e.g. state-dir='/var/lib/fleet'"
        ) from None
    if not writable:
        raise ConfigError(
            f"node config state-dir: {str(root)!r} is not writable by this device's user; point it at a folder "
            "it can write, or give it that folder"
        )


def state_dir_of(cfg: FleetConfig, name: str, node_config: dict[str, Any]) -> Path:
    """Where device state outlives a round (and a restart): node config ``state-dir``/<run name>,
    else runs/<run name>/devices/<device name>."""
    root = state_root_of(node_config)
    return root / cfg.name if root else run_dir(cfg) / DEVICES_DIR / name


# --- device state that must outlive a round --------------------------------

NEVER = -(10**9)  # the round of an importance never probed: any round is due for a probe


@dataclass
class DeviceState:
    """What a device keeps between rounds in its state directory: in deployment a new ClientApp process
    starts for every message, so its momentum, importance and personalized weights survive only here.

    On disk it is a plain dict of these fields (``torch.load(weights_only=True)`` reads no classes), with the
    keys the dict-shaped state of earlier versions had, so a state saved by them loads as this record."""

    run_tag: str | None = None  # the run the state belongs to; another run's state is ignored
    round: int = 0  # the last round the device trained in
    rounds_trained: int = 0
    optimizer: dict | None = None  # the shared model's optimizer state (momentum); None: fresh
    # what of its personalized model the next global model will not give back (DeviceRound.kept): its personal
    # tensors, FedALA's top ones, Ditto's whole personal model; None: never trained. Shared tensors are not kept:
    # a thousand devices' full copies would fill a disk
    personal: dict[str, torch.Tensor] | None = None
    personal_accuracy: float | None = None  # its personalized model's accuracy on its test split as `round` ended
    importance: list[float] = field(default_factory=list)  # its last local importance, one per tensor
    importance_round: int = NEVER  # the round that importance was probed in
    trained: list[str] | None = None  # the tensors it trained last round; None: no record (keep all momentum)
    # what its personal-model method keeps between rounds (personalization.method): FedALA's merge weights
    # ("ala": {tensor: weights}), APFL's personal model and mixing weight ("v": {tensor: value}, "alpha": float)
    method_state: dict | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict, for :func:`save_state`."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, raw: object) -> DeviceState | None:
        """The state a file held, or None when it is not one (the device then starts afresh rather than
        failing its round on a damaged or foreign file). Unknown keys are ignored, missing ones default."""
        if not isinstance(raw, dict):
            return None
        names = {f.name for f in fields(cls)}
        state = cls(**{k: v for k, v in raw.items() if k in names})
        return state if state.well_formed() else None

    def well_formed(self) -> bool:
        """Every field of the type it is declared with."""
        optional = (
            (self.run_tag, str),
            (self.optimizer, dict),
            (self.personal, dict),
            (self.trained, list),
            (self.method_state, dict),
        )
        return (
            all(v is None or isinstance(v, t) for v, t in optional)
            and all(isinstance(v, int) for v in (self.round, self.rounds_trained, self.importance_round))
            and (self.personal_accuracy is None or isinstance(self.personal_accuracy, float))
            and isinstance(self.importance, list)
            and all(isinstance(v, float) for v in self.importance)
        )


FLOAT16_MAX = 65504.0  # the largest finite float16


def stored_optimizer(state: dict, precision: str) -> dict:
    """The optimizer state as a device saves it between rounds: its float32 buffers in ``precision``
    (``federation.state_precision``).

    Momentum is the bulk of a device's state, and float16 holds it to about 5e-4 of each value: half the
    disk for a thousand devices. A buffer beyond float16's range stays float32 rather than turning into
    infinities. No cast back is needed: ``Optimizer.load_state_dict`` casts every floating buffer to its
    parameter's dtype."""
    if precision == "float32":
        return state

    def small(value: object) -> object:
        fits = isinstance(value, torch.Tensor) and value.dtype == torch.float32
        if fits and bool((value.abs() <= FLOAT16_MAX).all()):  # False for inf and NaN too
            return value.to(torch.float16)
        return value

    buffers = {k: {name: small(v) for name, v in s.items()} for k, s in state["state"].items()}
    return {**state, "state": buffers}


def save_state(path: Path, state: DeviceState, *, precision: str = "float32", defer: bool = False) -> None:
    """Atomic: a device killed mid-write keeps its previous state. Its momentum is stored in ``precision``
    (:func:`stored_optimizer`). With ``defer`` (a long-lived process) the file is written on a thread,
    under a lock that :func:`load_state` waits for (:mod:`.state_lock`); the bytes are made here, so
    that the thread holds nothing but them (see state_lock's design notes on memory). In a task whose
    writes are held (``fleet device runtime``), bytes and write both wait until its reply is out."""

    def state_bytes() -> bytes:
        optimizer = None if state.optimizer is None else stored_optimizer(state.optimizer, precision)
        return torch_bytes({**state.to_dict(), "optimizer": optimizer})

    def write(data: bytes) -> None:
        write_atomic(path, lambda fh: fh.write(data), binary=True)

    if writes_held():
        write_locked(path, lambda: write(state_bytes()), defer=True)
        return
    data = state_bytes()
    write_locked(path, lambda: write(data), defer=defer)


def load_state(path: Path, run_tag: str | None = None) -> DeviceState | None:
    """The device's state from earlier rounds of this run (another run's state, or a file that holds no
    state, is ignored); ``run_tag`` None accepts any run's. A write of it under way is waited for."""
    with reading(path):
        raw = load_torch(path)
    state = DeviceState.from_dict(raw)
    if state is not None and run_tag is not None and state.run_tag != run_tag:
        return None
    return state

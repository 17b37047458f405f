"""What a device does for each message the server sends: query, train, evaluate.

Flower-free: the ClientApp (client/client_app.py) unpacks a Message into the
run config, the node config, the global weights and the round's config, calls one
of these functions, and packs the result into its reply. State that must outlive
a round (personalized weights, momentum, importance) is written atomically to the
device's state directory: in deployment a new ClientApp process starts for every
message, so nothing in memory survives.

Design note, **prepared ahead**: what a message needs besides the weights it brings (the device's data,
its state, its model's storage, its profile and memory plan) is one :class:`Prepared`. A deployed device's
runtime makes it while the message's bytes download (:func:`prepare`, from ``fleet device runtime``); the
message takes it if it was made for this very device and config, else makes it in line. The model's storage
is allocated and touched then, and the message's float16 weights are cast into it once they are in: never
copied out of the message first.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fleet.base.process import process_age_s, task_pull_s
from fleet.data.datasets import ArrayDataset
from fleet.engine.accelerator import check_memory_budget, resolve_device
from fleet.engine.device_profile import DeviceProfile
from fleet.engine.experiment import empty_model, make_model
from fleet.engine.trainer import accuracy
from fleet.federated.on_device.device import (
    DeviceState,
    check_state_root,
    data_root_of,
    device_memory,
    device_profile,
    load_state,
    memory_budget_of,
    partition_of,
    profile_dir_of,
    profile_known,
    save_state,
    state_dir_of,
    threads_of,
    tier_of,
    train_device_of,
    uplink_of,
)
from fleet.federated.on_device.round import DeviceRound, RoundResult, full_round_time
from fleet.federated.shared import keys
from fleet.federated.shared.config import FleetConfig
from fleet.federated.shared.names import device_name_of
from fleet.federated.shared.personal import overlay_personal, personal_names
from fleet.federated.shared.records import TrainOrder
from fleet.federated.shared.split import DeviceData, device_data, own_device_data
from fleet.federated.shared.transfer import encode_upload, keep_received
from fleet.memory.budgeted import MemoryBudget

STATE_FILE = "state.pt"
DECODED_DIR = "decoded-images"  # a deployed device's decoded images, kept for its next message (fleet.data.decoded)


@dataclass
class Device:
    """One device as its node config and the fleet config describe it."""

    cfg: FleetConfig
    partition_id: int | None  # its slice of a shared dataset; None when it reads its own files
    name: str
    node_config: dict[str, Any]
    # its process serves many messages (a simulation worker), so its state is written after the reply
    # (fleet.federated.on_device.state_lock); a deployed ClientApp process ends with its one message and writes in line
    long_lived: bool = False

    @classmethod
    def from_configs(cls, cfg: FleetConfig, node_config: Mapping[str, Any], *, long_lived: bool = False) -> Device:
        node_config = dict(node_config)
        torch.set_num_threads(threads_of(cfg, node_config))
        device = train_device_of(cfg, node_config)
        if device != cfg.train.device:  # every trainer of the device reads train.device
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, device=device))
        pid = partition_of(cfg, node_config)
        return cls(cfg, pid, device_name_of(cfg, node_config, pid), node_config, long_lived)

    @property
    def state_dir(self) -> Path:
        return state_dir_of(self.cfg, self.name, self.node_config)

    @property
    def profile_dir(self) -> Path:
        return profile_dir_of(self.cfg, self.name, self.node_config)

    @property
    def seed(self) -> int:
        """Seeds the device's batch order: its partition, else a stable number from its name."""
        return self.partition_id if self.partition_id is not None else zlib.crc32(self.name.encode()) % 100_000

    def data(self) -> DeviceData:
        """Its own files when it has them (node config data-root, data.device_roots), else its slice. A deployed
        device keeps its decoded images in its state directory: its process lasts one message."""
        own = data_root_of(self.cfg, self.node_config, self.partition_id)
        if own is None:
            return device_data(self.cfg, self.partition_id)
        return own_device_data(self.cfg, *own, cache_dir=None if self.long_lived else self.state_dir / DECODED_DIR)

    def profile(self, model: nn.Module | None = None) -> DeviceProfile:
        """Its measured profile times its tier (checked against ``model`` when given)."""
        base = device_profile(self.cfg, model, self.node_config, self.profile_dir, self.partition_id)
        return base.scaled(tier_of(self.cfg, self.partition_id, self.node_config))

    @property
    def bandwidth(self) -> float:
        """Its uplink in bytes/s (node config ``uplink-mbps``, its class's, else the fleet's)."""
        return uplink_of(self.cfg, self.node_config, self.partition_id)

    def identity(self) -> dict[str, int]:
        """The partition a simulation-style device trains on, for its metrics (nothing for the others)."""
        return {} if self.partition_id is None else {keys.PARTITION_ID: self.partition_id}


@dataclass
class Prepared:
    """What a device's message needs besides the weights it brings: its data, its state as on disk, its model
    with storage of its own, and its profile and memory plan (design note: prepared while the bytes come)."""

    device: Device
    data: DeviceData
    state: DeviceState | None  # any run's: the message's run tag picks it (:meth:`state_of`)
    model: nn.Module  # all zeros until :meth:`holding` fills it
    _setup: tuple[DeviceProfile, MemoryBudget | None] | None = None

    @classmethod
    def made(cls, device: Device) -> Prepared:
        return cls(device, device.data(), load_state(device.state_dir / STATE_FILE), empty_model(device.cfg.model))

    @property
    def setup(self) -> tuple[DeviceProfile, MemoryBudget | None]:
        """The device's profile and memory plan (:func:`device_setup`), made once: read, they need the model's
        shapes only (measured, its values too: :func:`prepare`), and an evaluate message without fine-tuning
        never asks."""
        if self._setup is None:
            self._setup = device_setup(self.device, self.model)
        return self._setup

    def holding(self, weights: Mapping[str, torch.Tensor]) -> nn.Module:
        """The model, now holding exactly ``weights`` (the global model the message carries), each cast into
        place: every tensor named, and no other (``strict``), as a message's weights must be."""
        self.model.load_state_dict(weights, strict=True)
        return self.model

    def state_of(self, run_tag: str | None) -> DeviceState:
        """The device's state from this run's earlier rounds, else a fresh one (another run's is ignored)."""
        fresh = self.state is None or (run_tag is not None and self.state.run_tag != run_tag)
        return DeviceState(run_tag=run_tag) if fresh else self.state


_PREPARED: list[Prepared] = []  # the one message's worth prepared ahead, in this process (at most one)


def prepare(device: Device) -> None:
    """Make what ``device``'s next message needs before its bytes are in (``fleet device runtime`` calls this
    while they download). A mistake here (a bad data tree, a profile that does not fit) is left for the message
    itself to meet and report, with its own one-line reason."""
    _PREPARED.clear()
    ready_made = Prepared.made(device)
    if profile_known(device.cfg, device.node_config, device.profile_dir, device.partition_id):
        ready_made.setup  # noqa: B018 - made now, while the bytes download (a measurement waits for the weights)
    _PREPARED.append(ready_made)


def take_prepared(device: Device) -> Prepared | None:
    """What :func:`prepare` made for this very device and config, once; None when nothing was."""
    found = [p for p in _PREPARED if p.device == device]
    _PREPARED.clear()
    return found[0] if found else None


_REFERENCE: dict[str, nn.Module] = {}  # repr(model config) -> the model built once in this process


def reference_model(cfg: FleetConfig) -> nn.Module:
    """The fleet's model, built once per process (a simulation worker answers hundreds of queries): a
    profile is checked against its tensor shapes, and a device without one profiles itself on it."""
    key = repr(cfg.model)
    if key not in _REFERENCE:
        _REFERENCE.clear()
        _REFERENCE[key] = make_model(cfg.model, cfg.train.seed)
    return _REFERENCE[key]


def query(device: Device) -> dict[str, float | int]:
    """This device's full-training time for a round (the server's default deadline), floor and data
    size. Its data, its profile (against the fleet's model: another model's times would set the
    fleet's deadline) and its memory budget are read here, so a device with a bad tree or node config
    is refused when it joins, with its own one-line error, rather than failing every round later. A deployed
    device with a budget measures its activation memory here too (kept for its later runs too,
    :func:`~fleet.federated.on_device.device.profile_dir_of`): a fifth of a core took 13 s for it, which its first
    training round's bound knew nothing of."""
    ready = readiness()  # counted, so that a simulation worker's later messages report no lifetime
    check_state_root(device.node_config)
    model = reference_model(device.cfg)
    profile = device.profile(model)
    budget = memory_budget_of(device.cfg, device.partition_id, device.node_config, profile)
    where = "the device's memory budget (node config memory-budget-mb, devices.memory_budgets_mb or hardware.*)"
    check_memory_budget(resolve_device(device.cfg.train.device), budget, where, amp=device.cfg.train.amp)
    uplink_of(device.cfg, device.node_config, device.partition_id)  # a bad uplink-mbps is refused here too
    if budget is not None and not device.long_lived:  # measured once, at join: its first round starts as warm
        # (the measurement restores the reference model it runs on)
        device_memory(device.cfg, model, budget, device.state_dir, device.node_config, device.profile_dir)
    return {
        **device.identity(),
        **ready,
        keys.TIER: profile.speed_factor,
        keys.FULL_TIME_S: full_round_time(device.cfg, profile),
        keys.MIN_RHO: profile.min_rho,
        keys.NUM_EXAMPLES: len(device.data().train),
    }


_HANDLED = [0]  # messages this process has handled: a deployed ClientApp handles one, a simulation worker many


def readiness() -> dict[str, float]:
    """``ready_s``, the process's age as its work starts, on the first message it handles: for a deployed
    device, that message's start, imports and setup (fleet.base.process), less the message's own download
    where the runtime timed it (``fleet device runtime``); later messages of a long-lived simulation worker
    would report its lifetime, so they report nothing. What the runtime prepared while the message downloaded
    (:func:`prepare`) counts with the download: ``ready_s`` is what the message still had to do once in."""
    _HANDLED[0] += 1
    age = process_age_s() if _HANDLED[0] == 1 else None
    return {} if age is None else {keys.READY_S: max(0.0, age - task_pull_s())}


def train(device: Device, weights: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> RoundResult:
    """Train elastically from the global ``weights`` within this device's budget; keep its state."""
    cfg = device.cfg
    order = TrainOrder.from_config(config, cfg.federation.strategy)
    sent = keep_received(weights, cfg.federation.transfer)  # what the upload's changes are taken against
    ready_made = take_prepared(device) or Prepared.made(device)
    model = ready_made.holding(weights)
    profile, memory = ready_made.setup
    state = ready_made.state_of(order.run_tag)
    personal = personal_names(model, cfg.personalization.policy)
    overlay_personal(model, personal, state.personal)
    data = ready_made.data.train
    ready = readiness()  # before the last round's scoring: that is evaluation work, timed as eval_time_s
    received = score_received(device, model, state, ready_made.data.test) if order.score_received else {}
    device_round = DeviceRound(cfg, model, profile, data, device.seed, state, memory, personal, device.bandwidth)
    result = device_round.train(order)
    result.arrays = encode_upload(result.arrays, sent, cfg.federation.transfer)  # as the message carries it
    result.metrics.update({**device.identity(), **ready, **received})
    if result.personalized is not None:  # scored now: the state keeps too little to rebuild it later
        started = time.perf_counter()
        model.load_state_dict(result.personalized, strict=True)
        result.state.personal_accuracy = accuracy(model, ready_made.data.test, cfg.data.input_size)
        result.metrics[keys.SCORE_TIME_S] = time.perf_counter() - started
    state_path = device.state_dir / STATE_FILE
    save_state(state_path, result.state, precision=cfg.federation.state_precision, defer=device.long_lived)
    return result


def score_received(device: Device, model: nn.Module, state: DeviceState, test: ArrayDataset) -> dict[str, float | int]:
    """The last round's evaluation, riding on this round's train message (``evaluation.pipelined``): the model
    received (with the device's personal tensors) on its held-out split, and its personalized model's score
    from its last training; the model is left in the mode it came in, to be trained."""
    started, training = time.perf_counter(), model.training
    scores = held_out_scores(model, test, device.cfg.data.input_size, state)
    model.train(training)
    return {**scores, keys.TEST_EXAMPLES: len(test), keys.EVAL_TIME_S: time.perf_counter() - started}


def held_out_scores(
    model: nn.Module, test: ArrayDataset, input_size: int | None, state: DeviceState
) -> dict[str, float]:
    """The global model's accuracy on the held-out split, and the personalized model's as its last training
    scored it (a device that never trained is personalized to nothing yet: the global model's)."""
    global_acc = accuracy(model, test, input_size)
    personal = global_acc if state.personal_accuracy is None else state.personal_accuracy
    return {keys.GLOBAL_ACCURACY: global_acc, keys.PERSONAL_ACCURACY: personal}


def device_setup(device: Device, model: nn.Module) -> tuple[DeviceProfile, MemoryBudget | None]:
    """The device's profile (checked against ``model``) and its activation memory plan, if it has a budget."""
    cfg = device.cfg
    profile = device.profile(model)
    budget_mb = memory_budget_of(cfg, device.partition_id, device.node_config, profile)
    if budget_mb is None:
        return profile, None
    return profile, device_memory(cfg, model, budget_mb, device.state_dir, device.node_config, device.profile_dir)


def evaluate(
    device: Device, weights: Mapping[str, torch.Tensor], config: Mapping[str, Any] | None
) -> dict[str, float | int]:
    """Accuracy on the device's held-out split of the global model (with its own personal tensors), of
    that model fine-tuned (``personalization.finetune_steps``), and of this device's personalized model."""
    cfg = device.cfg
    started = time.perf_counter()
    run_tag = None if config is None else str(config.get(keys.RUN_TAG, ""))
    ready_made = take_prepared(device) or Prepared.made(device)
    data, model, state = ready_made.data, ready_made.holding(weights), ready_made.state_of(run_tag)
    # the device's model is the global shared tensors plus its own personal ones (personalization.policy)
    personal = personal_names(model, cfg.personalization.policy)
    overlay_personal(model, personal, state.personal)
    out: dict[str, float | int] = {**device.identity(), **readiness(), keys.NUM_EXAMPLES: len(data.test)}
    out.update(held_out_scores(model, data.test, cfg.data.input_size, state))
    if cfg.personalization.finetune_steps and config is not None and keys.SERVER_ROUND in config:
        order = TrainOrder.from_config(config, cfg.federation.strategy)
        profile, memory = ready_made.setup
        device_round = DeviceRound(cfg, model, profile, data.train, device.seed, state, memory, personal)
        out[keys.FINETUNE_TIME_S] = device_round.finetune(order)
        out[keys.FINETUNED_ACCURACY] = accuracy(model, data.test, cfg.data.input_size)
    if (
        state.personal_accuracy is None
        and state.personal is not None
        and state.personal.keys() == model.state_dict().keys()
    ):
        model.load_state_dict(state.personal, strict=True)  # an earlier version's state: a whole model, unscored
        out[keys.PERSONAL_ACCURACY] = accuracy(model, data.test, cfg.data.input_size)
    out[keys.EVAL_TIME_S] = time.perf_counter() - started
    return out

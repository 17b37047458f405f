"""A device's local work for one message: a training round, or fine-tuning before evaluation.

Flower-free: the ClientApp translates the server's Message into a :class:`TrainOrder` and the
:class:`RoundResult` back into a reply. A :class:`DeviceRound` holds one device as a message
finds it (its config, the model holding the global weights and its own personal tensors, its
profile, data, memory budget and :class:`~fleet.federated.on_device.device.DeviceState`) and runs one of
its modes, each described by a :class:`LocalWork`: how many steps, on how many models, within
which share of the deadline, with or without the upload in the budget.

* :meth:`DeviceRound.train`: a training round. The round deadline ``D`` and the device's own
  profile give its budget (docs/algorithms.md section 5: ``rho_n = min(1, D / T_full,n)``, less
  what the round costs anyway: an importance probe, the upload), and
  :meth:`fleet.engine.trainer.Trainer.reselect` selects under a
  :class:`~fleet.engine.policies.SelectionPolicy` (FedEL's window and blending for the ``fleet``
  strategy). Under Ditto a second step trains the device's personal model.
* :meth:`DeviceRound.finetune`: the global model fine-tuned before it is scored, elastic like a
  round but with a fresh optimizer, no probe and nothing uploaded or kept.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from fleet.data.datasets import ArrayDataset, batches
from fleet.engine.accelerator import host_copy
from fleet.engine.device_profile import DeviceProfile
from fleet.engine.experiment import model_with_weights
from fleet.engine.models import head_parameter_names
from fleet.engine.policies import Blend, SelectionPolicy, Window
from fleet.engine.selection import select_tensors
from fleet.engine.trainer import RESTORE_PROBE_STEPS, Trainer
from fleet.federated.on_device.device import DeviceState
from fleet.federated.on_device.local_methods import (
    ALA_FIRST_PASSES,
    Apfl,
    ala_names,
    body_only,
    head_mask,
    learn_ala,
)
from fleet.federated.shared import keys
from fleet.federated.shared.config import FleetConfig, compute_steps
from fleet.federated.shared.personal import TWO_MODELS, method_of, models_of
from fleet.federated.shared.records import TrainOrder, speedup
from fleet.federated.shared.transfer import wire_bytes
from fleet.memory.budgeted import MemoryBudget

PERSONAL_SEED_OFFSET = 7919  # Ditto's personal model draws its batches apart from the shared update's
HEAD_SEED_OFFSET = 104729  # ... and FedRep's head steps and FedALA's merge theirs


@dataclass
class RoundResult:
    arrays: dict[str, torch.Tensor]  # only what the device trained (plus its norm statistics)
    metrics: dict[str, float | int]
    state: DeviceState  # device state to keep for the next round
    # the device's whole personalized model after the round, to be scored now: the state keeps only what the
    # next global model will not give back (see DeviceRound.kept)
    personalized: dict[str, torch.Tensor] | None = None


def full_round_time(cfg: FleetConfig, profile: DeviceProfile) -> float:
    """Seconds the round's local steps take on this device when it trains every tensor."""
    return compute_steps(cfg) * profile.full_step_time


@dataclass(frozen=True)
class LocalWork:
    """What one mode of a device's round asks of it; its budget and selection follow from this alone."""

    strategy: str  # how tensors are chosen: fleet (FedEL's window and blending), naive, ditto, fedavg
    steps: int  # local steps of each model
    models: int  # models trained on those steps: 2 under Ditto (the shared update and the personal model)
    deadline_s: float  # this work's share of the round deadline; <= 0: none, every tensor is trained
    with_upload: bool  # the upload is paid out of ``deadline_s`` (federation.deadline_includes_upload)

    @property
    def compute_steps(self) -> int:
        """Steps the device computes, every model's."""
        return self.steps * self.models

    def full_time_s(self, profile: DeviceProfile) -> float:
        """Seconds the work takes on this device when it trains every tensor."""
        return self.compute_steps * profile.full_step_time


def round_work(cfg: FleetConfig, plan: TrainOrder) -> LocalWork:
    """A training round: ``federation.local_steps`` on the shared model, as many again on the personal one
    under Ditto, within the whole deadline (the server sends none under FedAvg: the device trains fully)."""
    return LocalWork(
        strategy=plan.strategy,
        steps=cfg.federation.local_steps,
        models=models_of(method_of(plan.strategy, cfg.personalization.method)),
        deadline_s=plan.deadline_s,
        with_upload=cfg.federation.deadline_includes_upload,
    )


def finetune_work(cfg: FleetConfig, plan: TrainOrder) -> LocalWork:
    """Fine-tuning before evaluation: ``personalization.finetune_steps`` on one model (under Ditto too: the
    global model is fine-tuned, its tensors chosen as ``naive`` chooses), within the share of the deadline
    a round gives that many steps; nothing is uploaded, so no upload is in its budget."""
    strategy = "naive" if plan.strategy == "ditto" else plan.strategy
    steps = cfg.personalization.finetune_steps
    share = plan.deadline_s * steps / round_work(cfg, plan).compute_steps
    return LocalWork(strategy, steps, 1, share, with_upload=False)


def rho_floor(cfg: FleetConfig, profile: DeviceProfile) -> float:
    """The least fraction of a full step a device's selection may cost: its forward pass (no selection is
    cheaper) plus ``elastic.min_rho_margin``, so something is left to train however short the deadline."""
    return min(1.0, profile.min_rho + cfg.elastic.min_rho_margin)


def step_budget(cfg: FleetConfig, profile: DeviceProfile, work_budget_s: float, compute_steps: int) -> float:
    """Backward seconds per local step when ``compute_steps`` steps may take ``work_budget_s`` (the deadline
    minus what the device must spend anyway: an importance probe, norm statistics' upload). Never below the
    device's floor (:func:`rho_floor` of a full step, less its forward pass)."""
    per_step = work_budget_s / compute_steps - profile.forward_time
    floor = rho_floor(cfg, profile) * profile.full_step_time - profile.forward_time
    return max(per_step, floor)


def tensor_upload_s(params: list[torch.Tensor], bandwidth_bytes_per_s: float, transfer: str) -> list[float]:
    """Seconds to upload each trainable tensor over the device's uplink, in the fleet's transfer dtype."""
    return [wire_bytes(p, transfer) / bandwidth_bytes_per_s for p in params]


def float_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Norm running statistics: every forward pass in training mode updates them, trained or not."""
    return {n: b for n, b in model.named_buffers() if b.is_floating_point()}


def drop_stale_momentum(
    optimizer: torch.optim.Optimizer, names: list[str], params: list[torch.Tensor], trained: list[str] | None
) -> None:
    """Forget the optimizer state of tensors this device did not train in its previous round.

    Momentum is kept between rounds, but a tensor that sat out (outside the sliding window, or not
    selected) has a buffer built on an older global model, worth several steps in a stale
    direction: left in place it kicks the tensor on the first step after it rejoins. Tensors
    trained last round keep their momentum, so full training (FedAvg) is unaffected.
    """
    if trained is None:
        return  # no record of the last round: keep everything
    keep = set(trained)
    for n, p in zip(names, params):
        if n not in keep:
            optimizer.state.pop(p, None)


@dataclass
class RoundBudget:
    """What this round's local work may cost the device, from the deadline and its uplink."""

    deadline_s: float  # <= 0: no deadline
    full_time_s: float  # training every tensor for the round's local steps
    upload_s: list[float]  # per tensor (0 when the deadline is compute only)
    buffers_s: float  # uploading the norm statistics, which every trained round sends

    def less(self, seconds: float) -> RoundBudget:
        """The budget after ``seconds`` of the round went elsewhere (a method's steps before selection);
        no deadline stays none."""
        if self.deadline_s <= 0 or seconds <= 0:
            return self
        return dataclasses.replace(self, deadline_s=max(self.deadline_s - seconds, 1e-9))

    @property
    def trains_fully(self) -> bool:
        """No deadline, or one that already covers full training and the whole upload."""
        total = self.full_time_s + sum(self.upload_s) + self.buffers_s
        return self.deadline_s <= 0 or self.deadline_s >= total * (1 - 1e-9)


def round_budget(
    trainer: Trainer,
    work: LocalWork,
    bandwidth_bytes_per_s: float,
    transfer: str,
    personal: frozenset[str] = frozenset(),
) -> RoundBudget:
    """What ``work`` may cost on this device, over its uplink. A personal tensor costs compute like any
    other but no upload: it never leaves the device."""
    full = work.full_time_s(trainer.profile)
    if not work.with_upload:
        return RoundBudget(work.deadline_s, full, [0.0] * len(trainer.names), 0.0)
    buffers = sum(wire_bytes(b, transfer) for n, b in float_buffers(trainer.model).items() if n not in personal)
    seconds = tensor_upload_s(trainer.params, bandwidth_bytes_per_s, transfer)
    upload = [0.0 if n in personal else s for n, s in zip(trainer.names, seconds)]
    return RoundBudget(work.deadline_s, full, upload, buffers / bandwidth_bytes_per_s)


def round_seed(cfg: FleetConfig, server_round: int, device_seed: int) -> int:
    """Seeds a round's batch order: another each round and on each device, the same on a rerun."""
    return cfg.train.seed + 1000 * server_round + device_seed


def round_trainer(
    cfg: FleetConfig, model: nn.Module, profile: DeviceProfile, memory: MemoryBudget | None, seed: int
) -> Trainer:
    """A trainer for a round's model with a fresh optimizer. It trains ``full`` (every tensor) until the
    round's :class:`~fleet.engine.policies.SelectionPolicy` selects, so ``train.method`` and ``train.rho``
    (``fleet train``'s) play no part on a device."""
    train = dataclasses.replace(cfg.train, method="full", seed=seed)
    return Trainer(model, train, profile, memory, input_size=cfg.data.input_size)


def restore_momentum(trainer: Trainer, state: DeviceState) -> None:
    """The device's momentum from earlier rounds, less that of tensors it did not train last round."""
    if state.optimizer is not None:
        try:
            trainer.optimizer.load_state_dict(state.optimizer)
        except (ValueError, KeyError, RuntimeError):
            pass  # another model layout: start with fresh momentum
    drop_stale_momentum(trainer.optimizer, trainer.names, trainer.params, state.trained)


def round_policy(
    cfg: FleetConfig, trainer: Trainer, plan: TrainOrder, work: LocalWork, budget: RoundBudget, probe_cost: float
) -> SelectionPolicy:
    """The device's selection policy: its deadline as a budget, each tensor's upload as a cost,
    and for the ``fleet`` strategy FedEL's blending and window."""
    fleet = work.strategy == "fleet"
    blend = (
        Blend(plan.global_importance, cfg.elastic.blend_beta)
        if fleet and cfg.elastic.blend_beta is not None and plan.global_importance
        else None
    )
    window = None
    if fleet and cfg.elastic.window:
        head = frozenset(head_parameter_names(trainer.model))
        window = Window(
            plan.server_round,
            head,
            cfg.elastic.num_blocks,
            cfg.elastic.window_blocks,
            cfg.elastic.window_schedule,
            cfg.elastic.window_mode,
            cfg.elastic.window_fit,
        )
    steps = work.compute_steps
    return SelectionPolicy(
        budget_s=step_budget(cfg, trainer.profile, budget.deadline_s - probe_cost - budget.buffers_s, steps),
        extra_costs=[u / steps for u in budget.upload_s],  # a tensor's upload, spread over the steps
        blend=blend,
        window=window,
        charge_memory=True,
    )


def probe_pays(budget: RoundBudget, probe_s: float) -> bool:
    """Whether an importance probe can pay for itself: only when the round must shed more time than the
    probe costs. A device whose budget covers nearly everything (a fast one, short only of part of its
    upload) would spend more on the probe than any selection saves; it reuses its last importance instead."""
    shortfall = budget.full_time_s + sum(budget.upload_s) + budget.buffers_s - budget.deadline_s
    return shortfall > probe_s


def probe_fits(budget: RoundBudget, probe_s: float, floor: float) -> bool:
    """Whether a probe leaves the round's cheapest selection (``floor``, a fraction of full training) inside the
    deadline. A slow device whose probe does not fit overruns the deadline on every probe round, and the whole
    fleet's round waits for it; it selects by its last (or the server's) importance instead."""
    cheapest_s = probe_s + floor * budget.full_time_s + budget.buffers_s
    return budget.deadline_s <= 0 or cheapest_s <= budget.deadline_s


def uploaded_s(budget: RoundBudget, mask: list[bool]) -> float:
    """Seconds the reply of a round that trained ``mask`` takes to upload: its tensors and the norm statistics."""
    return sum(u for u, m in zip(budget.upload_s, mask) if m) + budget.buffers_s


def own_selection(profile: DeviceProfile, importance: list[float], left_s: float, steps: int) -> list[bool]:
    """Ditto's personal model's own tensors (``personalization.personal_selection: own``): the most important
    that fit ``left_s`` over ``steps`` steps, by compute alone (it is never sent)."""
    per_step = max(left_s / steps - profile.forward_time, 0.0)
    return select_tensors(importance, profile.t_dw, profile.t_dy, per_step)


@dataclass
class Importance:
    """A device's local importance, one per tensor, and the round it was probed in."""

    values: list[float]
    probed_round: int


def select_for_round(
    cfg: FleetConfig,
    trainer: Trainer,
    data: ArrayDataset,
    plan: TrainOrder,
    work: LocalWork,
    budget: RoundBudget,
    last: Importance,
) -> tuple[float, Importance]:
    """Select a training round's tensors through :meth:`Trainer.reselect`, probing importance when it is
    due and pays (else reusing ``last``); returns (the probe's cost in simulated seconds, the importance)."""
    if budget.trains_fully:  # the round's trainer starts with every tensor selected (method "full")
        return 0.0, last
    importance = last
    probe_cost = 0.0
    known = len(last.values) == len(trainer.names)
    due = not known or plan.server_round - last.probed_round >= cfg.elastic.importance_interval
    probe_s = RESTORE_PROBE_STEPS * (trainer.profile.full_step_time + trainer.memory_added_s())
    pays = probe_pays(budget, probe_s) or not cfg.elastic.probe_only_when_it_pays
    fits = probe_fits(budget, probe_s, rho_floor(cfg, trainer.profile)) or not cfg.elastic.probe_only_when_it_fits
    if due and pays and fits:
        importance = Importance(trainer.probe_importance(trainer.probe_batch(data)), plan.server_round)
        probe_cost = probe_s
    elif not known:
        importance = Importance([1.0] * len(trainer.names), last.probed_round)  # the DP keeps as many as fit
    policy = round_policy(cfg, trainer, plan, work, budget, probe_cost)
    trainer.reselect(importance=importance.values, policy=policy)
    return probe_cost, importance


def train_steps(
    trainer: Trainer, train: ArrayDataset, steps: int, each: Callable[[torch.Tensor, torch.Tensor], float] | None = None
) -> list[float]:
    """``steps`` local steps, re-shuffling on every pass over the device's data; ``each`` (APFL's personal
    step) runs on every batch after the shared model's step."""
    endless = (xy for _ in itertools.count() for xy in trainer.shuffled_batches(train))
    losses = []
    for x, y in itertools.islice(endless, steps):
        losses.append(trainer.train_step(x, y))
        if each is not None:
            each(x, y)
    return losses


def upload(trainer: Trainer, steps: int, personal: frozenset[str]) -> dict[str, torch.Tensor]:
    """What the reply carries (its values; ``tasks.train`` encodes them, ``federation.transfer``): the trained
    shared tensors and, after any step, the norm statistics (every forward pass in training mode moves them);
    never a personal tensor."""
    trained = zip(trainer.names, trainer.params, trainer.mask)
    arrays = {n: host_copy(p) for n, p, m in trained if m and n not in personal}
    if steps:
        arrays.update({n: host_copy(b) for n, b in float_buffers(trainer.model).items() if n not in personal})
    return arrays


def weights_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every tensor of ``model``'s state, in host memory (a model on a GPU included)."""
    return {k: host_copy(t) for k, t in model.state_dict().items()}


@dataclass(frozen=True)
class RoundTimes:
    """A training round's seconds."""

    predicted_s: float  # simulated, on this device: every model's steps under its memory plan, and the probe
    measured_s: float  # wall clock of the selection and the steps
    added_s: float  # what a step's memory plan adds (0 without a budget)


@dataclass
class Trained:
    """What a training round's steps left: the shared model's trainer, how many steps it took and their
    losses, the importance it selected by, and the personal model Ditto trained beside it (None otherwise)."""

    trainer: Trainer
    steps: int
    losses: list[float]
    importance: Importance
    times: RoundTimes
    personal_model: dict[str, torch.Tensor] | None
    method_state: dict | None = None  # what the personal-model method keeps for the next round


@dataclass
class BeforeSteps:
    """What a method did before the round's selection (FedALA's merge, FedRep's head steps)."""

    device_s: float  # its simulated seconds on this device, paid out of the round's budget
    measured_s: float  # its wall clock
    method_state: dict | None = None


@dataclass
class DeviceRound:
    """One device as a message finds it, and its local work in each mode: :meth:`train` (a training round,
    Ditto's personal model one step of it) and :meth:`finetune` (the global model fine-tuned before it is
    scored). The state it starts from is the device's; :meth:`train` returns the state to keep."""

    cfg: FleetConfig
    model: nn.Module  # the global weights with the device's own personal tensors over them; trained in place
    profile: DeviceProfile  # its own, times its tier
    data: ArrayDataset  # its training split
    device_seed: int  # seeds its batch order (with the round)
    state: DeviceState = field(default_factory=DeviceState)  # from its earlier rounds of this run
    memory: MemoryBudget | None = None  # its activation memory plan; None: unlimited
    personal: frozenset[str] = frozenset()  # tensors it keeps to itself (personalization.policy): never uploaded
    bandwidth_bytes_per_s: float | None = None  # its own uplink (a simulated device's class); None: the fleet's

    @property
    def uplink(self) -> float:
        """Bytes per second its upload moves at."""
        return self.bandwidth_bytes_per_s or self.cfg.devices.bandwidth_bytes_per_s

    def train(self, plan: TrainOrder) -> RoundResult:
        """Train for ``federation.local_steps`` batches within the deadline; the reply's arrays leave the
        personal tensors out.

        With a memory budget, every step (and the importance probe) follows a keep/recompute/page plan for
        the device's activation budget, and the time the plan adds counts against the deadline: when it
        would overrun, the selection is made again with that much less."""
        done = self._train_models(plan)
        arrays = upload(done.trainer, done.steps, self.personal)
        work = round_work(self.cfg, plan)
        metrics = round_metrics(done, work, len(self.data), arrays, self.personal, self.cfg.federation.transfer)
        if self.memory is not None:
            metrics[keys.MEMORY_BUDGET_BYTES] = self.memory.budget_bytes
            metrics[keys.MEMORY_PEAK_BYTES] = self.memory.peak_bytes
            metrics[keys.MEMORY_ADDED_S] = done.times.added_s
        if done.trainer.device.type == "cuda":
            metrics[keys.CUDA] = 1
        personalized = done.personal_model if done.personal_model is not None else weights_of(self.model)
        state = self._next_state(plan, done, self.kept(plan, personalized))
        metrics[keys.ROUNDS_TRAINED] = state.rounds_trained
        return RoundResult(arrays, metrics, state, personalized)

    def _train_models(self, plan: TrainOrder) -> Trained:
        """Select within the round's budget and take the round's steps on the shared model, with the round's
        personal-model method (:mod:`fleet.federated.on_device.local_methods`): FedALA's merge or FedRep's head before
        the selection, paid out of the budget; Ditto's and APFL's second model on the same tensors, its compute
        the shared update's again, which the budget covers."""
        cfg, work = self.cfg, round_work(self.cfg, plan)
        method = method_of(plan.strategy, cfg.personalization.method)
        start = weights_of(self.model) if method in TWO_MODELS else {}  # the global model
        seed = round_seed(cfg, plan.server_round, self.device_seed)
        before = self._before_selection(method, seed)
        trainer = round_trainer(cfg, self.model, self.profile, self.memory, seed)
        restore_momentum(trainer, self.state)
        started = time.perf_counter()
        budget = round_budget(trainer, work, self.uplink, cfg.federation.transfer, self.personal).less(before.device_s)
        last = Importance(list(self.state.importance), self.state.importance_round)
        probe_cost, importance = select_for_round(cfg, trainer, self.data, plan, work, budget, last)
        if method == "fedrep":
            trainer.set_mask(body_only(trainer.names, trainer.mask, self._head()))
        mask = trainer.mask
        added_s = trainer.memory_added_s()  # raises BudgetError (one line) if no plan fits
        steps = work.steps if any(mask) else 0
        apfl = self._apfl(start, mask, seed) if method == "apfl" else None
        losses = train_steps(trainer, self.data, steps, None if apfl is None else apfl.step)
        personal_mask = mask
        if method == "ditto" and cfg.personalization.personal_selection == "own" and not budget.trains_fully:
            used = steps * (self.profile.step_time(mask) + added_s) + probe_cost + uploaded_s(budget, mask)
            personal_mask = own_selection(self.profile, importance.values, budget.deadline_s - used, steps)
        own = self._train_personal(plan, start, personal_mask, steps) if method == "ditto" else None
        kept = before.method_state
        if apfl is not None:
            own, kept = apfl.mixed(), {"v": weights_of(apfl.v), "alpha": float(apfl.alpha.detach())}
        measured = time.perf_counter() - started + before.measured_s
        second = self.profile.step_time(personal_mask) + added_s if work.models == 2 else 0.0
        predicted = steps * (self.profile.step_time(mask) + added_s + second) + probe_cost + before.device_s
        times = RoundTimes(predicted, measured, added_s)
        return Trained(trainer, steps, losses, importance, times, own, kept)

    def _head(self) -> frozenset[str]:
        return frozenset(head_parameter_names(self.model))

    def _before_selection(self, method: str, seed: int) -> BeforeSteps:
        """FedRep's head steps or FedALA's merge, before the round selects; nothing for the other methods."""
        if method == "fedrep":
            return self._fedrep_head(seed)
        if method == "fedala":
            return self._fedala_merge(seed)
        return BeforeSteps(0.0, 0.0)

    def _fedrep_head(self, seed: int) -> BeforeSteps:
        """FedRep's first phase: the personal head trained alone (the body frozen) for
        ``personalization.head_steps``; each step a forward and the head's backward."""
        started = time.perf_counter()
        steps = self.cfg.personalization.head_steps or self.cfg.federation.local_steps
        trainer = round_trainer(self.cfg, self.model, self.profile, self.memory, seed + HEAD_SEED_OFFSET)
        trainer.set_mask(head_mask(trainer.names, self._head()))
        train_steps(trainer, self.data, steps)
        cost = steps * (self.profile.step_time(trainer.mask) + trainer.memory_added_s())
        return BeforeSteps(cost, time.perf_counter() - started)

    def _fedala_merge(self, seed: int) -> BeforeSteps:
        """FedALA: the global model (in ``self.model``) merged into the device's own model of its last round on
        the last ``personalization.ala_tensors`` tensors, by weights learned on ``ala_fraction`` of its data; each
        batch a forward and those tensors' backward. A device that never trained takes the global model."""
        kept = dict(self.state.method_state or {})
        if self.state.personal is None:
            return BeforeSteps(0.0, 0.0, kept)
        started = time.perf_counter()
        order = [t.name for t in self.profile.tensors]  # forward order (checked against the model): last = top
        top = ala_names(order, self.cfg.personalization.ala_tensors)
        params = dict(self.model.named_parameters())
        weights = kept.get("ala") or {n: torch.ones_like(params[n]) for n in top}
        generator = torch.Generator().manual_seed(seed + HEAD_SEED_OFFSET)
        count = max(1, int(self.cfg.personalization.ala_fraction * len(self.data)))
        subset = self.data.subset(torch.randperm(len(self.data), generator=generator)[:count])
        size, batch = self.cfg.data.input_size, self.cfg.train.batch_size
        passes = (
            batches(subset, batch, shuffle=True, generator=generator, input_size=size) for _ in range(ALA_FIRST_PASSES)
        )
        result = learn_ala(self.model, self.state.personal, weights, passes, first="ala" not in kept)
        cost = result.batches * self.profile.step_time([n in top for n in order])
        return BeforeSteps(cost, time.perf_counter() - started, {"ala": result.weights})

    def _apfl(self, start: dict[str, torch.Tensor], mask: list[bool], seed: int) -> Apfl:
        """APFL's personal model (its own from earlier rounds, else the global one) on the round's tensors."""
        kept = self.state.method_state or {}
        model = model_with_weights(self.cfg.model, {k: t.clone() for k, t in (kept.get("v") or start).items()})
        trainer = round_trainer(self.cfg, model, self.profile, None, seed + PERSONAL_SEED_OFFSET)
        trainer.set_mask(mask)
        alpha = float(kept.get("alpha", self.cfg.personalization.apfl_alpha))
        return Apfl(model, self.model, alpha, trainer.optimizer, self.cfg.train.lr)

    def _train_personal(
        self, plan: TrainOrder, start: dict[str, torch.Tensor], mask: list[bool], steps: int
    ) -> dict[str, torch.Tensor]:
        """Ditto's second model: the device's personal model (its own from earlier rounds, else the global
        one it got) trained on the same tensors and as many steps as the shared update, with the proximal
        term ``ditto_lambda / 2 * ||v - w||^2`` pulling it toward the global model ``start`` it began the
        round from. Returns its weights, which the device keeps and is evaluated on; it is never sent.

        A memory plan's added time counts the same for both models. Its momentum starts fresh each round:
        Ditto's personal solver is local SGD on the device's objective plus the proximal term, round by round."""
        cfg = self.cfg
        initial = self.state.personal or start
        model = model_with_weights(cfg.model, {k: t.clone() for k, t in initial.items()})
        seed = round_seed(cfg, plan.server_round, self.device_seed + PERSONAL_SEED_OFFSET)
        trainer = round_trainer(cfg, model, self.profile, None, seed)
        trainer.set_mask(mask)
        trainer.set_anchor(start, cfg.personalization.ditto_lambda)
        train_steps(trainer, self.data, steps)
        return weights_of(model)

    def kept(self, plan: TrainOrder, personalized: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What of its personalized model a device keeps: what the next round's global model will not give it
        back. Ditto's personal model whole (it trains on from it); else its personal tensors
        (``personalization.policy``), and under FedALA the top tensors its next merge starts from. The shared
        tensors it trained come back averaged, so they are not kept; the model is scored as the round ends
        (``DeviceState.personal_accuracy``) instead of rebuilt from a full copy later."""
        method = method_of(plan.strategy, self.cfg.personalization.method)
        if method == "ditto":
            return personalized
        names = set(self.personal)
        if method == "fedala":
            names.update(ala_names([t.name for t in self.profile.tensors], self.cfg.personalization.ala_tensors))
        return {n: personalized[n] for n in sorted(names) if n in personalized}

    def _next_state(self, plan: TrainOrder, done: Trained, kept: dict[str, torch.Tensor]) -> DeviceState:
        """What the device keeps after this round: the momentum of the tensors it trained (another tensor's is
        dropped at its next round anyway), importance, the tensors it trained, and ``kept``."""
        trainer = done.trainer
        trained = [n for n, m in zip(trainer.names, trainer.mask) if m] if done.steps else []
        drop_stale_momentum(trainer.optimizer, trainer.names, trainer.params, trained)
        return DeviceState(
            run_tag=self.state.run_tag,
            round=plan.server_round,
            rounds_trained=self.state.rounds_trained + 1,
            optimizer=trainer.optimizer.state_dict(),  # cast to federation.state_precision as it is written
            personal=kept,
            importance=[float(v) for v in done.importance.values],
            importance_round=done.importance.probed_round,
            trained=trained,
            method_state=done.method_state,
        )

    def finetune(self, plan: TrainOrder) -> float:
        """Fine-tune the model (the global model, about to be scored) in place for
        ``personalization.finetune_steps`` steps (:func:`finetune_work`); returns the simulated seconds it
        took on this device.

        Elastic like a round, but cheap and leaving nothing behind: no probe (the selection uses the
        device's last importance; a device that never probed keeps as many tensors as fit), a fresh
        optimizer, nothing uploaded; the caller throws the model away after scoring it."""
        cfg, work = self.cfg, finetune_work(self.cfg, plan)
        trainer = round_trainer(
            cfg, self.model, self.profile, self.memory, round_seed(cfg, plan.server_round, self.device_seed)
        )
        budget = round_budget(trainer, work, self.uplink, cfg.federation.transfer, self.personal)
        if not budget.trains_fully:
            last = self.state.importance
            importance = list(last) if len(last) == len(trainer.names) else [1.0] * len(trainer.names)
            trainer.reselect(importance=importance, policy=round_policy(cfg, trainer, plan, work, budget, 0.0))
        mask = trainer.mask
        added_s = trainer.memory_added_s()  # raises BudgetError (one line) if no plan fits
        steps = work.steps if any(mask) else 0
        train_steps(trainer, self.data, steps)
        return float(work.models * steps * (self.profile.step_time(mask) + added_s))


def round_metrics(
    done: Trained,
    work: LocalWork,
    num_examples: int,
    arrays: dict[str, torch.Tensor],
    personal: frozenset[str],
    transfer: str,
) -> dict[str, float | int]:
    """The reply's metrics (see :mod:`fleet.federated.shared.keys`); ``selected`` counts the shared tensors the reply
    carries, ``personal-selected`` the personal ones trained (only with personal tensors); its bytes are the
    upload's as ``transfer`` sends them."""
    trainer, predicted, losses = done.trainer, done.times.predicted_s, done.losses
    profile, mask, params = trainer.profile, trainer.mask, trainer.params
    chosen = [n for n, m in zip(trainer.names, mask) if m]
    full_time = work.full_time_s(profile)
    trained = sum(p.numel() for p, m in zip(params, mask) if m)
    return {
        keys.TIER: profile.speed_factor,
        keys.NUM_EXAMPLES: num_examples,
        keys.SELECTED: sum(1 for n in chosen if n not in personal),
        **({keys.PERSONAL_SELECTED: sum(1 for n in chosen if n in personal)} if personal else {}),
        keys.NUM_TENSORS: len(mask),
        keys.TRAINED_FRACTION: float(trained / sum(p.numel() for p in params)),
        keys.RHO: profile.step_time(mask) / profile.full_step_time,
        keys.PREDICTED_TIME_S: predicted,
        keys.MEASURED_TIME_S: done.times.measured_s,
        keys.FULL_TIME_S: full_time,
        keys.SPEEDUP: speedup(full_time, predicted),
        keys.BYTES_UPLOADED: int(sum(wire_bytes(a, transfer) for a in arrays.values())),
        keys.STEPS: len(losses),
        **({keys.LOSS: float(np.mean(losses))} if losses else {}),  # no step, no loss (never NaN: replies are checked)
    }

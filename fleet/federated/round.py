"""A device's local work in one round: pick its tensors under its own budget, train, report.

Flower-free: the ClientApp translates the server's Message into a :class:`RoundPlan`
and the :class:`RoundResult` back into a reply. Selection follows docs/algorithms.md
section 5: the round deadline ``D`` and the device's own profile give its budget
(``rho_n = min(1, D / T_full,n)``, less what the round costs anyway: an importance
probe, the upload), and :meth:`fleet.engine.trainer.Trainer.reselect` makes the selection
under a :class:`~fleet.engine.policies.SelectionPolicy` (FedEL's window and blending for the
``fleet`` strategy).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from fleet.data.datasets import ArrayDataset
from fleet.engine.device_profile import DeviceProfile
from fleet.engine.experiment import model_with_weights
from fleet.engine.models import head_parameter_names
from fleet.engine.policies import Blend, SelectionPolicy, Window
from fleet.engine.trainer import RESTORE_PROBE_STEPS, Trainer
from fleet.federated import keys
from fleet.federated.config import FleetConfig
from fleet.memory.budgeted import MemoryBudget


@dataclass
class RoundPlan:
    """What the server asks of a device this round."""

    server_round: int
    strategy: str  # fleet, naive or fedavg
    deadline_s: float  # <= 0: no deadline, train fully
    global_importance: dict[str, float] = field(default_factory=dict)
    bandwidth_bytes_per_s: float | None = None  # the device's own uplink (its class); None: the fleet's


@dataclass
class RoundResult:
    arrays: dict[str, torch.Tensor]  # only what the device trained (plus its norm statistics)
    metrics: dict[str, float | int]
    state: dict  # device state to keep for the next round


def compute_steps(cfg: FleetConfig) -> int:
    """Training steps a round costs a device: Ditto trains two models, the shared update and the device's
    personal model, ``local_steps`` each, and its elastic budget covers both."""
    fed = cfg.federation
    return fed.local_steps * (2 if fed.strategy == "ditto" else 1)


def full_round_time(cfg: FleetConfig, profile: DeviceProfile) -> float:
    """Seconds the round's local steps take on this device when it trains every tensor."""
    return compute_steps(cfg) * profile.full_step_time


def device_rho(cfg: FleetConfig, profile: DeviceProfile, deadline_s: float) -> tuple[float, float]:
    """(rho, full-training time of this round's local work) from the deadline and the device's profile."""
    full = full_round_time(cfg, profile)
    if deadline_s <= 0:
        return 1.0, full
    rho = min(1.0, deadline_s / full)
    floor = min(1.0, profile.min_rho + cfg.elastic.min_rho_margin)  # the Trainer refuses rho below the floor
    return max(rho, floor), full


def step_budget(cfg: FleetConfig, profile: DeviceProfile, round_budget_s: float) -> float:
    """Backward seconds per local step when the round's local work may take ``round_budget_s``
    (the deadline minus what the device must spend anyway: an importance probe, norm statistics'
    upload). Never below the device's floor (forward pass plus ``min_rho_margin`` of a full step)."""
    per_step = round_budget_s / compute_steps(cfg) - profile.forward_time
    floor = min(1.0, profile.min_rho + cfg.elastic.min_rho_margin) * profile.full_step_time - profile.forward_time
    return max(per_step, floor)


def tensor_upload_s(params: list[torch.Tensor], bandwidth_bytes_per_s: float) -> list[float]:
    """Seconds to upload each trainable tensor over the device's uplink."""
    return [p.numel() * p.element_size() / bandwidth_bytes_per_s for p in params]


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

    @property
    def trains_fully(self) -> bool:
        """No deadline, or one that already covers full training and the whole upload."""
        total = self.full_time_s + sum(self.upload_s) + self.buffers_s
        return self.deadline_s <= 0 or self.deadline_s >= total * (1 - 1e-9)


def round_budget(
    cfg: FleetConfig, trainer: Trainer, plan: RoundPlan, personal: frozenset[str] = frozenset()
) -> RoundBudget:
    """A personal tensor costs compute like any other but no upload: it never leaves the device."""
    fed = cfg.federation
    full = full_round_time(cfg, trainer.profile)
    deadline = plan.deadline_s if plan.strategy != "fedavg" else 0.0
    if not fed.deadline_includes_upload:
        return RoundBudget(deadline, full, [0.0] * len(trainer.names), 0.0)
    buffers = sum(b.numel() * b.element_size() for n, b in float_buffers(trainer.model).items() if n not in personal)
    bandwidth = plan.bandwidth_bytes_per_s or cfg.devices.bandwidth_bytes_per_s
    upload = [0.0 if n in personal else s for n, s in zip(trainer.names, tensor_upload_s(trainer.params, bandwidth))]
    return RoundBudget(deadline, full, upload, buffers / bandwidth)


def round_trainer(
    cfg: FleetConfig,
    model: nn.Module,
    profile: DeviceProfile,
    memory: MemoryBudget | None,
    plan: RoundPlan,
    device_seed: int,
    prev_state: dict,
) -> Trainer:
    """The round's trainer, with the device's momentum from earlier rounds (stale entries dropped)."""
    seed = cfg.train.seed + 1000 * plan.server_round + device_seed
    train = dataclasses.replace(cfg.train, method="full", seed=seed)
    trainer = Trainer(model, train, profile, memory, input_size=cfg.data.input_size)
    if "optimizer" in prev_state:
        try:
            trainer.optimizer.load_state_dict(prev_state["optimizer"])
        except (ValueError, KeyError, RuntimeError):
            pass  # another model layout: start with fresh momentum
    drop_stale_momentum(trainer.optimizer, trainer.names, trainer.params, prev_state.get("trained"))
    return trainer


def round_policy(
    cfg: FleetConfig, trainer: Trainer, plan: RoundPlan, budget: RoundBudget, probe_cost: float
) -> SelectionPolicy:
    """The device's selection policy: its deadline as a budget, each tensor's upload as a cost,
    and for the ``fleet`` strategy FedEL's blending and window."""
    fleet = plan.strategy == "fleet"
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
    return SelectionPolicy(
        budget_s=step_budget(cfg, trainer.profile, budget.deadline_s - probe_cost - budget.buffers_s),
        extra_costs=[u / compute_steps(cfg) for u in budget.upload_s],  # a tensor's upload, spread over the steps
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


def select_for_round(
    cfg: FleetConfig,
    trainer: Trainer,
    train: ArrayDataset,
    plan: RoundPlan,
    prev_state: dict,
    personal: frozenset[str] = frozenset(),
) -> tuple[float, list[float], int]:
    """Select this round's tensors through :meth:`Trainer.reselect`; returns (probe cost in
    simulated seconds, the local importance, the round it was probed in)."""
    budget = round_budget(cfg, trainer, plan, personal)
    importance = [float(v) for v in prev_state.get("importance", [])]
    imp_round = int(prev_state.get("importance_round", -(10**9)))
    if budget.trains_fully:  # the round's trainer starts with every tensor selected (method "full")
        return 0.0, importance, imp_round
    probe_cost = 0.0
    known = len(importance) == len(trainer.names)
    due = not known or plan.server_round - imp_round >= cfg.elastic.importance_interval
    probe_s = RESTORE_PROBE_STEPS * (trainer.profile.full_step_time + trainer.memory_added_s())
    if due and (probe_pays(budget, probe_s) or not cfg.elastic.probe_only_when_it_pays):
        importance = trainer.probe_importance(trainer.probe_batch(train))
        imp_round = plan.server_round
        probe_cost = probe_s
    elif not known:
        importance = [1.0] * len(trainer.names)  # no probe yet: the DP keeps as many tensors as fit
    trainer.reselect(importance=importance, policy=round_policy(cfg, trainer, plan, budget, probe_cost))
    return probe_cost, importance, imp_round


def train_steps(trainer: Trainer, train: ArrayDataset, steps: int) -> list[float]:
    """``steps`` local steps, re-shuffling on every pass over the device's data."""
    endless = (xy for _ in itertools.count() for xy in trainer.shuffled_batches(train))
    return [trainer.train_step(x, y) for x, y in itertools.islice(endless, steps)]


def local_round(
    cfg: FleetConfig,
    model: nn.Module,
    profile: DeviceProfile,
    train: ArrayDataset,
    prev_state: dict | None,
    plan: RoundPlan,
    device_seed: int,
    memory: MemoryBudget | None = None,
    personal: frozenset[str] = frozenset(),
) -> RoundResult:
    """Train ``model`` (already holding the global weights, and the device's own ``personal`` tensors)
    for ``federation.local_steps`` batches; the reply's arrays leave the personal tensors out.

    With ``memory``, every step (and the importance probe) follows a keep/recompute/page
    plan for the device's activation budget, and the time the plan adds counts against
    the deadline: when it would overrun, the selection is made again with that much less.
    """
    prev_state = prev_state or {}
    ditto = plan.strategy == "ditto"
    start = {n: t.detach().clone() for n, t in model.state_dict().items()} if ditto else {}  # the global model
    trainer = round_trainer(cfg, model, profile, memory, plan, device_seed, prev_state)
    started = time.perf_counter()
    probe_cost, importance, imp_round = select_for_round(cfg, trainer, train, plan, prev_state, personal)
    mask = trainer.mask
    added_s = trainer.memory_added_s()  # raises BudgetError (one line) if no plan fits
    steps = cfg.federation.local_steps if any(mask) else 0
    losses = train_steps(trainer, train, steps)
    own = ditto_personal(cfg, start, prev_state, trainer, train, plan, device_seed, steps) if ditto else None
    measured = time.perf_counter() - started
    predicted = (2 if ditto else 1) * steps * (profile.step_time(mask) + added_s) + probe_cost
    arrays = upload(trainer, steps, personal)
    metrics = round_metrics(cfg, trainer, len(train), arrays, losses, predicted, measured, personal)
    if memory is not None:
        metrics.update(
            {
                keys.MEMORY_BUDGET_BYTES: memory.budget_bytes,
                keys.MEMORY_PEAK_BYTES: memory.peak_bytes,
                keys.MEMORY_ADDED_S: added_s,
            }
        )
    metrics[keys.ROUNDS_TRAINED] = int(prev_state.get("rounds_trained", 0)) + 1
    state = {
        "round": plan.server_round,
        "rounds_trained": metrics[keys.ROUNDS_TRAINED],
        "optimizer": trainer.optimizer.state_dict(),
        "personal": own if own is not None else {k: v.detach().clone() for k, v in model.state_dict().items()},
        "importance": [float(v) for v in importance],
        "importance_round": imp_round,
        "trained": [n for n, m in zip(trainer.names, mask) if m] if steps else [],
    }
    return RoundResult(arrays, metrics, state)


def upload(trainer: Trainer, steps: int, personal: frozenset[str]) -> dict[str, torch.Tensor]:
    """What the reply carries: the trained shared tensors and, after any step, the norm statistics
    (every forward pass in training mode moves them); never a personal tensor."""
    trained = zip(trainer.names, trainer.params, trainer.mask)
    arrays = {n: p.detach().clone() for n, p, m in trained if m and n not in personal}
    if steps:
        arrays.update({n: b.detach().clone() for n, b in float_buffers(trainer.model).items() if n not in personal})
    return arrays


def ditto_personal(
    cfg: FleetConfig,
    start: dict[str, torch.Tensor],
    prev_state: dict,
    shared: Trainer,
    train: ArrayDataset,
    plan: RoundPlan,
    device_seed: int,
    steps: int,
) -> dict[str, torch.Tensor]:
    """Ditto's second model: the device's personal model (its own from earlier rounds, else the global
    one it got) trained on the same tensors and as many steps as the shared update, with the proximal
    term ``ditto_lambda / 2 * ||v - w||^2`` pulling it toward the global model ``start`` it began the
    round from. Returns its weights, which the device keeps and is evaluated on; it is never sent.

    Its compute is the shared update's again, which the round's budget already covers (compute_steps);
    a memory plan's added time counts the same for both. Its momentum starts fresh each round: Ditto's
    personal solver is local SGD on the device's objective plus the proximal term, round by round."""
    initial = prev_state.get("personal") or start
    personal = model_with_weights(cfg.model, {k: t.clone() for k, t in initial.items()})
    trainer = round_trainer(cfg, personal, shared.profile, None, plan, device_seed + 7919, {})
    trainer.set_mask(shared.mask)
    trainer.set_anchor(start, cfg.personalization.ditto_lambda)
    train_steps(trainer, train, steps)
    return {k: t.detach().clone() for k, t in personal.state_dict().items()}


def finetune(
    cfg: FleetConfig,
    model: nn.Module,
    profile: DeviceProfile,
    train: ArrayDataset,
    prev_state: dict | None,
    plan: RoundPlan,
    device_seed: int,
    memory: MemoryBudget | None = None,
    personal: frozenset[str] = frozenset(),
) -> float:
    """Fine-tune ``model`` (the global model, about to be scored) in place for ``personalization.finetune_steps``
    local steps; returns the simulated seconds it took on this device.

    Elastic like a round: the steps get the same share of the deadline a round's steps get, and the
    selection is made with the device's last importance (no probe: fine-tuning is meant to be cheap;
    a device that never probed keeps as many tensors as fit). Nothing uploads, nothing is kept: a
    fresh optimizer, and the caller throws the model away after scoring it."""
    fed = cfg.federation
    steps = cfg.personalization.finetune_steps
    strategy = "naive" if plan.strategy == "ditto" else plan.strategy  # one model is fine-tuned, even under Ditto
    ft_fed = dataclasses.replace(fed, local_steps=steps, deadline_includes_upload=False, strategy=strategy)
    ft_cfg = dataclasses.replace(cfg, federation=ft_fed)
    n = sum(1 for p in model.parameters() if p.requires_grad)
    importance = list((prev_state or {}).get("importance", [])) or [1.0] * n
    prev = {"importance": importance, "importance_round": plan.server_round}
    ft_plan = dataclasses.replace(plan, strategy=strategy, deadline_s=plan.deadline_s * steps / compute_steps(cfg))
    result = local_round(ft_cfg, model, profile, train, prev, ft_plan, device_seed, memory, personal)
    return float(result.metrics[keys.PREDICTED_TIME_S])


def round_metrics(
    cfg: FleetConfig,
    trainer: Trainer,
    num_examples: int,
    arrays: dict[str, torch.Tensor],
    losses: list[float],
    predicted: float,
    measured: float,
    personal: frozenset[str] = frozenset(),
) -> dict[str, float | int]:
    """The reply's metrics (see :mod:`fleet.federated.keys`); ``selected`` counts the shared tensors the
    reply carries, ``personal-selected`` the personal ones trained (only with personal tensors)."""
    profile, mask, params = trainer.profile, trainer.mask, trainer.params
    chosen = [n for n, m in zip(trainer.names, mask) if m]
    full_time = full_round_time(cfg, profile)
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
        keys.MEASURED_TIME_S: measured,
        keys.FULL_TIME_S: full_time,
        keys.SPEEDUP: full_time / predicted if predicted > 0 else 0.0,
        keys.BYTES_UPLOADED: int(sum(a.numel() * a.element_size() for a in arrays.values())),
        keys.STEPS: len(losses),
        **({keys.LOSS: float(np.mean(losses))} if losses else {}),  # no step, no loss (never NaN: replies are checked)
    }

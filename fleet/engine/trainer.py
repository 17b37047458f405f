"""Elastic training and its baselines in one harness (docs/algorithms.md section 4).

A :class:`Trainer` owns one model, one optimizer over *all* its tensors and the
current selection. Freezing is ``requires_grad=False`` plus ``grad=None``:
autograd then computes no weight gradient for the tensor, stops
back-propagation below the input-most selected tensor and stores no
activations there, and the optimizer skips the tensor while keeping its
momentum for when it rejoins.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from fleet.base.errors import BudgetError
from fleet.data.datasets import ArrayDataset, batches
from fleet.engine.accelerator import (
    Precision,
    check_memory_budget,
    clock_for,
    elapsed,
    module_device,
    on_device,
    resolve_device,
)
from fleet.engine.config import TrainConfig
from fleet.engine.device_profile import DeviceProfile
from fleet.engine.importance import (
    evaluate_importance,
    momentum_readable,
    normalize,
    step_scores,
    weights_before_step,
)
from fleet.engine.methods import group_lasso_penalty, static_mask
from fleet.engine.models import head_parameter_names, input_channels
from fleet.engine.policies import SelectionPolicy, select_in_window
from fleet.engine.profiler import parametric_layers, tensors_of
from fleet.engine.selection import select_tensors, selection_cost

if TYPE_CHECKING:
    from fleet.memory.budgeted import MemoryBudget

MIN_LAST_BATCH_SHARE = 0.25  # a shorter last batch is left out of a pass: BatchNorm's statistics on it are noise
RESTORE_PROBE_STEPS = 2.0  # a restoring probe costs about two full steps (one update, one gradient)


@dataclass
class Selection:
    """One re-selection: when, what, and what it is predicted to cost."""

    step: int
    epoch: int
    mask: list[bool]
    importance: list[float]
    predicted_step_time: float

    def summary(self, names: Sequence[str]) -> dict:
        chosen = [n for n, m in zip(names, self.mask) if m]
        return {
            "step": self.step,
            "epoch": self.epoch,
            "selected": len(chosen),
            "tensors": chosen,
            "predicted_step_time_s": self.predicted_step_time,
        }


@dataclass
class EpochStats:
    epoch: int
    loss: float
    steps: int
    train_time_s: float  # wall time of training steps and probes, evaluation excluded
    predicted_time_s: float  # the timing model's figure for the same steps
    probe_time_s: float
    accuracy: float | None = None
    selected: int = 0


DEFAULT_POLICY = SelectionPolicy()


def make_optimizer(params: Sequence[nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer:
    """SGD with the train section's learning rate, momentum and weight decay."""
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)


@dataclass
class Trainer:
    """One model trained elastically (or by a baseline ``method``) under the train section ``config``.

    The Trainer reads its settings from the config itself rather than from a copy of it, so a new
    train setting reaches it without a mirror to keep in step; a caller that trains differently
    (a fleet device's round trains ``full`` and selects through a policy) passes a changed copy
    (``dataclasses.replace(cfg.train, method="full")``). What is not the train section's is given
    beside it: the input size the data is resized to, and ``frozen_norm_stats``.
    """

    model: nn.Module
    config: TrainConfig
    profile: DeviceProfile | None = None
    memory: MemoryBudget | None = None  # run every step under a memory plan for the current selection
    names: list[str] = field(init=False)
    params: list[nn.Parameter] = field(init=False)
    mask: list[bool] = field(init=False)
    selections: list[Selection] = field(default_factory=list)
    step_count: int = 0
    input_size: int | None = field(default=None, kw_only=True)  # images are resized to this; None: as stored
    # normalization layers normalize with the statistics the model arrived with, and keep them, instead of each
    # batch's: a device personalizing on a few hundred images of one or two classes has batch statistics too
    # unlike its test data's, and its accuracy jumped 88% -> 6% -> 85% over epochs with them (fleet bench pfl)
    frozen_norm_stats: bool = field(default=False, kw_only=True)
    # a proximal term prox_lambda / 2 * ||w - anchor||^2 over the trained tensors (set_anchor); None: plain training
    _anchor: list[torch.Tensor] | None = field(default=None, init=False, repr=False)
    _prox_lambda: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        self._place()
        example = torch.zeros(1, *self._input_shape(), device=self.device)
        layers = parametric_layers(self.model, example)
        order = tensors_of(layers)
        self.names = [n for n, _, _ in order]
        self.params = [p for _, _, p in order]
        layer_of = dict(layers)
        self.layers = [layer_of[layer] for _, layer, _ in order]
        self.optimizer = make_optimizer(self.params, self.config)
        self.generator = torch.Generator().manual_seed(self.config.seed)
        if self.config.method == "elastic":
            if self.profile is None:
                raise BudgetError(
                    "train.method: elastic needs a device profile; pass --profile or let fleet measure one"
                )
            if self.profile.min_rho > self.config.rho:
                raise BudgetError(
                    f"train.rho: {self.config.rho} is below this device's floor {self.profile.min_rho:.3f} "
                    f"(a forward pass alone costs that fraction of a full step); use rho >= {self.profile.min_rho:.2f}"
                )
        self.set_mask(static_mask(self.config.method, self.names, self.layers, head_parameter_names(self.model)))

    def _place(self) -> None:
        """The device ``config.device`` names, the model moved there (before its optimizer is made, so the
        optimizer's state lives there too), and how steps are timed and computed on it."""
        self.device = resolve_device(self.config.device)
        if self.device.type != "cpu":
            budget = None if self.memory is None else self.memory.budget_bytes
            check_memory_budget(self.device, budget, amp=self.config.amp)
            self.model.to(self.device)
        self.clock = clock_for(self.device)
        self.precision = Precision(self.device, self.config.amp)

    def _input_shape(self) -> tuple[int, int, int]:
        size = self.input_size or 32
        return (input_channels(self.model), size, size)

    def set_anchor(self, weights: Mapping[str, torch.Tensor], prox_lambda: float) -> None:
        """Add ``prox_lambda / 2 * ||w - weights||^2`` over the trained tensors to the loss (by tensor name).

        Ditto's personal model is pulled this way toward the global model it started the round from;
        the anchor is part of the objective, so the Trainer owns it rather than having it patched in."""
        self._anchor = [on_device(weights[n], self.device) for n in self.names]
        self._prox_lambda = prox_lambda

    # --- selection --------------------------------------------------------
    def set_mask(self, mask: Sequence[bool]) -> None:
        """Train exactly the tensors in ``mask``; frozen ones drop their gradients."""
        self.mask = list(mask)
        for p, m in zip(self.params, self.mask):
            p.requires_grad_(m)
            if not m:
                p.grad = None

    def reselect(
        self,
        probe: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        importance: Sequence[float] | None = None,
        policy: SelectionPolicy = DEFAULT_POLICY,
        epoch: int = 0,
    ) -> Selection:
        """Choose the tensors with the most importance that fit the budget, and train exactly those.

        Importance is measured on ``probe``, or given (a device re-using last round's probe).
        ``policy`` sets the budget, extra per-tensor costs, blending and a window; the default is
        plain ElasticTrainer: the profile's budget at ``config.rho``, the exact DP.
        """
        if self.profile is None:
            raise BudgetError("a selection needs a device profile; pass --profile or let fleet measure one")
        if importance is None:
            if probe is None:
                raise ValueError("reselect needs a probe batch or the importance to select by")
            importance = self.probe_importance(probe)
        importance = list(importance)
        ranked = policy.blend(importance, self.names) if policy.blend is not None else importance
        budget = policy.budget_s if policy.budget_s is not None else self.profile.backward_budget(self.config.rho)
        costs = list(self.profile.t_dw)
        if policy.extra_costs is not None:
            costs = [c + e for c, e in zip(costs, policy.extra_costs)]
        t_dy = self.profile.t_dy
        allowed = policy.window.allowed(self.names, costs, t_dy, budget) if policy.window is not None else None

        def choose(b: float) -> list[bool]:
            if allowed is None:
                return select_tensors(ranked, costs, t_dy, b)
            return select_in_window(ranked, allowed, costs, t_dy, b, policy.window.mode)

        mask = choose(budget)
        if policy.charge_memory and self.memory is not None:
            self.set_mask(mask)
            added = self.memory_added_s()
            if added > 0 and selection_cost(mask, costs, t_dy) + added > budget:
                mask = choose(max(budget - added, 0.0))
        self.set_mask(mask)
        selection = Selection(self.step_count, epoch, mask, importance, self.profile.step_time(mask))
        self.selections.append(selection)
        return selection

    def probe_importance(self, probe: tuple[torch.Tensor, torch.Tensor]) -> list[float]:
        """Each tensor's importance on the ``probe`` batch, under the memory plan for full training;
        the model, the optimizer and the selection are left as they were."""
        x, y = (on_device(t, self.device) for t in probe)
        return evaluate_importance(self.model, self.params, self.optimizer, x, y, step_context=self.step_context)

    def memory_added_s(self) -> float:
        """Seconds the memory plan for the current selection adds to one step on this device (its
        tier); raises BudgetError (one line) when no plan fits the budget."""
        if self.memory is None:
            return 0.0
        factor = self.profile.speed_factor if self.profile is not None else 1.0
        return self.memory.added_time_s(self.model) * factor

    def step_context(self) -> contextlib.AbstractContextManager:
        """The memory plan for the current ``requires_grad`` flags, around one forward and backward
        (nothing without a budget)."""
        return self.memory.runner(self.model) if self.memory is not None else contextlib.nullcontext()

    def shuffled_batches(self, data: ArrayDataset) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass over ``data`` in this trainer's batch size and input size, shuffled by its generator.

        A last batch of a few samples (under a quarter of the batch; always one) is left out of the pass,
        other samples each pass. BatchNorm cannot train on one sample, and on two or three its statistics
        are noise: a device holding 34 samples at batch 32 drove ResNet-18's ``running_var`` to 4e5-7e9 in
        10 steps (loss 5.5 against 1.0 without that batch), and the server rightly rejected the reply."""
        batch_size = self.config.batch_size
        tail = len(data) % batch_size
        short_last = len(data) > batch_size and 0 < tail < max(2, math.ceil(MIN_LAST_BATCH_SHARE * batch_size))
        cpu_batches = batches(
            data,
            batch_size,
            shuffle=True,
            generator=self.generator,
            input_size=self.input_size,
            drop_last=short_last,
        )
        if self.device.type == "cpu":
            return cpu_batches
        return ((on_device(x, self.device), on_device(y, self.device)) for x, y in cpu_batches)

    def probe_batch(self, data: ArrayDataset) -> tuple[torch.Tensor, torch.Tensor]:
        """A freshly shuffled batch (its first ``probe_samples``), so importance is not judged on the same
        images each time."""
        x, y = next(self.shuffled_batches(data))
        n = self.config.probe_samples
        return (x[:n], y[:n]) if n else (x, y)

    def _due(self, epoch: int, step_in_epoch: int) -> bool:
        if self.config.method != "elastic":
            return False
        if self.config.interval_unit == "epoch":
            return step_in_epoch == 0 and epoch % self.config.interval == 0
        return self.step_count % self.config.interval == 0

    # --- training ---------------------------------------------------------
    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the data loss, the loss to minimize: plus PruneTrain's penalty or Ditto's proximal term)."""
        loss = nn.functional.cross_entropy(self.model(x), y)
        total = loss
        if self.config.method == "prunetrain" and self.config.prunetrain_lambda > 0:
            total = loss + self.config.prunetrain_lambda * group_lasso_penalty(self.params)
        if self._anchor is not None and self._prox_lambda > 0:
            total = total + self._prox_lambda / 2 * self._distance_to_anchor()
        return loss, total

    def _backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Fresh gradients of the training loss for the tensors being trained; the data loss."""
        self.optimizer.zero_grad(set_to_none=True)
        x, y = on_device(x, self.device), on_device(y, self.device)
        with self.step_context():
            with self.precision.autocast():
                loss, total = self._loss(x, y)
            self.precision.backward(total)
        return float(loss.detach())

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self._backward(x, y)
        self.precision.step(self.optimizer)
        self.step_count += 1
        return loss

    def _distance_to_anchor(self) -> torch.Tensor:
        """``||w - anchor||^2`` over the tensors being trained (a frozen tensor cannot move toward it)."""
        pairs = [(p, a) for p, a, m in zip(self.params, self._anchor or [], self.mask) if m]
        return sum(((p - a) ** 2).sum() for p, a in pairs) if pairs else torch.zeros(())

    # A training probe (``config.probe == "train"``) is the restoring probe's two passes made
    # into two training steps on the same batch, so that nothing is computed only to be undone:
    # 1. a step that trains every tensor gives each tensor's update ``dw``;
    # 2. a second step takes every tensor's gradient at the updated weights, scores ``-<g, dw>``
    #    (docs/algorithms.md section 2), re-selects, and applies the gradient to the tensors
    #    just selected.
    # What it costs beyond elastic training is two full steps in place of the batch's one
    # elastic step (about 1.5 full steps at rho 0.5), where the restoring probe adds two full
    # steps plus copying and restoring the model and the optimizer, and keeps nothing of them.
    # The batch is freshly shuffled, as the restoring probe's is.
    # A tensor the last selection froze starts its momentum afresh: what it holds is from when
    # it last trained, and the probe's first step, unlike the restoring probe's, is kept.
    def training_probe(self, x: torch.Tensor, y: torch.Tensor, epoch: int) -> list[float]:
        """Both steps of a training probe on ``x, y``; returns their losses."""
        for p, trained in zip(self.params, self.mask):
            if not trained:
                self.optimizer.state.pop(p, None)
        self.set_mask([True] * len(self.params))
        readable = self.precision.scaler is None and momentum_readable(self.optimizer)  # a scaler may skip a step
        before = weights_before_step(self.params, readable)
        first = self.train_step(x, y)
        second = self._backward(x, y)
        importance = normalize(step_scores([p.grad for p in self.params], self.params, self.optimizer, before))
        self.reselect(importance=importance, epoch=epoch)  # drops the gradients of tensors left out
        self.precision.step(self.optimizer)
        self.step_count += 1
        return [first, second]

    def _probe_cost_s(self) -> float:
        """The timing model's seconds for one restoring probe (two full steps)."""
        return RESTORE_PROBE_STEPS * self.profile.full_step_time if self.profile is not None else 0.0

    def train_mode(self) -> None:
        """The model in training mode, its normalization layers in eval mode with ``frozen_norm_stats``."""
        self.model.train()
        if self.frozen_norm_stats:
            for module in self.model.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.eval()

    def train_epoch(self, data: ArrayDataset, epoch: int) -> EpochStats:
        """One pass over ``data``; times cover training steps and importance probes only.

        ``probe_time_s`` is what the probes cost beyond training: a restoring probe's whole
        time, or a training probe's two steps less what one of the epoch's elastic steps took
        (the batch's own step; the second step on it is counted as the probe's, though it trains).
        ``predicted_time_s`` is the timing model's figure for the same work, probes included."""
        self.train_mode()
        losses: list[float] = []
        train_time = restore_time = probe_steps_time = predicted = 0.0
        probe_steps = 0
        for i, (x, y) in enumerate(self.shuffled_batches(data)):
            due = self._due(epoch, i)
            if due and self.config.probe == "train":
                start = self.clock.stamp()
                losses += self.training_probe(x, y, epoch)
                probe_steps_time += elapsed(self.clock, start, self.clock.stamp())
                probe_steps += 1  # the batch's own step; the other is the probe's
                predicted += 2 * self.profile.full_step_time
                continue
            if due:
                start = self.clock.stamp()
                self.reselect(self.probe_batch(data), epoch=epoch)
                self.train_mode()  # the probe leaves every module in training mode
                restore_time += elapsed(self.clock, start, self.clock.stamp())
                predicted += self._probe_cost_s()
            if not any(self.mask):
                continue  # nothing worth training until the next re-selection
            start = self.clock.stamp()
            losses.append(self.train_step(x, y))
            train_time += elapsed(self.clock, start, self.clock.stamp())
            if self.profile is not None:
                predicted += self.profile.step_time(self.mask)
        elastic_steps = len(losses) - 2 * probe_steps
        per_step = train_time / elastic_steps if elastic_steps else probe_steps_time / max(probe_steps, 1)
        beyond_training = max(probe_steps_time - probe_steps * per_step, 0.0)  # a training probe's extra
        return EpochStats(
            epoch=epoch,
            loss=statistics.fmean(losses) if losses else float("nan"),
            steps=len(losses),
            train_time_s=train_time + probe_steps_time + restore_time,
            predicted_time_s=predicted,
            probe_time_s=restore_time + beyond_training,
            selected=sum(self.mask),
        )

    def evaluate(self, data: ArrayDataset, batch_size: int = 256) -> float:
        """Top-1 accuracy on ``data``."""
        acc = accuracy(self.model, data, self.input_size, batch_size)
        self.train_mode()
        return acc


@torch.no_grad()
def predictions(model: nn.Module, data: ArrayDataset, input_size: int | None, batch_size: int = 256) -> torch.Tensor:
    """``model``'s (put in eval mode) top-1 label for each sample of ``data``, in order, on the CPU."""
    model.eval()
    device = module_device(model)
    loader = batches(data, batch_size, shuffle=False, input_size=input_size)
    out = [model(on_device(x, device)).argmax(1).cpu() for x, _ in loader]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def accuracy(model: nn.Module, data: ArrayDataset, input_size: int | None, batch_size: int = 256) -> float:
    """Top-1 accuracy of ``model`` (put in eval mode) on ``data``."""
    correct = int((predictions(model, data, input_size, batch_size) == data.labels).sum())
    return correct / max(len(data), 1)

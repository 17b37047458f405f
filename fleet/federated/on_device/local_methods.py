"""Personal-model methods a device runs inside its round (``personalization.method``), Flower-free.

Each is its paper's local algorithm, run on the tensors the round selected (every tensor when the
device trains fully); docs/algorithms.md, "Personal models", gives the formulas.

* **Ditto** (Li et al., ICML'21) lives in :meth:`fleet.federated.on_device.round.DeviceRound._train_personal`:
  a second model ``v`` trained on ``f_i(v) + lambda/2 ||v - w||^2``.
* **FedRep** (Collins et al., ICML'21): the personal head first (:func:`train_head`, the body
  frozen), then the shared body with the head frozen; only the body is sent.
* **FedALA** (Zhang et al., AAAI'23): before training, the global model ``w`` is merged into the
  device's own ``w_i`` on its last tensors, ``w_i + (w - w_i) * W`` with element-wise weights
  ``W`` in [0, 1] learned on a share of its data (:func:`learn_ala`); the lower tensors take ``w``.
* **APFL** (Deng et al., 2020): beside the shared model ``w``, a personal ``v`` trained through the
  mix ``alpha v + (1 - alpha) w``, with ``alpha`` learned by its own gradient (:class:`Apfl`).

Design notes:

* *Device time.* Every extra pass is priced by the device's profile: a head step or an ALA batch
  costs a forward pass and the backward of the tensors it trains, an APFL step a second model's
  step. The round's budget pays for it before selection (:func:`fleet.federated.on_device.round.DeviceRound.train`).
* *Bounded.* FedALA learns its weights "until convergence" at a device's first merge; here that is
  at most :data:`ALA_FIRST_PASSES` passes, so a round stays bounded.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from fleet.engine.accelerator import host_copy, module_device

ALA_FIRST_PASSES = 5  # a device's first merge learns its weights for at most this many passes (FedALA: to convergence)
ALA_CONVERGED_STD = 0.1  # ... stopping once its last ALA_WINDOW losses' std falls below this (FedALA's threshold)
ALA_WINDOW = 10
ALA_LR = 1.0  # FedALA's eta for the merge weights


def body_only(names: list[str], mask: list[bool], head: frozenset[str]) -> list[bool]:
    """FedRep's body phase: the selection without the head, which its first phase trained."""
    return [m and n not in head for n, m in zip(names, mask)]


def head_mask(names: list[str], head: frozenset[str]) -> list[bool]:
    return [n in head for n in names]


def ala_names(names: list[str], count: int) -> list[str]:
    """The tensors FedALA merges by learned weights: the last ``count`` of the model (FedALA's p)."""
    return names[-count:]


def ala_merge(
    local: Mapping[str, torch.Tensor], global_: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``local + (global - local) * W`` on the weighted tensors (FedALA's element-wise merge)."""
    return {n: local[n] + (global_[n] - local[n]) * w for n, w in weights.items()}


@dataclass
class AlaResult:
    weights: dict[str, torch.Tensor]  # the learned merge weights, kept for the device's next merge
    batches: int  # the batches they learned on (each costs a forward and the merged tensors' backward)
    losses: list[float]


def learn_ala(
    model: nn.Module,
    local: Mapping[str, torch.Tensor],
    weights: Mapping[str, torch.Tensor],
    passes: Iterable[Iterable[tuple[torch.Tensor, torch.Tensor]]],
    first: bool,
) -> AlaResult:
    """FedALA's adaptive local aggregation on ``model``, which holds the global model.

    The merged tensors are put into ``model``; on each batch the loss's gradient with respect to
    them gives the weights' (``dL/dW = dL/dw_hat * (w - w_i)``), stepped by :data:`ALA_LR` and
    clipped to [0, 1]. One pass over ``passes``' first, or at the device's ``first`` merge up to
    :data:`ALA_FIRST_PASSES` until the loss settles. Norm statistics are left as they came (eval
    mode): the merge learns weights, not statistics. The model ends holding the final merge."""
    params = dict(model.named_parameters())
    glob = {n: params[n].detach().clone() for n in weights}
    weights = {n: w.clone() for n, w in weights.items()}
    was_training = model.training
    model.eval()
    flags = {n: p.requires_grad for n, p in params.items()}
    for p in params.values():
        p.requires_grad_(False)
    merged = [params[n] for n in weights]
    for p in merged:
        p.requires_grad_(True)
    losses: list[float] = []
    batches = 0
    for i, batch_pass in enumerate(passes):
        for x, y in batch_pass:
            with torch.no_grad():
                for n, value in ala_merge(local, glob, weights).items():
                    params[n].copy_(value)
            loss = nn.functional.cross_entropy(model(x), y)
            grads = torch.autograd.grad(loss, merged)
            with torch.no_grad():
                for (n, w), g in zip(weights.items(), grads):
                    weights[n] = (w - ALA_LR * g * (glob[n] - local[n])).clamp_(0.0, 1.0)
            losses.append(float(loss.detach()))
            batches += 1
        settled = len(losses) >= ALA_WINDOW and statistics.pstdev(losses[-ALA_WINDOW:]) < ALA_CONVERGED_STD
        if not first or settled or i + 1 >= ALA_FIRST_PASSES:
            break
    with torch.no_grad():
        for n, value in ala_merge(local, glob, weights).items():
            params[n].copy_(value)
    for n, p in params.items():
        p.requires_grad_(flags[n])
    model.train(was_training)
    return AlaResult(weights, batches, losses)


class Apfl:
    """APFL's personal model ``v`` and mixing weight ``alpha`` beside the shared model being trained.

    After each step of the shared model ``w``, :meth:`step` takes one on ``v`` through the mix
    ``v_bar = alpha v + (1 - alpha) w``: ``v <- v - lr * alpha * grad f(v_bar)`` (through its
    optimizer, on the tensors ``v`` trains) and ``alpha <- alpha - lr * <v - w, grad f(v_bar)>``,
    clipped to [0, 1]. The device is scored on, and keeps, ``v_bar`` (:meth:`mixed`)."""

    def __init__(self, v: nn.Module, shared: nn.Module, alpha: float, optimizer: torch.optim.Optimizer, lr: float):
        self.v, self.shared, self.optimizer, self.lr = v, shared, optimizer, lr
        self.alpha = torch.tensor(float(alpha), requires_grad=True, device=module_device(v))

    def _mix(self) -> dict[str, torch.Tensor]:
        w = dict(self.shared.named_parameters())
        return {n: self.alpha * p + (1 - self.alpha) * w[n].detach() for n, p in self.v.named_parameters()}

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        buffers = dict(self.v.named_buffers())
        out = torch.func.functional_call(self.v, {**self._mix(), **buffers}, (x,))
        loss = nn.functional.cross_entropy(out, y)
        self.optimizer.zero_grad(set_to_none=True)
        self.alpha.grad = None
        loss.backward()
        self.optimizer.step()
        with torch.no_grad():
            self.alpha -= self.lr * self.alpha.grad
            self.alpha.clamp_(0.0, 1.0)
        return float(loss.detach())

    def mixed(self) -> dict[str, torch.Tensor]:
        """``v_bar``'s every tensor: the mixed parameters and ``v``'s norm statistics."""
        with torch.no_grad():
            state = {n: host_copy(t) for n, t in self.v.state_dict().items()}
            state.update({n: host_copy(t) for n, t in self._mix().items()})
        return state

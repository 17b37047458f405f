"""Tensor importance: how much the loss would rise if a tensor's update were undone.

``I_k = -sum_i g_k,i * dw_k,i`` with ``dw`` one optimizer step on all tensors
and ``g`` the loss gradient at the updated weights (docs/algorithms.md section 2).
The probe must leave no trace: weights, buffers (BatchNorm running stats),
optimizer state (momentum) and ``requires_grad`` flags are all restored, so
importance evaluation never changes what training would have done.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn


def importance_from_update(grads: Sequence[torch.Tensor | None], updates: Sequence[torch.Tensor]) -> list[float]:
    """``-<g_k, dw_k>`` per tensor (0 where a tensor got no gradient). A float32 dot product: in float64
    the two conversions took a third of a ResNet-18 probe, and the selection only ranks these."""
    return [0.0 if g is None else -float(torch.dot(g.flatten(), dw.flatten())) for g, dw in zip(grads, updates)]


def momentum_readable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether each tensor's last update is ``-lr * momentum_buffer``: torch's SGD with momentum, one
    learning rate, no dampening, Nesterov or maximize (the update is then the buffer the step just wrote)."""
    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
        return False
    group = optimizer.param_groups[0]
    return group["momentum"] > 0 and group["dampening"] == 0 and not group["nesterov"] and not group["maximize"]


def importance_from_momentum(
    grads: Sequence[torch.Tensor | None], optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]
) -> list[float]:
    """``-<g_k, dw_k>`` with the last step's ``dw_k = -lr * buf_k`` read from the optimizer
    (:func:`momentum_readable`), so a probe need not copy the weights before its step to subtract them
    after: a ResNet-18's two passes over 45 MB. 0 where a tensor has no gradient or the step left it."""
    lr = optimizer.param_groups[0]["lr"]
    out = []
    for g, p in zip(grads, params):
        buf = optimizer.state.get(p, {}).get("momentum_buffer")
        out.append(0.0 if g is None or buf is None else lr * float(torch.dot(g.flatten(), buf.flatten())))
    return out


def weights_before_step(params: Sequence[nn.Parameter], readable: bool) -> list[torch.Tensor] | None:
    """A copy of ``params`` to take the step's update from, or None when it can be read from momentum."""
    return None if readable else [p.detach().clone() for p in params]


def step_scores(
    grads: Sequence[torch.Tensor | None],
    params: Sequence[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    before: Sequence[torch.Tensor] | None,
) -> list[float]:
    """``-<g_k, dw_k>`` for the step just taken: ``dw`` the weights' change since ``before``, or read from
    the optimizer's momentum when ``before`` is None (:func:`weights_before_step`)."""
    if before is None:
        return importance_from_momentum(grads, optimizer, params)
    return importance_from_update(grads, [p.detach() - b for p, b in zip(params, before)])


def normalize(importance: Sequence[float]) -> list[float]:
    """Scale by ``max_k |I_k|`` so that importance is comparable across probes."""
    top = max((abs(v) for v in importance), default=0.0)
    return [v / top for v in importance] if top > 0 else [0.0 for _ in importance]


def evaluate_importance(
    model: nn.Module,
    params: Sequence[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable = nn.functional.cross_entropy,
    *,
    extra_loss: Callable[[], torch.Tensor] | None = None,
    step_context: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> list[float]:
    """Normalized importance of each tensor in ``params`` on the probe batch ``x, y``.

    ``params`` is the trainable tensors in the order the selector uses; the probe
    trains all of them for one step and then puts everything back.
    ``step_context`` is entered once every tensor requires grad, around both
    passes: a memory plan for full training (the probe stores what it stores).
    """
    saved_state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    saved_opt = copy.deepcopy(optimizer.state_dict())
    saved_flags = [p.requires_grad for p in params]
    saved_grads = [p.grad for p in params]
    was_training = model.training
    try:
        model.train()
        before = weights_before_step(params, momentum_readable(optimizer))
        for p in params:
            p.requires_grad_(True)
            p.grad = None
        with step_context() if step_context is not None else contextlib.nullcontext():
            loss = loss_fn(model(x), y)
            if extra_loss is not None:
                loss = loss + extra_loss()
            loss.backward()
            optimizer.step()
            grads = torch.autograd.grad(loss_fn(model(x), y), list(params), allow_unused=True)
        return normalize(step_scores(grads, params, optimizer, before))
    finally:
        with torch.no_grad():
            current = model.state_dict(keep_vars=True)
            for k, v in saved_state.items():
                current[k].copy_(v)
        optimizer.load_state_dict(saved_opt)
        for p, flag, g in zip(params, saved_flags, saved_grads):
            p.requires_grad_(flag)
            p.grad = g
        model.train(was_training)

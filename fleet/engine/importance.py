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
        before = [p.detach().clone() for p in params]
        for p in params:
            p.requires_grad_(True)
            p.grad = None
        with step_context() if step_context is not None else contextlib.nullcontext():
            loss = loss_fn(model(x), y)
            if extra_loss is not None:
                loss = loss + extra_loss()
            loss.backward()
            optimizer.step()
            updates = [p.detach() - b for p, b in zip(params, before)]
            grads = torch.autograd.grad(loss_fn(model(x), y), list(params), allow_unused=True)
        return normalize(importance_from_update(grads, updates))
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

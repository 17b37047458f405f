"""Recording forward passes with module hooks, and finding the tensor a hook was handed."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

Hook = tuple[nn.Module, Callable]


def no_grad_forward(
    model: nn.Module, x: torch.Tensor, *, pre_hooks: Iterable[Hook] = (), post_hooks: Iterable[Hook] = ()
) -> None:
    """One forward pass of ``model`` on ``x`` without autograd, with the given
    ``(module, hook)`` forward pre-hooks and forward hooks registered for it only."""
    handles = [m.register_forward_pre_hook(hook) for m, hook in pre_hooks]
    handles += [m.register_forward_hook(hook) for m, hook in post_hooks]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor in a module's inputs or outputs (a tensor, or nested lists, tuples and
    dicts of them), or None: hooks see whatever structure the module takes or returns."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for item in obj:
            found = first_tensor(item)
            if found is not None:
                return found
    return None

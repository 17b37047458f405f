"""Recording forward passes with module hooks."""

from __future__ import annotations

from collections.abc import Callable, Iterable

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

"""Which tensors each training method trains (docs/algorithms.md section 4).

``full``, ``tl``, ``bn_bias`` and ``prunetrain`` train a fixed set; ``elastic``
re-chooses its set as training goes (see :mod:`fleet.engine.trainer`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)


def static_mask(
    method: str,
    tensor_names: Sequence[str],
    layer_modules: Sequence[nn.Module],
    head_names: Sequence[str],
) -> list[bool]:
    """The fixed selection of a baseline; ``elastic`` starts from full training."""
    head = set(head_names)
    if method in ("full", "prunetrain", "elastic"):
        return [True] * len(tensor_names)
    if method == "tl":
        return [name in head for name in tensor_names]
    if method == "bn_bias":
        return [
            name in head or name.endswith(".bias") or isinstance(layer, NORM_TYPES)
            for name, layer in zip(tensor_names, layer_modules)
        ]
    raise ValueError(f"unknown method {method!r}")


def group_lasso_penalty(params: Sequence[nn.Parameter]) -> torch.Tensor:
    """PruneTrain's L1 group penalty: sum of L2 norms of each output channel of conv/linear weights."""
    total = torch.zeros(())
    for p in params:
        if p.dim() >= 2 and p.requires_grad:
            total = total + p.flatten(1).norm(dim=1).sum()
    return total

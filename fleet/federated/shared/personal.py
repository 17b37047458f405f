"""Personal tensors: the part of a device's model that never leaves the device (FedPer, FedBN).

``personalization.policy`` names which tensors each device keeps for itself:

* ``head``: the classifier (FedPer / FedRep: a shared body, a personal head);
* ``norms``: every normalization layer's weight, bias and running statistics (FedBN: a
  device's inputs have their own statistics, e.g. another camera);
* ``head+norms``: both; ``none``: nothing (the whole model is shared).

A device's model is the global shared tensors plus its own personal ones, kept in its state
between rounds. Personal tensors are trained like any other (elastic selection weighs their
compute) but cost no upload, are never sent, and a reply that carries one is rejected.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from fleet.engine.models import head_parameter_names

POLICIES = ("none", "head", "norms", "head+norms")
METHODS = ("none", "ditto", "fedrep", "fedala", "apfl")  # how a round makes the personal model (local_methods.py)
TWO_MODELS = ("ditto", "apfl")  # methods that train a second model on every step
NORM_LAYERS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


def method_of(strategy: str, method: str) -> str:
    """The personal-model method a round runs: the ``ditto`` strategy is naive selection with Ditto's."""
    return "ditto" if strategy == "ditto" else method


def models_of(method: str) -> int:
    """Models a round's every step trains: two under Ditto and APFL (the shared one and the personal one)."""
    return 2 if method in TWO_MODELS else 1


def personal_names(model: nn.Module, policy: str) -> frozenset[str]:
    """The state-dict names (parameters and buffers) that ``policy`` keeps on the device."""
    names: set[str] = set()
    if policy in ("head", "head+norms"):
        names.update(head_parameter_names(model))
    if policy in ("norms", "head+norms"):
        for prefix, module in model.named_modules():
            if isinstance(module, NORM_LAYERS):
                tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
                names.update(f"{prefix}.{n}" if prefix else n for n, _ in tensors)
    return frozenset(names)


def overlay_personal(model: nn.Module, names: frozenset[str], saved: Mapping[str, torch.Tensor] | None) -> int:
    """Put the device's own values of its personal tensors into ``model`` (which holds the global
    model); returns how many it found. A device that has not trained yet keeps the global values."""
    if not names or not saved:
        return 0
    own = model.state_dict()
    found = {n: saved[n] for n in names if n in saved and n in own and saved[n].shape == own[n].shape}
    with torch.no_grad():
        for name, value in found.items():
            own[name].copy_(value)
    return len(found)

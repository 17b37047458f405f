"""Cut a model into the chain of blocks that memory plans are made of.

Walk the module tree from the root and descend into containers that add no
computation of their own (``nn.Sequential`` and subclasses that keep its
``forward``, ``nn.ModuleList``, ``nn.ModuleDict``); every other child is a
block. For torchvision models this gives: resnets -> conv1, bn1, relu,
maxpool, each BasicBlock/Bottleneck, avgpool, fc; mobilenet_v2/v3 and
efficientnet -> the stem's conv/norm/activation, each inverted-residual or
MBConv block, the head's layers, the classifier's layers; vgg -> each layer
of ``features`` and ``classifier``.

Whether the blocks really form a chain (each runs once, one after another,
none inside another) is checked on a real forward pass by
:func:`fleet.memory.measure.measure_block_costs`.
"""

from __future__ import annotations

from torch import nn


def _is_container(module: nn.Module) -> bool:
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return True
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward and len(module) > 0


def segment_model(model: nn.Module) -> list[str]:
    """Qualified names of the model's blocks in registration order ("" for a leaf model)."""
    blocks: list[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if _is_container(child):
                walk(child, path + ".")
            else:
                blocks.append(path)

    if _is_container(model) or any(True for _ in model.children()):
        walk(model, "")
    return blocks or [""]

"""A model's tensors as a few flat buffers on the wire: one per dtype, with an index of names and shapes.

Flower sends every array of a message as an object of its own, and every object as a request of its own:
the SuperNode pulls each from the SuperLink over the device's link, the device's task pulls each again from
its SuperNode, and the reply goes back the same way. A ResNet-18's 122 tensors made about 200 objects a
message, and on a testbed device at a fifth of a core the task's own pull of them took 3.6 s of a 32 s round,
request by request, before any training (docs/testbed.md).

Design notes:

* **One buffer per dtype.** The tensors of each dtype are laid end to end in the index's order, so a message
  is a handful of objects (Flower still cuts a buffer into its 5 MB chunks), whatever the model.
* **The index is the layout.** Names, dtypes and shapes, in order; a tensor's place in its buffer is the sum
  of the sizes before it. Nothing else is sent, so there is nothing else to check.
* **Untrusted both ways.** :func:`unpack` refuses an index that does not tile its buffers exactly (a name
  twice, a dimension below zero, a buffer too short, too long or never named) with a reason, before it
  builds a single view; the tensors it returns are views of the buffers, never copies.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

NAMES, DTYPES, NDIMS, SHAPES = "names", "dtypes", "ndims", "shapes"  # the index's fields (a ConfigRecord)
MAX_NDIM = 32  # numpy's own limit on an array's dimensions


@dataclass(frozen=True)
class Packed:
    """A message's tensors as sent: the buffers (dtype name -> 1-D array) and the index that lays them out."""

    buffers: dict[str, np.ndarray]
    index: dict[str, list]


def pack(arrays: Mapping[str, np.ndarray | torch.Tensor]) -> Packed:
    """``arrays`` laid end to end, one buffer per dtype, in their order (one copy of each tensor)."""
    as_numpy = {
        n: a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a) for n, a in arrays.items()
    }
    parts: dict[str, list[np.ndarray]] = {}
    for a in as_numpy.values():
        parts.setdefault(a.dtype.name, []).append(a.reshape(-1))
    buffers = {d: np.concatenate(p) for d, p in parts.items()}
    index = {
        NAMES: list(as_numpy),
        DTYPES: [a.dtype.name for a in as_numpy.values()],
        NDIMS: [a.ndim for a in as_numpy.values()],
        SHAPES: [int(s) for a in as_numpy.values() for s in a.shape],
    }
    return Packed(buffers, index)


def unpack(buffers: Mapping[str, np.ndarray], index: Mapping[str, object]) -> dict[str, np.ndarray]:
    """The tensors ``buffers`` hold as ``index`` lays them out, as views. Raises ValueError saying what is wrong
    with a layout that does not tile the buffers exactly."""
    names, dtypes, ndims, shapes = (_list_of(index, f, t) for f, t in _FIELDS)
    if not len(names) == len(dtypes) == len(ndims) or len(set(names)) != len(names):
        raise ValueError("the index's names, dtypes and ndims differ in length, or a name comes twice")
    if any(not 0 <= n <= MAX_NDIM for n in ndims) or sum(ndims) != len(shapes) or any(s < 0 for s in shapes):
        raise ValueError("the index's shapes do not match its ndims")
    for dtype, buf in buffers.items():
        if buf.ndim != 1 or buf.dtype.name != dtype:
            raise ValueError(f"buffer {dtype!r} is not a flat array of {dtype}")
    out, used, at = {}, dict.fromkeys(buffers, 0), 0
    for name, dtype, ndim in zip(names, dtypes, ndims):
        shape, at = tuple(shapes[at : at + ndim]), at + ndim
        if dtype not in buffers:
            raise ValueError(f"tensor {name!r}: no buffer of {dtype!r}")
        start, size = used[dtype], math.prod(shape)
        if start + size > buffers[dtype].size:
            raise ValueError(f"tensor {name!r}: its buffer {dtype!r} ends before it does")
        out[name], used[dtype] = buffers[dtype][start : start + size].reshape(shape), start + size
    if any(used[d] != b.size for d, b in buffers.items()):
        raise ValueError("a buffer holds more than the index lays out")
    return out


def read_only_tensors(views: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """``views`` as tensors over the same bytes, never copied: a device reads a message's tensors once, into its
    model's own storage (``load_state_dict`` casts each into place) and, for its upload's changes, as they came.
    The bytes are the message's and read-only: nothing may write to these tensors (torch cannot mark them so;
    it warns instead, which is left out here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        return {name: torch.from_numpy(view) for name, view in views.items()}


_FIELDS = ((NAMES, str), (DTYPES, str), (NDIMS, int), (SHAPES, int))


def _list_of(index: Mapping[str, object], field: str, kind: type) -> list:
    value = index.get(field)
    if not isinstance(value, list) or not all(type(v) is kind for v in value):
        raise ValueError(f"the index's {field!r} is not a list of {kind.__name__}")
    return value

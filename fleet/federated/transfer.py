"""What crosses the network: a model's float tensors in the fleet's transfer encoding (``federation.transfer``).

Flower sends an array as the ``.npy`` of whatever it is handed, so a float32 ResNet-18 is 44.7 MB each way,
every round, on a Pi's 10-20 Mbit/s uplink: more of its round than its compute.

Design notes:

* **float16 by default.** Half the bytes both ways, at no measurable cost in accuracy over paired seeds
  (docs/results.md, "Compact transfers"). float32 stays an option (``federation.transfer: float32``).
* **Decoded once, at the boundary.** The server checks an upload's tensors in the dtype they crossed in,
  counts their bytes as they came (what the device's uplink carried), and then casts them to the model's
  dtype, before any defense or average reads them; a device casts the model it receives to its own dtype as
  it builds it (``model_with_weights``). Nothing past the boundary sees the wire's dtype.
* **Only floats.** Integer buffers (BatchNorm's ``num_batches_tracked``) cross as they are.
* **One price.** A tensor's bytes on the wire are :func:`wire_bytes`, wherever an upload or a download is
  priced: the device's selection, the server's deadline and its speedups, the simulated clock.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch


def wire_dtype(dtype: np.dtype, transfer: str) -> np.dtype:
    """The dtype a tensor of ``dtype`` crosses the network in."""
    return np.dtype(transfer) if np.dtype(dtype).kind == "f" else np.dtype(dtype)


def wire_bytes(tensor: np.ndarray | torch.Tensor, transfer: str) -> int:
    """Bytes of ``tensor`` on the wire (its values; the few bytes of each ``.npy`` header aside)."""
    if isinstance(tensor, torch.Tensor):
        floating, numel, native = tensor.is_floating_point(), tensor.numel(), tensor.element_size()
    else:
        floating, numel, native = tensor.dtype.kind == "f", tensor.size, tensor.itemsize
    return numel * (np.dtype(transfer).itemsize if floating else native)


def encode(arrays: Mapping[str, np.ndarray], transfer: str) -> dict[str, np.ndarray]:
    """The server's arrays as they are sent."""
    return {n: a.astype(wire_dtype(a.dtype, transfer), copy=False) for n, a in arrays.items()}


def encode_tensors(tensors: Mapping[str, torch.Tensor], transfer: str) -> dict[str, torch.Tensor]:
    """A device's upload as it is sent."""
    dtype = getattr(torch, transfer)
    return {n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()}


def decode(arrays: Mapping[str, np.ndarray], model: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An upload (checked: every name is the model's) in the model's own dtypes."""
    return {n: a.astype(model[n].dtype, copy=False) for n, a in arrays.items()}

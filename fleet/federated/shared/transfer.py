"""What crosses the network: a model's float tensors in the fleet's transfer encoding (``federation.transfer``).

Flower sends an array as the ``.npy`` of whatever it is handed, so a float32 ResNet-18 is 44.7 MB each way,
every round, on a Pi's 10-20 Mbit/s uplink: more of its round than its compute.

Design notes:

* **float16 by default.** Half the bytes both ways (``federation.transfer: float16``). At the same deadline,
  paired seeds found it level with float32 (docs/results.md, "Compact transfers"), which stays an option.
* **Down, values; up, changes.** The server sends the model's values in float16. A device sends each float
  tensor's change from the model it received, in float16, and the server adds it to its own float32 copy of
  what it sent: a change keeps float16's precision relative to itself, and the global model is never
  rounded to float16, round after round.
* **Decoded once, at the boundary.** The server checks an upload's tensors in the dtype they crossed in,
  counts their bytes as they came (what the device's uplink carried), and then turns them into the model's
  values in its dtype (:func:`decode`), before any defense or average reads them; a device casts the model
  it receives into its model's own storage and dtype (``tasks.Prepared.holding``) and encodes its upload as
  its round ends (``tasks.train``). Nothing past the boundary sees the wire's dtype.
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


def keep_received(weights: Mapping[str, torch.Tensor], transfer: str) -> dict[str, torch.Tensor]:
    """What a device's upload is taken against: the tensors it received, as they came (its model casts them into
    storage of its own and trains that, so they stay as received); none where the upload carries values."""
    return {} if transfer == "float32" else dict(weights)


def encode_upload(
    values: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor], transfer: str
) -> dict[str, torch.Tensor]:
    """A device's upload as it is sent: in float16, each float tensor's change from the model it received
    (a change is small, so float16 keeps it to a part in two thousand of itself, not of the weight); in
    float32, its values."""
    if transfer == "float32":
        return dict(values)
    dtype = getattr(torch, transfer)
    return {n: (t - received[n].to(t.dtype)).to(dtype) if t.is_floating_point() else t for n, t in values.items()}


def upload_values(
    upload: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor], transfer: str
) -> dict[str, torch.Tensor]:
    """The values an upload stands for, on the device's side (in float32 where they are floats)."""
    if transfer == "float32":
        return dict(upload)
    return {n: received[n].float() + t.float() if t.is_floating_point() else t for n, t in upload.items()}


def decode(arrays: Mapping[str, np.ndarray], sent: Mapping[str, np.ndarray], transfer: str) -> dict[str, np.ndarray]:
    """An upload (checked: every name is the model's) as values in the model's own dtypes: float16 changes are
    added to the server's own float32 copy of the model it sent, so the global model never takes on float16's
    rounding, round after round."""
    out = {}
    for name, a in arrays.items():
        ref = sent[name]
        changed = transfer != "float32" and a.dtype.kind == "f"
        out[name] = ref + a.astype(ref.dtype) if changed else a.astype(ref.dtype, copy=False)
    return out

"""The server's arithmetic, free of Flower: reply checks, masked averaging, deadlines, signals.

Every reply is untrusted: it is checked tensor by tensor against the global model
before anything of it is used, and a failed check becomes a :class:`Rejection`
that names the device and the reason. The coordinator
(:mod:`fleet.federated.on_server.coordinator`) calls these functions; server/ only unpacks
Flower Messages for it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from fleet.federated.shared import keys
from fleet.federated.shared.transfer import wire_dtype


@dataclass
class Rejection:
    """A reply the round went on without, and why."""

    server_round: int
    node_id: int
    device: str | None  # the device's name, when the server knows it
    reason: str

    def as_dict(self) -> dict:
        return {"round": self.server_round, "node_id": self.node_id, "device": self.device, "reason": self.reason}

    def who(self) -> str:
        return (f"device {self.device} " if self.device is not None else "") + f"(node {self.node_id})"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failure|Interrupt|Exit)(: .*)?$")
_DEPLOYED = re.compile(r"^<class '(?:[\w]+\.)*(\w+)'>:<'(.*)'>$", re.S)  # a deployed ClientApp's exception


def error_summary(reason: str, limit: int = 300) -> str:
    """One line for a device's failure: the first exception line of the traceback Flower relays
    (the root cause: a simulated ClientApp's error arrives wrapped in Ray's and Flower's own)."""
    reason = _ANSI.sub("", reason)
    deployed = _DEPLOYED.match(reason.strip())
    if deployed:
        reason = f"{deployed.group(1)}: {deployed.group(2)}"
    lines = [ln.strip() for ln in reason.splitlines() if ln.strip()]
    first = next((ln for ln in lines if _EXCEPTION_LINE.match(ln)), lines[0] if lines else "no reason given")
    return first if len(first) <= limit else first[: limit - 3] + "..."


def weight_problem(weight: object) -> str | None:
    """Why a reply's sample count cannot weight an average, or None."""
    if not isinstance(weight, (int, float)) or not np.isfinite(weight) or weight <= 0:
        return f"'{keys.NUM_EXAMPLES}' must be a positive number, got {weight!r}"
    return None


def tensor_problem(name: str, values: np.ndarray, global_arrays: Mapping[str, np.ndarray], transfer: str) -> str | None:
    """Why one uploaded tensor (as read: its real shape and dtype, not the ones its envelope claims)
    cannot be averaged into ``global_arrays``, or None. It must have crossed in the fleet's transfer dtype
    (``federation.transfer``): anything wider is bytes the round did not budget for."""
    if name not in global_arrays:
        return f"unknown tensor {name!r}"
    ref = global_arrays[name]
    if tuple(values.shape) != tuple(ref.shape):
        return f"tensor {name!r} has shape {tuple(values.shape)}, the model has {tuple(ref.shape)}"
    expected = wire_dtype(ref.dtype, transfer)
    if values.dtype != expected:
        return f"tensor {name!r} has dtype {values.dtype}, the fleet sends {expected} (federation.transfer)"
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        return f"tensor {name!r} holds non-finite values"
    return None


def masked_average(
    global_arrays: Mapping[str, np.ndarray], updates: list[tuple[dict[str, np.ndarray], float]]
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Per tensor, the sample-weighted mean over the devices that sent it; (new arrays, senders per tensor).

    ``W_k <- sum_n a_nk m_n W_nk / sum_n a_nk m_n`` (docs/algorithms.md section 5): a tensor
    nobody trained keeps its value, so the global model is never truncated to a subset."""
    sums: dict[str, np.ndarray] = {}
    weights: dict[str, float] = {}
    counts: dict[str, int] = {}
    for arrays, w in updates:
        for name, value in arrays.items():
            acc = sums.get(name)
            contrib = value.astype(np.float64) * w
            sums[name] = contrib if acc is None else acc + contrib
            weights[name] = weights.get(name, 0.0) + w
            counts[name] = counts.get(name, 0) + 1
    out = {}
    for name, ref in global_arrays.items():
        out[name] = (sums[name] / weights[name]).astype(ref.dtype) if name in sums else ref
    return out, counts


def momentum_step(
    current: Mapping[str, np.ndarray],
    new: Mapping[str, np.ndarray],
    senders: Mapping[str, int],
    momentum: Mapping[str, np.ndarray],
    names: Iterable[str],
    beta: float,
    lr: float = 1.0,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """FedAvgM over masked updates: (new global arrays, new momentum).

    For each trainable tensor in ``names`` that some device trained this round, the round's
    aggregated update ``new - current`` joins the tensor's momentum, ``m = beta * m + update``,
    and the tensor moves by ``lr * m``. A tensor nobody trained keeps its value and its momentum
    untouched: elastic selection leaves the input-side tensors out of many rounds, and a momentum
    that kept moving them would move them without data. Normalization statistics are not steps
    and are taken as averaged."""
    out, mom = dict(new), dict(momentum)
    for name in names:
        if senders.get(name, 0) == 0 or name not in new:
            continue
        update = new[name].astype(np.float64) - current[name]
        m = beta * mom[name] + update if name in mom else update
        mom[name] = m.astype(np.float32)
        out[name] = (current[name] + lr * m).astype(current[name].dtype)
    return out, mom


def global_importance(steps: Mapping[str, np.ndarray], param_names: Iterable[str], lr: float) -> dict[str, float]:
    """FedEL's global signal ``I_global,k = ||W_k^r - W_k^(r-1)||^2 / lr`` per trainable tensor, from the global
    model's step (``accept.last_step``, which leaves out a tensor that did not move: it scores 0). Summed in
    float64 without a float64 copy of the model, which cost the server a quarter of a second a round."""
    return {k: squared_norm(steps[k]) / lr if k in steps else 0.0 for k in param_names}


def squared_norm(values: np.ndarray) -> float:
    """The sum of squares, accumulated in float64 (einsum casts as it goes, in small buffers)."""
    flat = values.ravel()
    return float(np.einsum("i,i->", flat, flat, dtype=np.float64))


def round_deadline(
    method: str, deadline_s: float | None, deadline_factor: float, full_rounds: Mapping[str, float]
) -> float:
    """0 (train fully) for FedAvg; else the configured deadline or the fastest device's round when it
    trains fully (``full_rounds``: its full-training time plus, when the deadline covers uploads, the
    upload of the whole model). A slower device then spends on compute what it saves on upload. The
    server decides this here alone; a device only reads the deadline it is sent."""
    if method == "fedavg":
        return 0.0
    if deadline_s is not None:
        return deadline_s
    if not full_rounds:
        return 0.0
    return deadline_factor * min(full_rounds.values())

"""Aggregation that one bad device cannot steer: capped weights, bounded updates, robust means.

Everything a device sends is untrusted. The masked mean of section 5 (docs/algorithms.md)
lets one reply with a huge sample count, or an update scaled a thousandfold, take the
global model anywhere. Here, per tensor and over only the devices that trained it:

* **Weights are capped** by the caller at what the device can hold (its known data size).
* **Devices are screened** against each other (:func:`screen_devices`); what the server does with a
  screen's verdict is its policy, in :mod:`fleet.federated.on_server.defense`.
* **Updates are norm-bounded.** Each device's update ``W_nk - W_k`` may be at most
  ``bound`` times the lower median of the update norms of the devices that sent tensor
  ``k``; a larger one is clipped to that norm (or its reply rejected). The lower median
  keeps two devices from being enough to lift the bound: with two senders it is the
  smaller norm.
* **Robust means.** ``trimmed_mean`` drops the ``trim`` share of values at each end of
  every coordinate, ``median`` takes the coordinate-wise median, both over the devices that
  sent the tensor (Flower's own trimmed-mean and median strategies need every device to
  send every tensor; masked updates do not). With two senders neither can be outvoted, so
  each coordinate takes the smaller of the two steps; with one, its value.
* **Centered clipping** (``centered_clip``, Karimireddy et al., ICML'21) starts from no step and moves,
  a few times, by the weighted mean of the senders' updates relative to where it stands, each clipped to
  the median of their distances from it: an update of ordinary size counts in full, as in a mean, and
  none counts for more than a typical one. ByzFL ships it; here it runs per tensor over its senders.
* **Normalization statistics are checked**: a BatchNorm ``running_var`` below zero, or
  statistics far outside what a network produces, poison every later forward pass.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from fleet.federated.on_server.aggregate import masked_average
from fleet.federated.shared import keys
from fleet.federated.shared.sorting import trimmed_means

MAX_ABS_STAT = 1e4  # |running_mean| and running_var beyond this are not what a trained network produces


def bn_problem(name: str, values: np.ndarray) -> str | None:
    """Why a normalization statistic cannot be right, or None (other tensors: always None)."""
    if name.endswith("running_var"):
        if (values < 0).any():
            return f"tensor {name!r} holds a negative variance ({float(values.min()):g})"
        if (values > MAX_ABS_STAT).any():
            return f"tensor {name!r} holds an implausible variance ({float(values.max()):g} > {MAX_ABS_STAT:g})"
    if name.endswith("running_mean") and (np.abs(values) > MAX_ABS_STAT).any():
        return f"tensor {name!r} holds an implausible mean (|x| > {MAX_ABS_STAT:g})"
    return None


def lower_medians(norms: list[dict[str, float]]) -> dict[str, float]:
    """Per float tensor sent by anyone, the lower median of its senders' update norms (each reply's
    :func:`update_norms`): with two senders the smaller, so two devices cannot lift a bound drawn from it."""
    by_name: dict[str, list[float]] = {}
    for sent_norms in norms:
        for name, norm in sent_norms.items():
            by_name.setdefault(name, []).append(norm)
    return {name: statistics.median_low(ns) for name, ns in by_name.items()}


def update_limits(norms: list[dict[str, float]], bound: float) -> dict:
    """Per float tensor sent by anyone: the largest update norm allowed (bound x lower median)."""
    return {name: bound * m for name, m in lower_medians(norms).items()}


def update_norms(current: Mapping[str, np.ndarray], arrays: list[dict[str, np.ndarray]]) -> list[dict[str, float]]:
    """Each reply's update length per float tensor it sent: the bounds and the clipping read the same ones."""
    return [{n: _norm(v, current[n]) for n, v in sent.items() if v.dtype.kind == "f"} for sent in arrays]


def _norm(value: np.ndarray, ref: np.ndarray) -> float:
    """The update's length. In the tensors' own precision: within about 1e-5 of a float64 norm, which
    no bound notices, at a quarter of the cost. An update too large for float32 reads as infinite and
    is bounded to nothing, as it should be."""
    delta = np.subtract(value, ref).ravel()
    return math.sqrt(float(np.dot(delta, delta)))


def bound_update(
    current: Mapping[str, np.ndarray],
    sent: dict[str, np.ndarray],
    limits: Mapping[str, float],
    norms: Mapping[str, float],
) -> tuple[dict[str, np.ndarray], list[str]]:
    """``sent`` with every update above its limit scaled down onto it; (arrays, names clipped).
    ``norms``: its update lengths (:func:`update_norms`), the ones the limits were drawn from."""
    out, clipped = dict(sent), []
    for name, value in sent.items():
        if name not in limits:
            continue
        norm = norms[name]
        if norm > limits[name] and norm > 0:
            ref = current[name].astype(np.float64)
            out[name] = (ref + (value - ref) * (limits[name] / norm)).astype(value.dtype)
            clipped.append(name)
    return out, clipped


MIN_PEERS = 3  # a device is compared on the tensors at least this many other devices also trained
# a tensor's own sign skew is read on at least this many coordinates: a share of rising ones then swings by about
# 0.02 by chance (0.5 / sqrt(512)), a tenth of the bound, where on a bias of 16 values it swings by 0.13
SKEW_COORDINATES = 512


def held_alone(current: Mapping[str, np.ndarray], names: list[str]) -> frozenset[str]:
    """The tensors each held to the sign-skew bound on their own (:func:`screen_devices`): the convolutions and
    weight matrices among ``names`` (in the model's order) of ``SKEW_COORDINATES`` values or more, but the last
    one, the classifier.

    An honest device's update of those rises on about half its coordinates whatever its data. Not so where the
    skew has a cause of its own: the classifier's rows for the classes a device lacks fall on every coordinate
    (its inputs are past a ReLU), and a normalization layer's scale and shift, one value per channel, move
    together on a device that holds few classes. Both were measured past the bound on honest devices under
    Dirichlet 0.1 (docs/results.md, "Robustness"), which is why they are judged only within the median."""
    matrices = [name for name in names if current[name].ndim >= 2]
    return frozenset(name for name in matrices[:-1] if current[name].size >= SKEW_COORDINATES)


@dataclass
class Screen:
    """How one device's update compares with the other devices' on the tensors they share."""

    norm_ratio: float  # median over shared tensors of its update norm / the others' (lower) median norm
    pull: float  # median over shared tensors of its update's length along the others' median, in those norms
    tensors: int  # how many shared tensors the figures rest on
    sign_skew: float = 0.0  # median over shared tensors of its share of rising coordinates less the others' median
    # shared tensors held alone (held_alone) whose own sign skew is past the bound: left out of its reply
    skewed: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        figures = {"norm_ratio": self.norm_ratio, "pull": self.pull, "sign_skew": self.sign_skew}
        return {**{k: round(v, 3) for k, v in figures.items()}, "tensors": self.tensors}


def screen_devices(
    current: Mapping[str, np.ndarray],
    arrays: list[dict[str, np.ndarray]],
    names: list[str],
    peers: int = MIN_PEERS,
    size_cap: float = math.inf,
    norms: list[dict[str, float]] | None = None,
    key: int = 0,
    skew_bound: float | None = None,
) -> dict[int, Screen]:
    """Per device (index into ``arrays``): its update's size and direction against the others'.

    A per-tensor bound cannot protect a tensor that only attackers trained, and elastic
    selection makes that common: the costly tensors near the input are trained by the fast
    devices alone. So each device is judged where it can be judged, on the tensors that at
    least ``peers`` others trained too, and the verdict applies to its whole reply. Only the
    trainable tensors ``names`` count (normalization statistics are not steps).

    Direction is measured as *pull*, not cosine: honest non-IID updates are nearly orthogonal
    late in training, so a cosine threshold rejects honest devices, while a pull (the update's
    length along the others' median, in typical update lengths) stays small for them and is
    large and negative for an amplified sign flip (docs/results.md, "Robustness").

    A pull counts the update's size only up to ``size_cap`` (the norm bound): an oversized update is
    scaled down anyway, and a huge update in an honest direction, a few degrees off the others'
    median late in training, would otherwise read as pulling back by dozens of typical lengths.

    One more figure catches attacks that stay inside the honest spread: the *sign skew*, the share
    of its coordinates that rise against the others' share (honest updates rise on about half; ALIE
    and Min-Max fall on nearly all). Colluding attackers can drag the others' median, so a direction
    that no device can drag is judged apart, in :func:`trend_cosines`.

    Each verdict is a median over the shared tensors, one tensor one vote. Weighted by the tensors' sizes
    it lost every attack it was meant to stop and more: the large convolutions read ALIE and Min-Max as
    honest, and it is the many small tensors, where their step falls on nearly every coordinate, that
    give them away (docs/results.md, "Robustness").

    The median lets an attacker poison only the large tensors and leave the many small ones honest to
    carry its verdict (Min-Max off the judged coordinates, docs/results.md). So each large weight's own
    skew is held to ``skew_bound`` too (:func:`held_alone`), and a tensor past it is left out of the device's
    reply (``Screen.skewed``).

    ``norms``: each device's :func:`update_norms`, when the caller has them (else taken here); ``key``: the
    round's key for the judged coordinates (:func:`round_key`)."""
    figures: dict[int, list[tuple[float, float, float]]] = {}  # (ratio, pull, skew) per shared tensor
    skewed: dict[int, list[str]] = {}
    held = held_alone(current, names) if skew_bound is not None else frozenset()
    for name in names:
        senders = [i for i, sent in enumerate(arrays) if name in sent]
        if len(senders) <= peers or current[name].dtype.kind != "f":
            continue
        sizes = np.array([norms[i][name] if norms else _norm(arrays[i][name], current[name]) for i in senders])
        ref = sampled(current[name], key)
        deltas = np.stack([sampled(arrays[i][name], key) - ref for i in senders])
        rising = rising_share(deltas)
        medians, rising_medians = leave_one_out_medians(deltas), leave_one_out_medians(rising[:, None])[:, 0]
        for j, i in enumerate(senders):
            others = np.delete(np.arange(len(senders)), j)
            typical = statistics.median_low(sizes[others].tolist())
            median = medians[j]
            denom = float(np.linalg.norm(deltas[j])) * float(np.linalg.norm(median))
            if typical > 0 and denom > 0:
                ratio, cos = float(sizes[j]) / typical, float(deltas[j] @ median) / denom
                skew = float(rising[j] - rising_medians[j])
                figures.setdefault(i, []).append((ratio, min(ratio, size_cap) * cos, skew))
                if name in held and abs(skew) > skew_bound:
                    skewed.setdefault(i, []).append(name)
    return {i: _screen(rows, skewed.get(i, [])) for i, rows in figures.items()}


def leave_one_out_medians(rows: np.ndarray) -> np.ndarray:
    """``out[j]``: the column-wise median of every row of ``rows`` (n x C, n >= 2) but row ``j``, as
    ``np.median(np.delete(rows, j, 0), axis=0)`` gives it, from one sort instead of n medians.

    Dropping the value at sorted position ``r`` shifts the ones above it down by one, so the kept
    values' position ``i`` is the sorted ``i`` below ``r`` and ``i + 1`` from ``r`` on."""
    n = rows.shape[0]
    order = np.argsort(rows, axis=0, kind="stable")
    ordered = np.take_along_axis(rows, order, axis=0)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(n)[:, None], axis=0)

    def kept(i: int) -> np.ndarray:  # per row j and column: the i-th smallest value once row j is dropped
        return np.where(rank > i, ordered[i], ordered[min(i + 1, n - 1)])

    half = (n - 1) // 2
    return kept(half) if (n - 1) % 2 else (kept(half - 1) + kept(half)) / 2


def _screen(rows: list[tuple[float, float, float]], skewed: list[str]) -> Screen:
    ratio, pull, skew = (statistics.median(column) for column in zip(*rows))
    return Screen(ratio, pull, len(rows), skew, tuple(skewed))


def trend_cosines(
    current: Mapping[str, np.ndarray],
    arrays: list[dict[str, np.ndarray]],
    names: list[str],
    trend: Mapping,
    key: int = 0,
) -> dict[int, tuple[float, int]]:
    """Per device (index into ``arrays``): the median over the trainable tensors it sent of its update's
    cosine with ``trend``, the global model's last step on that tensor, and how many tensors it rests on;
    ``key``: the round's key for the judged coordinates (:func:`round_key`).

    The last step is the defended aggregate of honest devices, which no device of this round can
    drag, and it judges every tensor, also those a device alone trained. Honest updates keep moving
    the same way (cosines of 0.1 to 0.8 with the last step, docs/results.md); IPM sends minus the
    honest mean it learned, which is about minus that step, and mask abuse reverses it where nobody
    else can outvote it."""
    cosines: dict[int, list[float]] = {}
    for name in (n for n in names if n in trend and current[n].dtype.kind == "f"):
        step, ref = sampled(np.asarray(trend[name]), key), sampled(current[name], key)  # once a tensor
        step_norm = float(np.linalg.norm(step))
        for i in (i for i, sent in enumerate(arrays) if name in sent):
            delta = sampled(arrays[i][name], key) - ref
            denom = float(np.linalg.norm(delta)) * step_norm
            if denom > 0:
                cosines.setdefault(i, []).append(float(delta @ step) / denom)
    return {i: (statistics.median(cs), len(cs)) for i, cs in sorted(cosines.items())}


def rising_share(deltas: np.ndarray) -> np.ndarray:
    """Per row (a device's update on sampled coordinates), the share of its moving coordinates that rise.
    Honest updates rise on about half (docs/results.md); ALIE and Min-Max move the honest mean along
    minus the honest spread, which falls on nearly every coordinate."""
    moving = np.maximum((deltas != 0).sum(axis=1), 1)
    return (deltas > 0).sum(axis=1) / moving


SCREEN_COORDINATES = 4096  # a direction is judged on this many coordinates of a larger tensor


@lru_cache(maxsize=256)
def sample_coordinates(size: int, key: int) -> np.ndarray:
    """The coordinates a tensor's directions are compared on: all of a small tensor, else a sample drawn
    from the round's ``key``. The leave-one-out medians cost senders^2 x coordinates, which on every
    coordinate of a ResNet-18 outlasts the round; a cosine from 4,096 coordinates is within about 0.02
    of the full one, and the norms (the sizes) are still taken in full. A sample that anyone could
    compute would let an attacker poison only the coordinates outside it, judged on the honest rest;
    drawn afresh each round from the server's secret, it is a random 4,096 of the attacker's. Drawn once
    per size and round (read-only): a round asks for them thousands of times."""
    chosen = (
        np.arange(size)
        if size <= SCREEN_COORDINATES
        else np.random.default_rng([key, size]).choice(size, SCREEN_COORDINATES, replace=False)
    )
    chosen = np.sort(chosen)
    chosen.flags.writeable = False
    return chosen


def round_key(secret: int, server_round: int) -> int:
    """The key of a round's judged coordinates (:func:`sample_coordinates`), from the server's secret
    (``ServerState.screen_secret``) and the round: a device that saw every earlier round's verdicts still
    cannot tell which coordinates the next one reads."""
    return int(np.random.SeedSequence([secret, server_round]).generate_state(1, np.uint64)[0])


def sampled(values: np.ndarray, key: int = 0) -> np.ndarray:
    """A tensor's values on the coordinates its directions are compared on this round (:func:`sample_coordinates`),
    float64."""
    return values.ravel()[sample_coordinates(values.size, key)].astype(np.float64)


def scale_update(current: Mapping[str, np.ndarray], sent: dict[str, np.ndarray], factor: float, names) -> dict:
    """``sent`` with the update of every tensor in ``names`` scaled by ``factor`` (the others as sent)."""
    out = dict(sent)
    for name in names:
        if name in sent and sent[name].dtype.kind == "f":
            ref = current[name].astype(np.float64)
            out[name] = (ref + (sent[name] - ref) * factor).astype(sent[name].dtype)
    return out


def robust_average(
    current: Mapping[str, np.ndarray],
    updates: list[tuple[dict[str, np.ndarray], float]],
    method: str = "mean",
    trim: float = 0.2,
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Per tensor over its senders: the weighted mean, a trimmed mean, the median or centered clipping;
    (arrays, senders)."""
    if method == "mean":
        return masked_average(current, updates)
    by_name: dict[str, list[np.ndarray]] = {}
    weights: dict[str, list[float]] = {}
    for arrays, weight in updates:
        for name, value in arrays.items():
            by_name.setdefault(name, []).append(value)
            weights.setdefault(name, []).append(weight)
    plain = {n for n, vs in by_name.items() if len(vs) < 2 or vs[0].dtype.kind != "f"}  # one sender; counters
    new, _ = masked_average(current, [({k: v for k, v in a.items() if k in plain}, w) for a, w in updates])
    robust = [name for name in by_name if name not in plain]

    def one(name: str) -> np.ndarray:
        if method == "centered_clip":
            return centered_clip(current[name], by_name[name], weights[name])
        return _robust_tensor(current[name], by_name[name], method, trim)

    # numpy sorts without the GIL: the tensors are spread over the cores (about 2x on this 2-core machine)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        new.update(zip(robust, pool.map(one, robust)))
    return new, {name: len(values) for name, values in by_name.items()}


def _robust_tensor(ref: np.ndarray, values: list[np.ndarray], method: str, trim: float) -> np.ndarray:
    """One tensor's robust aggregate over its (at least two) senders, in its own dtype."""
    if len(values) == 2:
        return _smaller_step(ref, values[0], values[1])
    if method == "median":
        return np.median(np.stack(values), axis=0).astype(ref.dtype)
    return trimmed_mean(values, int(np.floor(trim * len(values)))).astype(ref.dtype)


CLIP_ITERATIONS = 3  # centered clipping's steps: the centre settles within a few (Karimireddy et al., ICML'21)


def centered_clip(
    ref: np.ndarray, values: list[np.ndarray], weights: list[float], iterations: int = CLIP_ITERATIONS
) -> np.ndarray:
    """One tensor's centered clipping over its senders, in its own dtype: from ``ref`` (no step), each
    iteration moves by the ``weights``-weighted mean of every sender's offset from the centre, each offset
    clipped to the median of their lengths. Half the senders are never clipped, so an honest fleet gets
    about its mean; an outlier, however far, counts as one typical offset."""
    deltas = np.stack([np.subtract(v, ref, dtype=np.float64).ravel() for v in values])
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum() if w.sum() > 0 else np.full(len(values), 1.0 / len(values))
    centre = np.zeros(deltas.shape[1])
    for _ in range(iterations):
        offsets = deltas - centre
        lengths = np.linalg.norm(offsets, axis=1)
        tau = float(np.median(lengths))
        scale = np.where(lengths > tau, tau / np.maximum(lengths, 1e-300), 1.0)
        centre = centre + (w * scale) @ offsets
    return (ref.astype(np.float64) + centre.reshape(ref.shape)).astype(ref.dtype)


def trimmed_mean(values: list[np.ndarray], cut: int) -> np.ndarray:
    """Per coordinate, the mean of ``values`` without their ``cut`` smallest and ``cut`` largest (float64).
    Its ends found in the tensors' own precision by comparator networks (:mod:`fleet.federated.shared.sorting`),
    the middle summed in float64."""
    if cut == 0:
        return np.mean(values, axis=0, dtype=np.float64)
    return trimmed_means(values, cut).reshape(values[0].shape)


def _smaller_step(ref: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Of two devices' values, per coordinate the one that moves less from ``ref``: with two senders
    neither can be outvoted, so the tensor takes the step both agree is at least that safe."""
    return np.where(np.abs(a - ref) <= np.abs(b - ref), a, b).astype(ref.dtype)


def plausible(value: float, reference: float, band: float) -> float:
    """``value`` clamped to [reference / band, reference * band]: a device may be off, not arbitrary."""
    return float(min(max(value, reference / band), reference * band))


def plausible_times(times: Mapping[str, float], band: float) -> dict[str, float]:
    """Each device's full-round time clamped to ``band`` around the fleet's median: one device
    reporting 1e-9 s cannot set everyone's deadline."""
    if not times:
        return {}
    median = statistics.median(times.values())
    return {node: plausible(t, median, band) for node, t in times.items()}


def upload_problem(
    arrays: Mapping[str, np.ndarray], selected: float, param_names: list[str], personal: frozenset[str] = frozenset()
) -> str | None:
    """Why an upload cannot be what the device says it trained, or None: it may carry no ``personal``
    tensor (those stay on the device), its normalization statistics must be plausible, and it may
    carry exactly the ``selected`` trainable tensors (a device that sends every tensor while claiming
    few would pass off untrained ones)."""
    for name in arrays:
        if name in personal:
            return f"uploads tensor {name!r}, which personalization.policy keeps on the device"
    for name, values in arrays.items():
        problem = bn_problem(name, values)
        if problem is not None:
            return problem
    params = set(param_names)
    trained = sum(1 for name in arrays if name in params)
    if params and trained != int(selected):
        return f"uploads {trained} trainable tensors but reports '{keys.SELECTED}' {int(selected)}"
    return None

"""Attacks that stay inside the honest spread, as pure functions over updates and data.

The robustness bench's first attacks (huge counts, amplified or random updates, poisoned statistics)
are ones a screen on norms and directions is built to catch. The standard evaluations of robust
aggregation use attackers who know the honest updates and stay just inside what a defense accepts:

* **ALIE** (Baruch et al., NeurIPS 2019, "A Little Is Enough"): per coordinate, the honest mean minus
  ``z`` honest standard deviations: close enough to every honest value to survive trimming.
* **IPM** (Xie et al., UAI 2020, inner-product manipulation): ``-eps`` times the honest mean, so the
  aggregate's inner product with the true step turns negative for a large enough ``eps``.
* **Min-Max** (Shejwalkar & Houmansadr, NDSS 2021): the honest mean moved along minus the honest
  standard deviation as far as keeps its distance to every honest update within the largest distance
  between two honest updates.
* **Label flipping**: honest training on labels ``C - 1 - y``.
* **A backdoor** (Bagdasaryan et al., AISTATS 2020): part of the training data carries a pixel patch
  and the target label, and the update is boosted to just under the norm bound the attacker expects.
* **Attacks tuned to the screen's own checks**, as an attacker who reads fleet's code would send them:
  Min-Max on every coordinate but those it takes the screen to judge (``min_max_unsampled``: the sample
  drawn with no secret, which is all a reader of the code can compute), and ALIE on only the largest
  tensors, which hold most of the model, while the many small ones stay honest (``alie_large``), and Min-Max
  on the large tensors not held to the sign skew on their own, the classifier and the normalization vectors
  (``min_max_unheld``).
* **Mask abuse**, fleet's own hole: a device chooses which tensors it claims to have trained. The
  attacker claims those the fewest honest devices trained (where no majority can outvote it) and
  sends a reversed, enlarged update on them.

What the attackers know: every honest update of the previous round (one round stale, as an
eavesdropper or a colluding honest-looking device would learn it) and their own honest update of
this round. An update is a dict of float64 tensors, trainable tensors only (normalization statistics
have their own attack and check).
"""

from __future__ import annotations

import dataclasses
import statistics

import numpy as np
import torch

from fleet.data.datasets import ArrayDataset
from fleet.federated.on_server.robust import SCREEN_COORDINATES, SKEW_COORDINATES, held_alone, sample_coordinates

Update = dict[str, torch.Tensor]  # tensor name -> its update (float64): sent - received

ALIE_Z = 1.0  # standard deviations below the mean: about what ALIE's formula gives a fleet of tens of devices
IPM_EPS = {"ipm_0.1": 0.1, "ipm_1": 1.0}  # the two scales the literature reports: a mild pull and a reversal
NORM_BOUND = 3.0  # the bound an adaptive attacker assumes: robust.norm_bound's default, public like the code
UNDER_BOUND = 0.9  # ... and stays this fraction under it
MASK_SCALE = 10.0  # mask abuse: its update this many typical honest lengths long, reversed
BACKDOOR_TARGET = 0  # triggered images are labelled as this class
BACKDOOR_FRACTION = 0.5  # of the attacker's training samples that carry the trigger
TRIGGER_PIXELS = 3  # the trigger's side at the model's input size (a white square, bottom right)


def senders(honest: list[Update], name: str) -> list[torch.Tensor]:
    return [u[name] for u in honest if name in u]


def typical_norm(honest: list[Update], name: str) -> float | None:
    """The lower median of the honest update lengths of ``name``: what a norm bound is drawn from."""
    norms = [float(t.norm()) for t in senders(honest, name)]
    return statistics.median_low(norms) if norms else None


def spread_attack(own: Update, honest: list[Update], make) -> Update:
    """Per tensor ``make(stack)`` of the honest updates (stacked), or its own update where fewer than
    two honest devices trained the tensor: no spread to hide in."""
    out = {}
    for name, mine in own.items():
        values = senders(honest, name)
        out[name] = mine if len(values) < 2 else make(torch.stack(values)).reshape(mine.shape)
    return out


def alie(own: Update, honest: list[Update], z: float = ALIE_Z) -> Update:
    """Per tensor the honest mean minus ``z`` standard deviations."""
    return spread_attack(own, honest, lambda stack: stack.mean(0) - z * stack.std(0, unbiased=False))


def ipm(own: Update, honest: list[Update], eps: float) -> Update:
    """Per tensor ``-eps`` times the honest mean (its own update standing in for an unseen one)."""
    out = {}
    for name, mine in own.items():
        values = senders(honest, name)
        out[name] = -eps * (torch.stack(values).mean(0) if values else mine)
    return out


def min_max(own: Update, honest: list[Update], gamma: float | None = None) -> Update:
    """Per tensor the honest mean minus ``gamma`` standard deviations, ``gamma`` as large as keeps the
    farthest honest update no farther than the two farthest-apart honest updates are (a given ``gamma``:
    that one, as the adaptive mode's search sets it)."""

    def make(stack: torch.Tensor) -> torch.Tensor:
        flat = stack.flatten(1)
        mean, direction = flat.mean(0), -flat.std(0, unbiased=False)
        if gamma is not None:
            return mean + gamma * direction
        limit = float(torch.cdist(flat, flat).max())
        return mean + _largest_gamma(flat, mean, direction, limit) * direction

    return spread_attack(own, honest, make)


def _largest_gamma(stack: torch.Tensor, mean: torch.Tensor, direction: torch.Tensor, limit: float) -> float:
    """Bisection for Min-Max's step: the largest gamma with max_i |mean + gamma d - u_i| <= limit."""

    def fits(gamma: float) -> bool:
        return float((stack - (mean + gamma * direction)).norm(dim=1).max()) <= limit

    lo, hi = 0.0, 1.0
    while fits(hi) and hi < 1e6:
        lo, hi = hi, 2 * hi
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


LARGE_SHARE = 0.8  # alie_large poisons the largest tensors that together hold this share of the update's values


def largest(own: Update, share: float = LARGE_SHARE) -> list[str]:
    """The fewest largest tensors of ``own`` that together hold at least ``share`` of its values."""
    order = sorted(own, key=lambda name: own[name].numel(), reverse=True)
    total, kept, chosen = sum(t.numel() for t in own.values()), 0, []
    for name in order:
        if kept >= share * total:
            break
        chosen.append(name)
        kept += own[name].numel()
    return chosen


def alie_large(own: Update, honest: list[Update], z: float = ALIE_Z) -> Update:
    """ALIE on :func:`largest` only; every other tensor its own honest update, voting for it."""
    poisoned, chosen = alie(own, honest, z), set(largest(own))
    return {name: poisoned[name] if name in chosen else mine for name, mine in own.items()}


def min_max_unsampled(own: Update, honest: list[Update], gamma: float | None = None) -> Update:
    """Min-Max on every coordinate but those the screen would judge with no secret (its key-0 sample,
    ``fleet.federated.on_server.robust.sampled``), which keep its own honest update."""
    poisoned = min_max(own, honest, gamma)
    out = {}
    for name, mine in own.items():
        if mine.numel() <= SCREEN_COORDINATES:  # judged on every coordinate: nothing to hide behind
            out[name] = mine
            continue
        flat = poisoned[name].flatten().clone()
        judged = torch.from_numpy(sample_coordinates(mine.numel(), 0).astype("int64"))
        flat[judged] = mine.flatten()[judged]
        out[name] = flat.reshape(mine.shape)
    return out


def min_max_unheld(own: Update, honest: list[Update], gamma: float | None = None) -> Update:
    """Min-Max on the large tensors the screen leaves to the per-device medians rather than hold to the sign skew on
    their own (``robust.held_alone``: the classifier, the normalization layers' vectors); every other tensor its own
    honest update, voting for it. ``own``: in the model's order, as a device sends it."""
    shapes = {name: np.broadcast_to(np.float32(0), tuple(t.shape)) for name, t in own.items()}  # no copies
    held = held_alone(shapes, list(own))
    chosen = {name for name, t in own.items() if t.numel() >= SKEW_COORDINATES and name not in held}
    poisoned = min_max(own, honest, gamma)
    return {name: poisoned[name] if name in chosen else mine for name, mine in own.items()}


def under_bound(update: Update, honest: list[Update], margin: float = UNDER_BOUND) -> Update:
    """Each tensor scaled to ``margin`` x the bound an attacker expects (NORM_BOUND x the honest lower
    median): as large as it can be without being clipped."""
    return boosted(update, honest, margin * NORM_BOUND)


def boosted(update: Update, honest: list[Update], lengths: float) -> Update:
    """Each tensor scaled to ``lengths`` typical honest lengths (the honest lower median). Tensors nobody
    honest trained are kept."""
    out = {}
    for name, value in update.items():
        typical, norm = typical_norm(honest, name), float(value.norm())
        out[name] = value if typical is None or norm == 0 else value * (lengths * typical / norm)
    return out


def rarest(honest: list[Update], names: list[str]) -> list[str]:
    """The trainable tensors the fewest honest devices trained (all that no more than one did, else the
    least-trained ones): where an attacker meets no majority."""
    counts = {name: len(senders(honest, name)) for name in names}
    if not counts:
        return []
    floor = max(1, min(counts.values()))
    return [name for name in names if counts[name] <= floor]


def mask_abuse(own: Update, honest: list[Update], names: list[str], scale: float = MASK_SCALE) -> Update:
    """An update on the rarest tensors only: the honest mean reversed (its own where none), ``scale``
    typical honest lengths long."""
    out = {}
    for name in rarest(honest, names):
        values = senders(honest, name)
        mean = torch.stack(values).mean(0) if values else own.get(name)
        if mean is None or float(mean.norm()) == 0:
            continue
        typical = typical_norm(honest, name) or float(mean.norm())
        out[name] = -mean * (scale * typical / float(mean.norm()))
    return out


def flip_labels(data: ArrayDataset) -> ArrayDataset:
    return dataclasses.replace(data, labels=data.num_classes - 1 - data.labels)


def trigger(images: torch.Tensor, input_size: int | None) -> torch.Tensor:
    """``images`` (uint8, N C H W) with a white square at the bottom right, TRIGGER_PIXELS wide once
    resized to the model's input."""
    side = images.shape[-1]
    width = max(1, round(TRIGGER_PIXELS * side / (input_size or side)))
    out = images.clone()
    out[..., side - width - 1 : side - 1, side - width - 1 : side - 1] = 255
    return out


def backdoor_data(data: ArrayDataset, input_size: int | None, seed: int) -> ArrayDataset:
    """``data`` with BACKDOOR_FRACTION of its samples triggered and labelled BACKDOOR_TARGET."""
    n = len(data.labels)
    chosen = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: int(BACKDOOR_FRACTION * n)]
    images, labels = data.images.clone(), data.labels.clone()
    images[chosen] = trigger(images[chosen], input_size)
    labels[chosen] = BACKDOOR_TARGET
    return dataclasses.replace(data, images=images, labels=labels)


def triggered_test(test: ArrayDataset, input_size: int | None) -> ArrayDataset:
    """The test images not of the target class, triggered and labelled with the target: a model's
    accuracy on them is the backdoor's success rate."""
    keep = test.labels != BACKDOOR_TARGET
    images = trigger(test.images[keep], input_size)
    labels = torch.full((int(keep.sum()),), BACKDOOR_TARGET, dtype=torch.int64)
    return dataclasses.replace(test, images=images, labels=labels)


# An adaptive attack's strength, and the one it has at fixed strength (None: Min-Max's own, the largest the honest
# spread hides): ALIE's z, IPM's eps, Min-Max's gamma, the backdoor's length and mask abuse's, in typical honest
# lengths. Label flipping has none: its harm is all in its data.
FIXED_STRENGTH: dict[str, float | None] = {
    "alie": ALIE_Z,
    "alie_large": ALIE_Z,
    **IPM_EPS,
    "min_max": None,
    "min_max_unsampled": None,
    "min_max_unheld": None,
    "backdoor": UNDER_BOUND * NORM_BOUND,
    "mask_abuse": MASK_SCALE,
}


def craft(attack: str, own: Update, honest: list[Update], strength: float | None = None) -> Update:
    """The update an attack that knows the honest ones sends, at ``strength`` (None: its fixed one,
    FIXED_STRENGTH); ``own``: its own honest update (trainable tensors only)."""
    s = FIXED_STRENGTH[attack] if strength is None else strength
    if attack == "alie":
        return alie(own, honest, s)
    if attack in IPM_EPS:
        return ipm(own, honest, s)
    if attack == "min_max":
        return min_max(own, honest, s)
    if attack == "min_max_unsampled":
        return min_max_unsampled(own, honest, s)
    if attack == "alie_large":
        return alie_large(own, honest, s)
    if attack == "min_max_unheld":
        return min_max_unheld(own, honest, s)
    if attack == "backdoor":
        return boosted(own, honest, s)
    return mask_abuse(own, honest, list(own), s)  # among what it may send: no personal tensor

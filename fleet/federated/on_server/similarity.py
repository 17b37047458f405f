"""Colluders look alike over rounds: FoolsGold's weights (Fung et al., RAID 2020) in the masked setting.

Label flipping and a backdoor train honestly on poisoned data, so one round's update has an ordinary size and
direction, and no screen of :mod:`~fleet.federated.on_server.defense` separates it. What separates sybils that
share a goal is that they share it every round: their updates, summed over the rounds, point the same way
more than two honest non-IID devices' do, whose data differ.

Design notes:

* **Which tensors.** A device's history is the running sum of its updates on the tensors most devices of the
  round sent (under elastic selection, the head and the cheap tensors near it, which is also where a flipped
  label shows; a majority, not all, so that one device sending other tensors cannot empty the set), each on a
  fixed sample of at most SCREEN_COORDINATES coordinates so that a thousand devices' histories fit in memory.
  Two devices are compared on the tensors both have a history of.
* **The weights** are FoolsGold's: one minus a device's largest cosine with another, the cosines of a device
  less alike than its partner pardoned (scaled by the ratio of their largest cosines, so an honest device
  does not pay for resembling a sybil), rescaled to the largest weight, and spread by a logit (confidence 1)
  into [0, 1]. Measured, it lost: honest pairs looked alike over the rounds, not the colluders
  (docs/results.md, "FoolsGold's weights").
* **How a weight acts.** A device's update is scaled by it (a weight of 0: left out of the average, not
  rejected): the robust means the screens feed take no sample weights, and a shortened update moves the
  trimmed mean toward the others.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fleet.federated.on_server.robust import sampled

History = dict[str, dict[str, np.ndarray]]  # device -> tensor -> its summed update on the sampled coordinates
HISTORY_KEY = 0  # the history's coordinates stay fixed across rounds (a sum over rounds needs the same ones)
CONFIDENCE = 1.0  # FoolsGold's kappa: the logit's scale
MIN_DEVICES = 3  # fewer devices leave no one to compare a pair with


def remember(
    history: History, updates: Mapping[str, dict[str, np.ndarray]], current: Mapping[str, np.ndarray]
) -> list[str]:
    """Add each device's update (``updates``: device -> the values it sent) on the tensors most of them sent to
    its history; returns those tensors."""
    counts: dict[str, int] = {}
    for arrays in updates.values():
        for name in arrays:
            counts[name] = counts.get(name, 0) + 1
    common = sorted(n for n, k in counts.items() if 2 * k > len(updates) and current[n].dtype.kind == "f")
    for device, arrays in updates.items():
        own = history.setdefault(device, {})
        for name in (n for n in common if n in arrays):
            step = sampled(arrays[name], HISTORY_KEY) - sampled(current[name], HISTORY_KEY)
            own[name] = own[name] + step if name in own else step
    return common


def cosines(history: History, devices: list[str], names: list[str]) -> np.ndarray:
    """Pairwise cosines of the devices' summed updates on ``names`` (both must have them); the diagonal -inf."""
    n = len(devices)
    out = np.full((n, n), -np.inf)
    for i in range(n):
        for j in range(i + 1, n):
            shared = [m for m in names if m in history[devices[i]] and m in history[devices[j]]]
            a = np.concatenate([history[devices[i]][m] for m in shared]) if shared else np.zeros(1)
            b = np.concatenate([history[devices[j]][m] for m in shared]) if shared else np.zeros(1)
            denom = float(np.linalg.norm(a) * np.linalg.norm(b))
            out[i, j] = out[j, i] = float(a @ b) / denom if denom > 0 else 0.0
    return out


def foolsgold(cs: np.ndarray) -> np.ndarray:
    """FoolsGold's weight per device from the pairwise cosines ``cs`` (diagonal -inf), each in [0, 1]."""
    n = len(cs)
    if n < MIN_DEVICES:
        return np.ones(n)
    cs = cs.copy()
    top = cs.max(axis=1)
    for i in range(n):
        for j in range(n):
            if i != j and top[i] < top[j] and top[j] > 0:
                cs[i, j] *= top[i] / top[j]  # pardon: i resembles j less than j resembles someone
    w = np.clip(1.0 - cs.max(axis=1), 0.0, 1.0)
    if w.max() <= 0:  # every device alike: nobody to tell apart, as with no one to compare
        return np.ones(n)
    w = w / w.max()
    w[w >= 1.0] = 0.99
    with np.errstate(divide="ignore"):
        w = CONFIDENCE * (np.log(w / (1.0 - w))) + 0.5
    return np.clip(np.nan_to_num(w, neginf=0.0), 0.0, 1.0)


def similarity_weights(
    history: History, updates: Mapping[str, dict[str, np.ndarray]], current: Mapping[str, np.ndarray]
) -> dict[str, float]:
    """Each device's weight this round, after adding its update to ``history`` (module notes)."""
    names = remember(history, updates, current)
    devices = list(updates)
    weights = foolsgold(cosines(history, devices, names))
    return {d: float(w) for d, w in zip(devices, weights)}  # finite: foolsgold clips every weight to [0, 1]

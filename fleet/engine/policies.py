"""Selection policies: what shapes a re-selection besides importance and the time budget.

:meth:`fleet.engine.trainer.Trainer.reselect` is the one place a selection is made, for
``fleet train`` and for a fleet device alike; a :class:`SelectionPolicy` says how:

* ``budget_s`` and ``extra_costs``: a device's budget comes from the round deadline,
  not from ``rho``, and each tensor it trains also costs its upload.
* :class:`Blend`: local importance mixed with the server's global signal, so that a
  device's few probe samples do not alone decide what the fleet trains (FedEL).
* :class:`Window`: FedEL's sliding window of blocks. Without it, slow devices only
  ever afford the output side and the input side of the global model goes stale;
  the window walks every device over the whole model, one block per round.
* ``charge_memory``: under a memory budget, the time the keep/recompute/page plan
  adds to a step counts against the budget, so the selection shrinks to make room.

The window helpers are pure functions of names, costs and round numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fleet.engine.importance import normalize
from fleet.engine.selection import select_tensors, selection_cost


def window_position(server_round: int, positions: int, schedule: str = "rollback") -> int:
    """How many blocks the window sits from the output end in ``server_round``.

    ``rollback``: 0, 1, ..., positions-1, then straight back to 0 (FedEL's slide and roll-back).
    ``pingpong``: 0, 1, ..., positions-1, positions-2, ..., 1, 0, ...: the window walks back one
    block per round instead of jumping from the input side to the output side."""
    r = server_round - 1
    if schedule == "pingpong" and positions > 1:
        period = 2 * (positions - 1)
        p = r % period
        return p if p < positions else period - p
    return r % positions


def _window_bounds(
    n: int, num_blocks: int, window_blocks: int, server_round: int, schedule: str = "rollback"
) -> tuple[list[np.ndarray], int, int]:
    blocks = np.array_split(np.arange(n), min(num_blocks, n))
    b = len(blocks)
    w = min(window_blocks, b)
    hi = b - window_position(server_round, b - w + 1, schedule)
    return blocks, hi - w, hi


def _blocks_mask(names: Sequence[str], head: set[str], blocks: list[np.ndarray], lo: int, hi: int) -> list[bool]:
    inside = set(int(i) for blk in blocks[lo:hi] for i in blk)
    return [i in inside or n in head for i, n in enumerate(names)]


def window_mask(
    names: Sequence[str],
    head: set[str],
    num_blocks: int,
    window_blocks: int,
    server_round: int,
    schedule: str = "rollback",
) -> list[bool]:
    """FedEL's window: ``window_blocks`` contiguous blocks that slide one block per round from
    the output side toward the input, then roll back to the output side. The head is always in."""
    blocks, lo, hi = _window_bounds(len(names), num_blocks, window_blocks, server_round, schedule)
    return _blocks_mask(names, head, blocks, lo, hi)


def fitted_window_mask(
    names: Sequence[str],
    head: set[str],
    num_blocks: int,
    window_blocks: int,
    server_round: int,
    fits: Callable[[list[bool]], bool],
    schedule: str = "rollback",
) -> list[bool]:
    """The round's window (:func:`window_mask`), widened one whole block at a time, first toward
    the output side and then toward the input side, while training *every* tensor in it still
    fits this device's budget (``fits``). A fixed window starves devices with budget to spare;
    the widened window keeps the slide's input end, so slow devices still reach the front
    layers, as far toward the input as they can train a whole block."""
    blocks, lo, hi = _window_bounds(len(names), num_blocks, window_blocks, server_round, schedule)
    # A device that cannot afford even the window's input-most block whole would spend its round
    # on a tensor or two: slide its window toward the output until it can.
    while lo < len(blocks) - 1 and not fits(_blocks_mask(names, head, blocks, lo, lo + 1)):
        lo, hi = lo + 1, min(hi + 1, len(blocks))
    while True:
        if hi < len(blocks) and fits(_blocks_mask(names, head, blocks, lo, hi + 1)):
            hi += 1
        elif lo > 0 and fits(_blocks_mask(names, head, blocks, lo - 1, hi)):
            lo -= 1
        else:
            return _blocks_mask(names, head, blocks, lo, hi)


def select_in_window(
    ranked: Sequence[float],
    allowed: Sequence[bool],
    t_dw: Sequence[float],
    t_dy: Sequence[float],
    budget: float,
    mode: str = "cover",
) -> list[bool]:
    """The DP's selection once the window is placed.

    ``only`` (FedEL as published): the DP picks inside the window alone, by importance.
    ``cover``: the window is there so that every part of the model gets trained, so the DP first
    trains as many of the window's tensors as fit (importance breaks ties), then spends the budget
    left on the most important tensors anywhere; the backward pass already runs through every
    layer after the window, so those cost only their weight gradients. (The two modes are
    compared in docs/results.md, "The window, measured".)
    """
    if mode == "only":
        return select_tensors([v if a else 0.0 for v, a in zip(ranked, allowed)], t_dw, t_dy, budget)
    # Each window tensor is worth more than all the others together: the DP maximizes how many it trains.
    keep = 1.0 + sum(abs(v) for v in ranked)
    return select_tensors([v + keep if a else max(v, 0.0) for v, a in zip(ranked, allowed)], t_dw, t_dy, budget)


def blend_importance(
    local: Sequence[float], names: Sequence[str], global_imp: Mapping[str, float], beta: float
) -> list[float]:
    """``beta * I_local + (1 - beta) * I_global``, both normalized by their max magnitude."""
    g = normalize([global_imp.get(n, 0.0) for n in names])
    return [beta * l_ + (1.0 - beta) * g_ for l_, g_ in zip(local, g)]


@dataclass(frozen=True)
class Blend:
    """Mix local importance with a global signal (per tensor name) before selecting."""

    global_importance: Mapping[str, float]
    beta: float  # weight of the local signal

    def __call__(self, importance: Sequence[float], names: Sequence[str]) -> list[float]:
        return blend_importance(importance, names, self.global_importance, self.beta)


@dataclass(frozen=True)
class Window:
    """FedEL's sliding window of blocks for one round (see :func:`window_mask`)."""

    server_round: int
    head: frozenset[str]  # the classifier's tensors: always inside the window
    num_blocks: int = 6
    window_blocks: int = 2
    schedule: str = "rollback"  # rollback | pingpong
    mode: str = "cover"  # cover | only (see select_in_window)
    fit: bool = True  # widen the window block by block while training all of it fits

    def allowed(self, names: Sequence[str], costs: Sequence[float], t_dy: Sequence[float], budget: float) -> list[bool]:
        args = (list(names), set(self.head), self.num_blocks, self.window_blocks, self.server_round)
        if not self.fit:
            return window_mask(*args, self.schedule)
        return fitted_window_mask(*args, lambda m: selection_cost(m, costs, t_dy) <= budget, self.schedule)


@dataclass(frozen=True)
class SelectionPolicy:
    """How :meth:`~fleet.engine.trainer.Trainer.reselect` turns importance into a selection."""

    budget_s: float | None = None  # backward seconds per step; None: the profile's budget at the trainer's rho
    extra_costs: Sequence[float] | None = None  # per-tensor seconds added to its weight-gradient time
    blend: Blend | None = None
    window: Window | None = None
    charge_memory: bool = False  # the memory plan's added step time counts against the budget

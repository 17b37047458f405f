"""A device's local work in one round: pick its tensors under its own budget, train, report.

Selection follows ALGORITHMS.md section 5: ``rho_n = min(1, D / T_full,n)`` from
the round deadline ``D`` and the device's own profile, the exact DP under that
budget, optionally led by a sliding window of blocks (with rollback) and
fed importance blended with the server's global signal (FedEL's remedies).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from fleet.data import ArrayDataset, batches
from fleet.device_profile import DeviceProfile
from fleet.importance import evaluate_importance, normalize
from fleet.memory.budgeted import MemoryBudget
from fleet.models import head_parameter_names
from fleet.selection import select_tensors, selection_cost
from fleet.trainer import Trainer, TrainerOptions
from fleet.federated.config import FleetConfig

PROBE_STEPS = 2.0  # an importance probe costs about two full steps (one update, one gradient)


@dataclass
class RoundPlan:
    """What the server asks of a device this round."""

    server_round: int
    strategy: str  # fleet, naive or fedavg
    deadline_s: float  # <= 0: no deadline, train fully
    global_importance: dict[str, float] = field(default_factory=dict)


@dataclass
class RoundResult:
    arrays: dict[str, torch.Tensor]  # only what the device trained (plus its norm statistics)
    metrics: dict[str, float | int]
    state: dict  # device state to keep for the next round


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


def _window_bounds(n: int, num_blocks: int, window_blocks: int, server_round: int, schedule: str = "rollback") -> tuple[list[np.ndarray], int, int]:
    blocks = np.array_split(np.arange(n), min(num_blocks, n))
    b = len(blocks)
    w = min(window_blocks, b)
    hi = b - window_position(server_round, b - w + 1, schedule)
    return blocks, hi - w, hi


def _blocks_mask(names: list[str], head: set[str], blocks: list[np.ndarray], lo: int, hi: int) -> list[bool]:
    inside = set(int(i) for blk in blocks[lo:hi] for i in blk)
    return [i in inside or n in head for i, n in enumerate(names)]


def window_mask(
    names: list[str], head: set[str], num_blocks: int, window_blocks: int, server_round: int, schedule: str = "rollback"
) -> list[bool]:
    """FedEL's window: ``window_blocks`` contiguous blocks that slide one block per round from
    the output side toward the input, then roll back to the output side. The head is always in."""
    blocks, lo, hi = _window_bounds(len(names), num_blocks, window_blocks, server_round, schedule)
    return _blocks_mask(names, head, blocks, lo, hi)


def fitted_window_mask(
    names: list[str], head: set[str], num_blocks: int, window_blocks: int, server_round: int, fits: Callable[[list[bool]], bool],
    schedule: str = "rollback",
) -> list[bool]:
    """The round's window (:func:`window_mask`), widened one whole block at a time, first toward
    the output side and then toward the input side, while training *every* tensor in it still
    fits this device's budget (``fits``). A fixed window starves devices with budget to spare
    (at the input-side positions a 2x device used only a third of its budget); the widened
    window keeps the slide's input end, so slow devices still reach the front layers, as far
    toward the input as they can train a whole block."""
    blocks, lo, hi = _window_bounds(len(names), num_blocks, window_blocks, server_round, schedule)
    # A device that cannot afford to train even the window's input-most block whole would spend
    # its round on a tensor or two (a 4x-slower device trained 0.00% of the weights in every
    # input-side round): slide its window toward the output until it can.
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
    ranked: list[float], allowed: list[bool], t_dw: list[float], t_dy: list[float], budget: float, mode: str = "cover"
) -> list[bool]:
    """The DP's selection once the window is placed.

    ``only`` (FedEL as published): the DP picks inside the window alone, by importance.
    ``cover``: the window is there so that every part of the model gets trained, so the DP first
    trains as many of the window's tensors as fit (importance breaks ties), then spends the budget
    left on the most important tensors anywhere; the backward pass already runs through every
    layer after the window, so those cost only their weight gradients. Measured on the benchmark
    (2 seeds): ``only`` fills an output-side window with a few large tensors and leaves part of
    slow devices' budget idle, and the global model dipped 4-8 points after each roll-back;
    ``cover`` ended 0.3 points higher on the last-3-rounds mean and 1.4 points higher over the
    last 30% of the time. Filling the window by importance instead, then the rest, ended lower
    than both (77.2%).
    """
    if mode == "only":
        return select_tensors([v if a else 0.0 for v, a in zip(ranked, allowed)], t_dw, t_dy, budget)
    # Each window tensor is worth more than all the others together: the DP maximizes how many it trains.
    keep = 1.0 + sum(abs(v) for v in ranked)
    return select_tensors([v + keep if a else max(v, 0.0) for v, a in zip(ranked, allowed)], t_dw, t_dy, budget)


def blend_importance(local: list[float], names: list[str], global_imp: dict[str, float], beta: float) -> list[float]:
    """``beta * I_local + (1 - beta) * I_global``, both normalized by their max magnitude."""
    g = normalize([global_imp.get(n, 0.0) for n in names])
    return [beta * l_ + (1.0 - beta) * g_ for l_, g_ in zip(local, g)]


def device_rho(cfg: FleetConfig, profile: DeviceProfile, deadline_s: float) -> tuple[float, float]:
    """(rho, full-training time of this round's local work) from the deadline and the device's profile."""
    full = cfg.federation.local_steps * profile.full_step_time
    if deadline_s <= 0:
        return 1.0, full
    rho = min(1.0, deadline_s / full)
    floor = min(1.0, profile.min_rho + cfg.federation.min_rho_margin)  # the Trainer refuses rho below the floor
    return max(rho, floor), full


def step_budget(cfg: FleetConfig, profile: DeviceProfile, round_budget_s: float) -> float:
    """Backward seconds per local step when the round's local work may take ``round_budget_s``
    (the deadline minus what the device must spend anyway: an importance probe, norm statistics'
    upload). Never below the device's floor (forward pass plus ``min_rho_margin`` of a full step)."""
    per_step = round_budget_s / cfg.federation.local_steps - profile.forward_time
    floor = min(1.0, profile.min_rho + cfg.federation.min_rho_margin) * profile.full_step_time - profile.forward_time
    return max(per_step, floor)


def tensor_upload_s(cfg: FleetConfig, params: list[torch.Tensor]) -> list[float]:
    """Seconds to upload each trainable tensor over the device's uplink."""
    return [p.numel() * p.element_size() / cfg.federation.bandwidth_bytes_per_s for p in params]


def float_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Norm running statistics: every forward pass in training mode updates them, trained or not."""
    return {n: b for n, b in model.named_buffers() if b.is_floating_point()}


def drop_stale_momentum(optimizer: torch.optim.Optimizer, names: list[str], params: list[torch.Tensor], trained: list[str] | None) -> None:
    """Forget the optimizer state of tensors this device did not train in its previous round.

    Momentum is kept between rounds, but a tensor that sat out (outside the sliding window, or not
    selected) has a buffer built on an older global model, worth several steps in a stale
    direction: left in place it kicks the tensor on the first step after it rejoins. Tensors
    trained last round keep their momentum, so full training (FedAvg) is unaffected.
    """
    if trained is None:
        return  # no record of the last round: keep everything
    keep = set(trained)
    for n, p in zip(names, params):
        if n not in keep:
            optimizer.state.pop(p, None)


def memory_added_s(memory: MemoryBudget | None, model: nn.Module, profile: DeviceProfile) -> float:
    """Seconds the memory plan for the current selection adds to one step on this device (its tier)."""
    return 0.0 if memory is None else memory.added_time_s(model) * profile.speed_factor


def local_round(
    cfg: FleetConfig,
    model: nn.Module,
    profile: DeviceProfile,
    train: ArrayDataset,
    prev_state: dict | None,
    plan: RoundPlan,
    partition_id: int,
    memory: MemoryBudget | None = None,
) -> RoundResult:
    """Train ``model`` (already holding the global weights) for ``federation.local_steps`` batches.

    With ``memory``, every step (and the importance probe) follows a keep/recompute/page
    plan for the device's activation budget, and the time the plan adds counts against
    the deadline: when it would overrun, the selection is made again with that much less.
    """
    fed = cfg.federation
    t = cfg.train
    full_time = fed.local_steps * profile.full_step_time
    options = TrainerOptions(
        method="full",
        lr=t.lr,
        momentum=t.momentum,
        weight_decay=t.weight_decay,
        rho=1.0,
        batch_size=t.batch_size,
        input_size=cfg.data.input_size,
        seed=t.seed + 1000 * plan.server_round + partition_id,
    )
    trainer = Trainer(model, options, profile, memory)
    prev_state = prev_state or {}
    if "optimizer" in prev_state:
        try:
            trainer.optimizer.load_state_dict(prev_state["optimizer"])
        except (ValueError, KeyError, RuntimeError):
            pass  # another model layout: start with fresh momentum
    names = trainer.names
    drop_stale_momentum(trainer.optimizer, names, trainer.params, prev_state.get("trained"))
    started = time.perf_counter()
    probe_cost = 0.0
    importance: list[float] = list(prev_state.get("importance", []))
    imp_round = int(prev_state.get("importance_round", -10**9))
    deadline = plan.deadline_s if plan.strategy != "fedavg" else 0.0
    upload_s = tensor_upload_s(cfg, trainer.params)
    buffers_s = sum(b.numel() * b.element_size() for b in float_buffers(model).values()) / fed.bandwidth_bytes_per_s
    if not fed.deadline_includes_upload:
        upload_s, buffers_s = [0.0] * len(names), 0.0
    if deadline <= 0 or deadline >= (full_time + sum(upload_s) + buffers_s) * (1 - 1e-9):
        mask = [True] * len(names)
    else:
        if len(importance) != len(names) or plan.server_round - imp_round >= fed.importance_interval:
            x, y = trainer.probe_batch(train)
            importance = evaluate_importance(model, trainer.params, trainer.optimizer, x, y, step_context=trainer.step_context)
            imp_round = plan.server_round
            probe_cost = PROBE_STEPS * (profile.full_step_time + memory_added_s(memory, model, profile))
        ranked = importance
        if plan.strategy == "fleet" and fed.blend_beta is not None and plan.global_importance:
            ranked = blend_importance(importance, names, plan.global_importance, fed.blend_beta)
        budget = step_budget(cfg, profile, deadline - probe_cost - buffers_s)
        costs = [dw + u / fed.local_steps for dw, u in zip(profile.t_dw, upload_s)]  # a tensor's upload, spread over the steps
        allowed = None
        if plan.strategy == "fleet" and fed.window:
            head = set(head_parameter_names(model))
            if fed.window_fit:
                allowed = fitted_window_mask(names, head, fed.num_blocks, fed.window_blocks, plan.server_round,
                                             lambda m: selection_cost(m, costs, profile.t_dy) <= budget, fed.window_schedule)
            else:
                allowed = window_mask(names, head, fed.num_blocks, fed.window_blocks, plan.server_round, fed.window_schedule)

        def choose(b: float) -> list[bool]:
            if allowed is None:
                return select_tensors(ranked, costs, profile.t_dy, b)
            return select_in_window(ranked, allowed, costs, profile.t_dy, b, fed.window_mode)

        mask = choose(budget)
        if memory is not None:
            trainer.set_mask(mask)
            added = memory_added_s(memory, model, profile)
            if added > 0 and selection_cost(mask, costs, profile.t_dy) + added > budget:
                mask = choose(max(budget - added, 0.0))
    rho = profile.step_time(mask) / profile.full_step_time
    trainer.set_mask(mask)
    added_s = memory_added_s(memory, model, profile)  # raises BudgetError (one line) if no plan fits

    losses: list[float] = []
    steps = fed.local_steps if any(mask) else 0
    endless = (
        xy
        for _ in itertools.count()  # re-shuffled on every pass over the local data
        for xy in batches(train, t.batch_size, shuffle=True, generator=trainer.generator, input_size=cfg.data.input_size)
    )
    for x, y in itertools.islice(endless, steps):
        losses.append(trainer.train_step(x, y))
    measured = time.perf_counter() - started
    predicted = steps * (profile.step_time(mask) + added_s) + probe_cost

    params = dict(zip(names, trainer.params))
    arrays = {n: params[n].detach().clone() for n, m in zip(names, mask) if m}
    if steps:
        arrays.update({n: b.detach().clone() for n, b in float_buffers(model).items()})
    upload = sum(a.numel() * a.element_size() for a in arrays.values())
    metrics: dict[str, float | int] = {
        "partition-id": partition_id,
        "tier": profile.speed_factor,
        "num-examples": len(train),
        "selected": int(sum(mask)),
        "num-tensors": len(names),
        "trained-fraction": float(sum(p.numel() for p, m in zip(trainer.params, mask) if m) / sum(p.numel() for p in trainer.params)),
        "rho": rho,
        "predicted-time-s": predicted,
        "measured-time-s": measured,
        "full-time-s": full_time,
        "speedup": full_time / predicted if predicted > 0 else 0.0,
        "bytes-uploaded": int(upload),
        "loss": float(np.mean(losses)) if losses else float("nan"),
        "steps": steps,
    }
    if memory is not None:
        metrics.update({
            "memory-budget-bytes": memory.budget_bytes,
            "memory-peak-bytes": memory.peak_bytes,
            "memory-added-s": added_s,
        })
    state = {
        "round": plan.server_round,
        "optimizer": trainer.optimizer.state_dict(),
        "personal": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "importance": [float(v) for v in importance],
        "importance_round": imp_round,
        "trained": [n for n, m in zip(names, mask) if m] if steps else [],
    }
    return RoundResult(arrays, metrics, state)

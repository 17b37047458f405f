"""Choose keep / recompute / page per block under a memory budget (POET-style).

Pure functions over a :class:`~fleet.memory.records.MemoryProfile`; nothing here
touches a model, and errors name quantities, not command-line flags: a caller
that knows how the user set the budget re-raises :class:`InfeasibleBudgetError`
and :class:`BudgetValueError` under its own setting's name (``.named(...)``).
The problem is POET's (docs/algorithms.md section 6), restricted to a chain
of blocks, where an exact dynamic program replaces POET's integer program.

Memory model
------------
The model is a chain of blocks 0..n-1 run forward in order and backward in
reverse. Each storage autograd saves is an *item* with its bytes, the blocks
that save it (``savers``) and the blocks whose input it is (``inputs_of``);
items only ever involve one block or two neighbours. A block's action:

* ``keep``: its saved storages stay in memory until its backward.
* ``recompute``: ``torch.utils.checkpoint`` keeps only the block's input; the
  backward of the block re-runs its forward and so re-creates everything it
  saves (except the input) at once.
* ``page``: its saved storages go to spill files (storages smaller than the
  profile's ``page_min_bytes`` stay in memory) and come back for its
  backward.
* ``frozen``: below ``frozen_below`` (the input-most block holding a
  trainable tensor) nothing is stored at all.

An item is *held* from the forward pass until the end of the backward of its
lowest holder, where a holder is a saver that keeps it (or pages it while it
is below ``page_min_bytes``) or a recomputed block whose input it is. The
activation memory while block k runs its backward is

    B_k = pinned + sum(items held by a holder <= k)
                 + sum(items block k saves that are not held then: its
                   recomputed or paged-in copies, all of them at once)
                 + prefetch_k

where ``pinned`` is what is saved outside every block (loss, glue ops), and
``prefetch_k`` is the bytes block k-1 pages if it is paged with ``overlap``:
those are read back during block k's backward. At the end of block k's
forward the step holds

    F_k = pinned + sum(items held, created so far)
                 + sum(items block k creates)
                 + sum(paged items the calling code still references)
                 + pending_k

The third term is there because a paged storage is freed only when nothing
else references it: the input of an ``nn.Sequential`` stays referenced by its
caller until the whole Sequential returns (the profile measures, per item,
``alive_until``). ``pending_k`` are block k-1's background writes with
``overlap`` (the executor makes block k+1 wait for them). The plan's peak is
``max_k max(B_k, F_k)``. Transient tensors (gradients in flight, a kernel's
workspace) are not activations and are not counted; the executor measures
the same quantity (:mod:`fleet.memory.meter`).

Costs: recomputing block k costs what the profile measured (its extra
backward time when checkpointed, at least its forward time); paging an item costs
``latency + bytes / throughput`` to write and, if its original is gone when
needed, to read (the profile's storage costs, fitted to the pager's own
writes and reads during real steps).
No credit is taken for overlapping I/O with compute, so the added time is an
upper estimate. With ``objective="energy"`` the cost is
``compute_watts * recompute_s + storage_watts * io_s``.

Solver
------
B_k and F_k are a prefix sum over blocks < k plus terms that depend only on
the actions of blocks k-1 and k, and on the few paged items still
referenced from earlier blocks. So an exact dynamic program runs over the
chain with state (previous action, such lingering items) and keeps, per
state, the Pareto front of (bytes held so far, cost). It is exact (no
rounding), and the state stays small: one action and a few items. The same
program with "peak so far" as the objective gives the smallest feasible
budget, which an infeasible budget's :class:`InfeasibleBudgetError` reports. After the
solve, with ``overlap=True`` each paged block is given background writes and
a prefetch during the backward of the block above wherever the extra bytes
still fit the budget. It is off by default: on a machine whose cores are all
busy computing, the I/O thread only competes with them.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields

from fleet.base.errors import BudgetError, ConfigError, ProfileMismatchError
from fleet.memory.records import MemoryProfile, StorageProfile

KEEP, RECOMPUTE, PAGE, FROZEN = "keep", "recompute", "page", "frozen"
ACTIONS = (KEEP, RECOMPUTE, PAGE, FROZEN)
OBJECTIVES = ("time", "energy")
MB = 1_000_000  # budgets in MB are 10**6 bytes


@dataclass
class MemoryPlan:
    """What to do with each block's activations; a few hundred bytes as JSON."""

    model: str
    input_shape: list[int]
    blocks: list[str]
    actions: list[str]
    overlap: list[bool]  # paged blocks that write in the background and are prefetched
    budget_bytes: int
    objective: str
    frozen_below: int
    predicted_peak_bytes: int
    unconstrained_peak_bytes: int  # full training, nothing planned
    block_peaks: list[int] = field(default_factory=list)  # predicted B_k
    added_time_s: float = 0.0
    added_energy_j: float | None = None
    solve_time_s: float = 0.0
    page_min_bytes: int = 0

    def count(self, action: str) -> int:
        return sum(a == action for a in self.actions)

    def summary(self) -> dict:
        return {a: self.count(a) for a in ACTIONS if self.count(a)}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> MemoryPlan:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ProfileMismatchError(f"memory plan: unknown field {unknown[0]!r}; re-plan with this fleet version")
        plan = cls(**d)
        bad = [a for a in plan.actions if a not in ACTIONS]
        if bad or len(plan.actions) != len(plan.blocks):
            raise ProfileMismatchError(
                f"memory plan: actions {bad or plan.actions} do not fit {len(plan.blocks)} blocks; re-plan"
            )
        return plan


# --- the item model -------------------------------------------------------------
@dataclass(frozen=True)
class _Item:
    bytes: int
    savers: tuple[int, ...]
    inputs_of: tuple[int, ...]
    small: bool
    alive_until: int

    @property
    def span(self) -> tuple[int, int]:
        rel = self.savers + self.inputs_of
        return min(rel), max(rel)


def _items(profile: MemoryProfile, frozen_below: int) -> list[_Item]:
    out = []
    for it in profile.items:
        sv = tuple(j for j in it.savers if j >= frozen_below)
        ins = tuple(j for j in it.inputs_of if j >= frozen_below and profile.blocks[j].can_recompute)
        if sv or ins:
            until = max([it.alive_until] + list(sv) + list(ins))
            out.append(_Item(int(it.bytes), sv, ins, it.bytes < profile.page_min_bytes, until))
    return out


def _holders(item: _Item, acts: dict) -> list[int]:
    h = [j for j in item.savers if acts.get(j) == KEEP or (acts.get(j) == PAGE and item.small)]
    h += [j for j in item.inputs_of if acts.get(j) == RECOMPUTE]
    return h


def _bytes_at(item: _Item, k: int, acts: dict) -> int:
    """Bytes of ``item`` in memory while block k runs its backward."""
    h = _holders(item, acts)
    if h and min(h) <= k:
        return item.bytes
    if k in item.savers and acts.get(k) in (RECOMPUTE, PAGE):
        return item.bytes  # recomputed or paged-in copy
    return 0


def _fwd_bytes(item: _Item, k: int, acts: dict) -> int:
    """Bytes of ``item`` the meter counts at the end of block k's forward."""
    lo, _ = item.span
    if lo > k:
        return 0
    if lo == k or _holders(item, acts):
        return item.bytes  # being created, or held until backward
    return item.bytes if _lingers(item, k, acts) else 0


def _lingers(item: _Item, k: int, acts: dict) -> bool:
    """A paged item the calling code still references during block k's forward."""
    return not item.small and item.alive_until >= k and any(acts.get(j) == PAGE for j in item.savers if j <= k)


def _io_s(item: _Item, acts: dict, storage: StorageProfile | None) -> float:
    pagers = [j for j in item.savers if acts.get(j) == PAGE]
    if not pagers or item.small or storage is None:
        return 0.0
    t = storage.write_time(item.bytes)
    h = _holders(item, acts)
    if any(not (h and min(h) <= j) for j in pagers):
        t += storage.read_time(item.bytes)
    return t


def _recompute_s(block) -> float:
    return max(block.recompute_s, block.forward_s)


def _page_bytes(items: Iterable[_Item], k: int) -> int:
    return sum(i.bytes for i in items if k in i.savers and not i.small)


def _check_actions(profile: MemoryProfile, actions: list[str], frozen_below: int) -> None:
    if len(actions) != len(profile.blocks):
        raise ConfigError(f"actions: got {len(actions)} for {len(profile.blocks)} blocks; give one per block")
    for k, a in enumerate(actions):
        if (k < frozen_below) != (a == FROZEN) or a not in ACTIONS:
            raise ConfigError(
                f"actions[{k}]: {a!r} for block {profile.blocks[k].name!r}; blocks below frozen_below are "
                "'frozen', others keep/recompute/page"
            )
        if a == RECOMPUTE and not profile.blocks[k].can_recompute:
            raise ConfigError(
                f"actions[{k}]: block {profile.blocks[k].name!r} cannot be recomputed ({profile.blocks[k].note})"
            )


def evaluate_plan(
    profile: MemoryProfile,
    actions: list[str],
    *,
    overlap: list[bool] | None = None,
    frozen_below: int = 0,
    storage: StorageProfile | None = None,
) -> dict:
    """Predicted ``block_peaks`` (B_k), ``forward_peaks`` (F_k), ``peak_bytes``, ``recompute_s``
    and ``io_s`` of any action list."""
    _check_actions(profile, actions, frozen_below)
    storage = storage if storage is not None else profile.storage
    items = _items(profile, frozen_below)
    acts = dict(enumerate(actions))
    overlap = overlap or [False] * len(actions)
    peaks, fwd = [], []
    for k in range(len(actions)):
        b = profile.pinned_bytes + sum(_bytes_at(i, k, acts) for i in items)
        f = profile.pinned_bytes + sum(_fwd_bytes(i, k, acts) for i in items)
        if k > 0 and actions[k - 1] == PAGE and overlap[k - 1]:
            b += _page_bytes(items, k - 1)
            f += _page_bytes(items, k - 1)
        peaks.append(b if k >= frozen_below else profile.pinned_bytes)
        fwd.append(f if k >= frozen_below else profile.pinned_bytes)
    return {
        "block_peaks": peaks,
        "forward_peaks": fwd,
        "peak_bytes": max(peaks + fwd + [profile.pinned_bytes]),
        "recompute_s": sum(_recompute_s(profile.blocks[k]) for k, a in enumerate(actions) if a == RECOMPUTE),
        "io_s": sum(_io_s(i, acts, storage) for i in items),
    }


# --- the exact DP -------------------------------------------------------------------
def _tables(profile, items, frozen_below, storage, weights):
    """Per block k and (previous action, action): bytes at B_k and F_k, bytes held on,
    cost, and paged items the caller keeps referencing after block k (until, bytes)."""
    n = len(profile.blocks)
    by_hi, by_lo, spans = defaultdict(list), defaultdict(list), defaultdict(list)
    for i in items:
        lo, hi = i.span
        by_hi[hi].append(i)
        by_lo[lo].append(i)
        if hi == lo + 1:
            spans[lo].append(i)
    allowed = []
    for k, blk in enumerate(profile.blocks):
        if k < frozen_below:
            allowed.append((FROZEN,))
        else:
            acts = [KEEP]
            if blk.can_recompute:
                acts.append(RECOMPUTE)
            if storage is not None:
                acts.append(PAGE)
            allowed.append(tuple(acts))
    w_rec, w_io = weights
    tables = []
    for k in range(n):
        prevs = allowed[k - 1] if k > 0 else (None,)
        created = sum(i.bytes for i in by_lo[k])
        tab = {}
        for p in prevs:
            for a in allowed[k]:
                acts = {k - 1: p, k: a}
                at_b = sum(_bytes_at(i, k, acts) for i in by_hi[k])
                at_b += sum(_bytes_at(i, k, {k: a}) for i in spans[k])
                at_f = created + sum(_fwd_bytes(i, k, acts) for i in spans.get(k - 1, ()))
                held = sum(i.bytes for i in by_hi[k] if _holders(i, acts))
                rec = _recompute_s(profile.blocks[k]) if a == RECOMPUTE else 0.0
                io = sum(_io_s(i, acts, storage) for i in by_hi[k])
                later = tuple(
                    (i.alive_until, i.bytes) for i in by_hi[k] if not _holders(i, acts) and _lingers(i, k + 1, acts)
                )
                tab[(p, a)] = (at_b, at_f, held, w_rec * rec + w_io * io, later)
        tables.append(tab)
    return allowed, tables


def _solve(profile, allowed, tables, budget: float, minimize_peak: bool):
    """Exact DP; returns (actions, objective) or None when nothing fits ``budget``.

    State: (action of the previous block, paged items the caller still references
    later); per state a Pareto front of (bytes held so far, objective).
    """
    base = profile.pinned_bytes
    fronts: dict = {(None, ()): [(0, 0.0, 0, None)]}  # -> [(held, objective, peak, path)]
    for k in range(len(allowed)):
        grown = defaultdict(list)
        for (p, extras), labels in fronts.items():
            carried = sum(b for until, b in extras if until >= k)
            for a in allowed[k]:
                at_b, at_f, held, cost, later = tables[k][(p, a)]
                key = (a, tuple(sorted(e for e in extras + later if e[0] > k)))
                for pm, obj, peak, path in labels:  # sorted by pm
                    b = base + pm + max(at_b, at_f + carried)
                    if b > budget:
                        break
                    new_peak = max(peak, b)
                    grown[key].append((pm + held, new_peak if minimize_peak else obj + cost, new_peak, (path, a)))
        fronts = {}
        for key, labels in grown.items():
            labels.sort(key=lambda lab: (lab[0], lab[1], lab[2]))
            kept, best = [], math.inf
            for lab in labels:
                if lab[1] < best:
                    kept.append(lab)
                    best = lab[1]
            fronts[key] = kept
        if not fronts:
            return None
    best = min((lab for labels in fronts.values() for lab in labels), key=lambda lab: (lab[1], lab[2]))
    actions, path = [], best[3]
    while path is not None:
        path, a = path
        actions.append(a)
    return actions[::-1], best[1]


def _weights(objective, profile, storage, compute_watts, storage_watts):
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective: got {objective!r}; use 'time' or 'energy'")
    cw = compute_watts if compute_watts is not None else profile.compute_watts
    sw = storage_watts if storage_watts is not None else (storage.storage_watts if storage else None)
    if objective == "energy" and (cw is None or (storage is not None and sw is None)):
        raise ConfigError(
            "objective: 'energy' needs power figures; pass compute_watts and storage_watts (W) or use objective 'time'"
        )
    return (1.0, 1.0) if objective == "time" else (cw, sw or 0.0), cw, sw


def _frozen(profile: MemoryProfile, frozen_below: int | None) -> int:
    fb = 0 if frozen_below is None else frozen_below
    if isinstance(fb, bool) or not isinstance(fb, int) or not 0 <= fb <= len(profile.blocks):
        raise ConfigError(f"frozen_below: got {frozen_below!r}; use a block index from 0 to {len(profile.blocks)}")
    return fb


def min_feasible_budget(
    profile: MemoryProfile, *, frozen_below: int | None = None, storage: StorageProfile | None = None
) -> int:
    """Smallest peak any plan reaches (bytes)."""
    fb = _frozen(profile, frozen_below)
    storage = storage if storage is not None else profile.storage
    items = _items(profile, fb)
    allowed, tables = _tables(profile, items, fb, storage, (1.0, 1.0))
    return int(_solve(profile, allowed, tables, math.inf, True)[1])


# --- budgets and their errors ------------------------------------------------------------
def _mb(nbytes: float) -> str:
    mb = nbytes / MB
    return f"{mb:.1f}" if mb >= 1 or mb == 0 else f"{mb:.2g}"


_BUDGET_AMOUNTS = {"budget_mb": ("number of MB", "20"), "budget_fraction": ("fraction", "0.5")}


class BudgetValueError(ConfigError):
    """``budget_mb`` or ``budget_fraction`` is not a positive number.

    ``field`` is the parameter; :meth:`named` gives the same error with the
    example written as the caller's own setting (``e.g. --budget-mb 20``)."""

    def __init__(self, field: str, value: object, setting: str | None = None) -> None:
        self.field, self.value, self.setting = field, value, setting
        what, example = _BUDGET_AMOUNTS[field]
        shown = f"{setting} {example}" if setting else example
        super().__init__(f"{field}: got {value!r}; use a positive {what}, e.g. {shown}")

    def named(self, setting: str) -> BudgetValueError:
        return BudgetValueError(self.field, self.value, setting)

    def __reduce__(self):
        return type(self), (self.field, self.value, self.setting)


class InfeasibleBudgetError(BudgetError):
    """No plan fits the budget; the message names the smallest feasible one.

    :meth:`named` gives the same error with the suggestion written as the
    caller's settings: ``setting`` takes MB, ``fraction_setting`` a fraction of
    the unconstrained peak (``--budget-mb 5.2, or --budget-fraction 0.43``)."""

    def __init__(
        self,
        budget_bytes: float,
        need_bytes: float,
        unconstrained_bytes: float,
        subject: str,
        setting: str | None = None,
        fraction_setting: str | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.need_bytes = need_bytes
        self.unconstrained_bytes = unconstrained_bytes
        self.subject = subject  # what was planned, e.g. "resnet18 at batch 32"
        self.setting = setting
        self.fraction_setting = fraction_setting
        super().__init__(self._message())

    @property
    def need_mb(self) -> float:
        """The smallest feasible budget in MB, rounded up to 0.1 MB so it works as given."""
        return math.ceil(self.need_bytes / (MB / 10)) / 10

    @property
    def need_fraction(self) -> float:
        """The same as a fraction of the unconstrained peak, rounded up to 0.01."""
        return math.ceil(self.need_bytes / self.unconstrained_bytes * 100) / 100

    def named(self, setting: str | None = None, fraction_setting: str | None = None) -> InfeasibleBudgetError:
        return InfeasibleBudgetError(
            self.budget_bytes, self.need_bytes, self.unconstrained_bytes, self.subject, setting, fraction_setting
        )

    def __reduce__(self):
        args = (self.budget_bytes, self.need_bytes, self.unconstrained_bytes, self.subject)
        return type(self), args + (self.setting, self.fraction_setting)

    def _message(self) -> str:
        suggestion = f"{self.need_fraction:.2f}"
        if self.fraction_setting:
            suggestion = f"{self.fraction_setting} {suggestion}"
        if self.setting:
            suggestion = f"{self.setting} {self.need_mb:.1f}, " + ("or " if self.fraction_setting else "") + suggestion
        return (
            f"memory budget {_mb(self.budget_bytes)} MB is infeasible for {self.subject}; "
            f"the smallest feasible budget is {self.need_mb:.1f} MB "
            f"({suggestion} of the unconstrained {self.unconstrained_bytes / MB:.1f} MB)"
        )


def resolve_budget(
    profile: MemoryProfile, *, budget_mb: float | None = None, budget_fraction: float | None = None
) -> int:
    """Budget in bytes from MB (10**6 bytes) or a fraction of the unconstrained peak.

    Raises :class:`BudgetValueError` for an amount that is not a positive number."""
    if (budget_mb is None) == (budget_fraction is None):
        raise ConfigError("budget: give exactly one of budget_mb (MB) or budget_fraction (of the unconstrained peak)")
    if budget_mb is not None:
        if not (isinstance(budget_mb, (int, float)) and math.isfinite(budget_mb) and budget_mb > 0):
            raise BudgetValueError("budget_mb", budget_mb)
        return int(budget_mb * MB)
    if not (isinstance(budget_fraction, (int, float)) and math.isfinite(budget_fraction) and budget_fraction > 0):
        raise BudgetValueError("budget_fraction", budget_fraction)
    return int(budget_fraction * profile.unconstrained_peak_bytes)


# --- planning ------------------------------------------------------------------------------
def _infeasible(profile: MemoryProfile, allowed, tables, budget_bytes: float, fb: int) -> InfeasibleBudgetError:
    need = _solve(profile, allowed, tables, math.inf, True)[1]
    frozen = f" with blocks below {profile.blocks[fb].name!r} frozen" if 0 < fb < len(profile.blocks) else ""
    return InfeasibleBudgetError(budget_bytes, need, profile.unconstrained_peak_bytes, profile.describe() + frozen)


def _overlap_flags(profile, actions, items, fb, storage, budget_bytes) -> list[bool]:
    """Paged blocks whose background writes and prefetch still fit the budget."""
    base = evaluate_plan(profile, actions, frozen_below=fb, storage=storage)
    flags = [False] * len(actions)
    for k, a in enumerate(actions):
        if a != PAGE:
            continue
        after = max(base["block_peaks"][k + 1], base["forward_peaks"][k + 1]) if k + 1 < len(actions) else 0
        if k == len(actions) - 1 or after + _page_bytes(items, k) <= budget_bytes:
            flags[k] = True
    return flags


def plan_memory(
    profile: MemoryProfile,
    budget_bytes: int,
    *,
    objective: str = "time",
    frozen_below: int | None = None,
    storage: StorageProfile | None = None,
    compute_watts: float | None = None,
    storage_watts: float | None = None,
    overlap: bool = False,
) -> MemoryPlan:
    """Cheapest plan whose predicted activation peak is at most ``budget_bytes``.

    ``frozen_below``: chain index of the input-most block with a trainable
    tensor (elastic selection); blocks below it store nothing. ``storage``
    defaults to ``profile.storage``; without one, paging is not considered.
    ``overlap``: let paged blocks write in the background and prefetch where
    the extra bytes fit (worth it only with a core to spare for the I/O).
    Raises :class:`InfeasibleBudgetError` naming the smallest feasible budget.
    """
    start = time.perf_counter()
    fb = _frozen(profile, frozen_below)
    storage = storage if storage is not None else profile.storage
    weights, cw, sw = _weights(objective, profile, storage, compute_watts, storage_watts)
    if not (isinstance(budget_bytes, (int, float)) and budget_bytes > 0):
        raise ConfigError(f"budget_bytes: got {budget_bytes!r}; use a positive number of bytes")
    items = _items(profile, fb)
    allowed, tables = _tables(profile, items, fb, storage, weights)
    solved = _solve(profile, allowed, tables, budget_bytes, False)
    if solved is None:
        raise _infeasible(profile, allowed, tables, budget_bytes, fb)
    actions = solved[0]
    flags = _overlap_flags(profile, actions, items, fb, storage, budget_bytes) if overlap else [False] * len(actions)
    final = evaluate_plan(profile, actions, overlap=flags, frozen_below=fb, storage=storage)
    energy = None
    if cw is not None and (sw is not None or final["io_s"] == 0):
        energy = cw * final["recompute_s"] + (sw or 0.0) * final["io_s"]
    return MemoryPlan(
        model=profile.model,
        input_shape=list(profile.input_shape),
        blocks=[b.name for b in profile.blocks],
        actions=actions,
        overlap=flags,
        budget_bytes=int(budget_bytes),
        objective=objective,
        frozen_below=fb,
        predicted_peak_bytes=int(final["peak_bytes"]),
        unconstrained_peak_bytes=int(profile.unconstrained_peak_bytes),
        block_peaks=[int(b) for b in final["block_peaks"]],
        added_time_s=final["recompute_s"] + final["io_s"],
        added_energy_j=energy,
        solve_time_s=time.perf_counter() - start,
        page_min_bytes=profile.page_min_bytes,
    )

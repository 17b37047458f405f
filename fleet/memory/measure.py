"""Measure a model's memory profile: what each block saves, and what recomputing
or paging it costs.

:func:`measure_block_costs` runs real training steps (forward, cross-entropy,
backward) of the model at one input shape and records, per block of the
chain (:mod:`fleet.memory.segment`):

* every storage autograd saves for backward, with the blocks that save it
  (``savers``) and the blocks whose input it is (``inputs_of``; a recomputed
  block's checkpoint keeps its input). Parameters, buffers and the model
  input are not activations and are left out, and so are tensors the loss
  saves that did not come out of the graph (its targets). Storages saved outside every
  block (the loss, functional glue such as ``flatten``) or shared by blocks
  that are not neighbours are ``pinned``: always held.
* how long each block's input stays referenced by the calling code during
  the forward pass (a paged input cannot be freed before that);
* forward and backward time, and what recomputing the block really costs:
  the extra backward time of the block when it is checkpointed (steps with
  every block checkpointed alternate with plain ones), never less than its
  forward time; medians over repeats;
* whether it may be recomputed (a block that modifies its input in place,
  such as ``ReLU(inplace=True)``, may not: its checkpointed input would be
  stale);
* the activation peak of an unplanned step, measured by
  :class:`~fleet.memory.meter.StorageMeter`;
* with a storage profile, steps that page every block alternate with the
  plain ones, and the profile's storage costs become those of the pager's own
  I/O during them (:func:`fleet.memory.storage.in_step_storage`).
"""

from __future__ import annotations

import platform
import statistics
import time
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fleet.base.errors import ConfigError, ModelError
from fleet.base.hooks import first_tensor, no_grad_forward
from fleet.memory.executor import PlanRunner, apply_plan, model_device
from fleet.memory.meter import is_caller_data, module_storage_keys, storage_key
from fleet.memory.planner import KEEP, PAGE, RECOMPUTE, MemoryPlan
from fleet.memory.records import BlockCost, MemoryProfile, SavedItem, StorageProfile
from fleet.memory.segment import segment_model
from fleet.memory.spill import DEFAULT_MIN_BYTES
from fleet.memory.storage import in_step_storage


class _ModelState:
    """Training mode, requires_grad flags, buffers and grads, restored after profiling."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.training = model.training
        self.flags = [(p, p.requires_grad, p.grad) for p in model.parameters()]
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]

    def restore(self) -> None:
        self.model.train(self.training)
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        for p, flag, grad in self.flags:
            p.requires_grad_(flag)
            p.grad = grad


def _module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name) if name else model


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()


def _chain_error(model_name: str, detail: str) -> ModelError:
    return ModelError(
        f"model {model_name}: {detail}; memory planning needs a chain of blocks that each run once "
        "(resnet*, mobilenet*, efficientnet*, vgg*)"
    )


# --- who saves what -----------------------------------------------------------------
class _Recorder:
    """Hooks for one recorded step: the blocks' call order, their inputs, which
    blocks modify their input in place, and which block saves which storage."""

    def __init__(self, model: nn.Module, names: list[str], model_name: str) -> None:
        self.model = model
        self.names = names
        self.model_name = model_name
        self.modules = [_module(model, n) for n in names]
        self.excluded = module_storage_keys(model)  # parameters, buffers and (when seen) the model input
        self.current: int | None = None  # block whose forward is running
        self.outside = True  # not inside the model's forward (the loss, say)
        self.calls: list[int] = []
        self.in_key: dict[int, int] = {}
        self.in_bytes: dict[int, int] = {}
        self.versions: dict[int, int] = {}
        self.inplace: set[int] = set()
        self.savers: dict[int, set] = {}
        self.sizes: dict[int, int] = {}
        self.keep: list[torch.Tensor] = []  # everything seen, so no address is reused during the step

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        model = self.model
        handles = [model.register_forward_pre_hook(self._root_pre), model.register_forward_hook(self._root_post)]
        for i, m in enumerate(self.modules):
            handles.append(m.register_forward_pre_hook(self._block_pre(i)))
            handles.append(m.register_forward_hook(self._block_post(i)))
        try:
            model.zero_grad(set_to_none=True)
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
        finally:
            for h in handles:
                h.remove()

    def _root_pre(self, _m, args) -> None:
        self.outside = False
        for a in args if isinstance(args, tuple) else (args,):
            if isinstance(a, torch.Tensor):
                self.excluded.add(storage_key(a))

    def _root_post(self, _m, _args, _out) -> None:
        self.outside = True

    def _block_pre(self, i: int):
        def pre(_m, args):
            if self.current is not None:
                raise _chain_error(
                    self.model_name, f"block {self.names[i]!r} runs inside block {self.names[self.current]!r}"
                )
            self.current = i
            self.calls.append(i)
            t = first_tensor(args)
            if t is not None:
                self.keep.append(t)
                self.in_key[i] = storage_key(t)
                self.in_bytes[i] = t.untyped_storage().nbytes()
                self.versions[i] = t._version

        return pre

    def _block_post(self, i: int):
        def post(_m, args, out):
            t = first_tensor(args)
            if t is not None and t._version != self.versions.get(i):
                self.inplace.add(i)
            self.keep.append(out)
            self.current = None

        return post

    def _pack(self, t: torch.Tensor):
        key = storage_key(t)
        if key in self.excluded or t.untyped_storage().nbytes() == 0 or (self.outside and is_caller_data(t)):
            return t
        self.keep.append(t)
        self.savers.setdefault(key, set()).add(self.current)
        self.sizes[key] = t.untyped_storage().nbytes()
        return t

    def chain_order(self) -> list[int]:
        """Chain position -> block index, in call order (each block must run once)."""
        for i, name in enumerate(self.names):
            n = self.calls.count(i)
            if n > 1:
                raise _chain_error(self.model_name, f"block {name!r} runs {n} times in one forward pass")
        return list(dict.fromkeys(self.calls))

    def saved_items(self, order: list[int], input_until: dict[int, int]) -> tuple[list[SavedItem], int]:
        """The storages held for backward, by chain position, and the bytes pinned whatever the plan."""
        pos = {b: p for p, b in enumerate(order)}
        input_keys: dict[int, set[int]] = {}
        for b, key in self.in_key.items():
            if b in pos and key not in self.excluded:
                input_keys.setdefault(key, set()).add(pos[b])
        items: list[SavedItem] = []
        pinned = 0
        for key in list(self.sizes) + [k for k in input_keys if k not in self.sizes]:
            who = self.savers.get(key, set())
            nbytes = self.sizes.get(key) or max(self.in_bytes[order[p]] for p in input_keys[key])
            if None in who:  # saved outside every block: glue or loss
                pinned += nbytes
                continue
            sv = sorted(pos[b] for b in who)
            ins = sorted(input_keys.get(key, set()))
            rel = set(sv) | set(ins)
            if max(rel) - min(rel) > 1:  # shared by blocks that are not neighbours
                pinned += nbytes
                continue
            if not sv and not ins:
                continue
            until = max([input_until.get(p, p) for p in ins] + [max(rel)])
            items.append(SavedItem(bytes=int(nbytes), savers=sv, inputs_of=ins, alive_until=until))
        return items, pinned


def _input_lifetimes(model: nn.Module, modules: list[nn.Module], x: torch.Tensor) -> dict[int, int]:
    """Chain position -> last chain position during whose forward that block's input is still referenced.

    Measured on a no-grad forward, where only the calling code holds tensors.
    """
    refs: dict[int, Any] = {}
    until: dict[int, int] = {}
    position: list[int] = [0]

    def make_pre(i):
        def pre(_m, args):
            t = first_tensor(args)
            if t is not None:
                refs[position[0]] = weakref.ref(t.untyped_storage())

        return pre

    def post(_m, _args, _out):
        for p, ref in refs.items():
            if ref() is not None:
                until[p] = position[0]
        position[0] += 1

    no_grad_forward(
        model,
        x,
        pre_hooks=[(m, make_pre(i)) for i, m in enumerate(modules)],
        post_hooks=[(m, post) for m in modules],
    )
    return until


def _record(model: nn.Module, names: list[str], x: torch.Tensor, y: torch.Tensor, model_name: str):
    """One step with hooks: the chain's call order, the saved items, the pinned bytes
    and the chain positions of blocks that modify their input in place."""
    rec = _Recorder(model, names, model_name)
    rec.step(x, y)
    order = rec.chain_order()
    pos = {b: p for p, b in enumerate(order)}
    input_until = _input_lifetimes(model, [rec.modules[b] for b in order], x)
    items, pinned = rec.saved_items(order, input_until)
    rec.keep.clear()
    return order, items, pinned, {pos[b] for b in rec.inplace if b in pos}


# --- timing ---------------------------------------------------------------------------
def _now_on(device: torch.device):
    """A host clock for work on ``device``: on CUDA it waits for the queued kernels before reading
    (which serializes the step a little, but a stamp then marks finished work, not queued work)."""
    if device.type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


class _BlockTimer:
    """Forward time per block (while ``recording``) and a timestamp when each
    block's output gradient arrives in backward (``stamps``)."""

    def __init__(self, modules: list[nn.Module], now=time.perf_counter) -> None:
        self.modules = modules
        self.now = now
        self.fwd: list[list[float]] = [[] for _ in modules]
        self.start: dict[int, float] = {}
        self.stamps: dict[int, float] = {}
        self.recording = True
        self.handles: list[Any] = []

    def install(self) -> None:
        for i, m in enumerate(self.modules):
            self.handles.append(m.register_forward_pre_hook(self._pre(i)))
            self.handles.append(m.register_forward_hook(self._post(i)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _pre(self, i: int):
        def pre(_m, _args):
            self.start[i] = self.now()

        return pre

    def _post(self, i: int):
        stamps = self.stamps

        def post(_m, _args, out):
            if self.recording:
                self.fwd[i].append(self.now() - self.start[i])
            t = first_tensor(out)
            if t is not None and t.requires_grad:
                t.register_hook(lambda _g: stamps.__setitem__(i, self.now()))

        return post

    def backward_times(self, end: float) -> list[float | None]:
        """Per block, the time from its output gradient to that of the block below
        (``end`` for the first); None for blocks without a stamp."""
        stamps = self.stamps
        out: list[float | None] = []
        for i in range(len(self.modules)):
            if i not in stamps:
                out.append(None)
                continue
            below = next((stamps[j] for j in range(i - 1, -1, -1) if j in stamps), end)
            out.append(max(below - stamps[i], 0.0))
        return out


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _time_blocks(model, names, order, x, y, repeats, recompute_runner=None, page_runner=None):
    """Median forward and backward time per block and of the whole step.

    With ``recompute_runner`` (every recomputable block checkpointed), steps
    alternate plain / recomputed and the third result is each block's extra
    backward time when recomputed: what recomputing it really costs
    (checkpoint bookkeeping and fresh allocations included). With
    ``page_runner`` (every block paged) steps alternate with those too."""
    now = _now_on(x.device)
    timer = _BlockTimer([_module(model, names[b]) for b in order], now)
    n = len(order)
    bwd: list[list[float]] = [[] for _ in range(n)]
    extra: list[list[float]] = [[] for _ in range(n)]
    steps: list[float] = []
    timer.install()
    try:
        for _ in range(repeats):
            timer.stamps.clear()
            timer.recording = True
            t0 = now()
            _step(model, x, y)
            end = now()
            steps.append(end - t0)
            plain = timer.backward_times(end)
            for i, b in enumerate(plain):
                if b is not None:
                    bwd[i].append(b)
            timer.recording = False
            if page_runner is not None:
                with page_runner:
                    _step(model, x, y)
            if recompute_runner is None:
                continue
            timer.stamps.clear()
            with recompute_runner:
                _step(model, x, y)
            for i, (a, b) in enumerate(zip(plain, timer.backward_times(now()))):
                if a is not None and b is not None:
                    extra[i].append(b - a)
    finally:
        timer.remove()
    return [_median(v) for v in timer.fwd], [_median(v) for v in bwd], [_median(v) for v in extra], _median(steps)


def _runner_for(model, blocks, actions, shape, spill_dir=None, page_min_bytes=1) -> PlanRunner:
    """An untracked runner for a fixed action list (for timing)."""
    plan = MemoryPlan(
        model="",
        input_shape=list(shape),
        blocks=blocks,
        actions=actions,
        overlap=[False] * len(blocks),
        budget_bytes=0,
        objective="time",
        frozen_below=0,
        predicted_peak_bytes=0,
        unconstrained_peak_bytes=0,
        page_min_bytes=page_min_bytes,
    )
    return apply_plan(model, plan, spill_dir, track=False, check_input=False)


def _timing_runners(model, chain, inplace, shape, storage, page_min_bytes):
    """Runners that recompute every block that may be, and (with ``storage``) that page
    every block while collecting the pager's I/O timings."""
    recompute_all = _runner_for(model, chain, [KEEP if p in inplace else RECOMPUTE for p in range(len(chain))], shape)
    page_all = None
    if storage is not None:
        page_all = _runner_for(model, chain, [PAGE] * len(chain), shape, storage.spill_dir, page_min_bytes)
        page_all.io_samples = []
    return recompute_all, page_all


# --- the profile ----------------------------------------------------------------------
def _check_args(shape: list[int], repeats: int) -> None:
    if len(shape) < 2 or any(s < 1 for s in shape):
        raise ConfigError(f"input_shape: got {shape}; pass (batch, channels, height, width) with positive sizes")
    if repeats < 1:
        raise ConfigError(f"repeats: got {repeats}; use 1 or more")


def _inputs(model: nn.Module, shape: list[int], seed: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs of ``shape`` and class targets for them (the model must be a classifier), on the
    model's device (drawn on the CPU, so a seed gives the same batch everywhere)."""
    gen = torch.Generator().manual_seed(seed)
    device = model_device(model)
    x = torch.randn(shape, generator=gen)
    x = x if device.type == "cpu" else x.to(device)
    with torch.no_grad():
        out = model(x)
    if out.dim() != 2:
        raise ModelError(f"model {name}: output shape {tuple(out.shape)} is not (batch, classes); use a classifier")
    y = torch.randint(0, out.shape[1], (shape[0],), generator=gen)
    return x, (y if device.type == "cpu" else y.to(device))


def _unplanned_peak(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """The larger activation peak of two unplanned steps, by the meter."""
    peaks = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with apply_plan(model, None) as run:
            F.cross_entropy(model(x), y).backward()
        peaks.append(run.meter.peak_bytes)
    return int(max(peaks))


def _block_costs(model, chain, inplace, fwd, bwd, extra) -> list[BlockCost]:
    blocks = []
    for p, name in enumerate(chain):
        m = _module(model, name)
        blk = BlockCost(
            name=name,
            kind=type(m).__name__,
            forward_s=fwd[p],
            backward_s=bwd[p],
            params=sum(t.numel() for t in m.parameters()),
        )
        if p in inplace:
            blk.can_recompute = False
            blk.note = "modifies its input in place"
        else:  # never below the forward time: a smaller difference is noise
            blk.recompute_s = max(extra[p], fwd[p])
        blocks.append(blk)
    return blocks


def measure_block_costs(
    model: nn.Module,
    input_shape: tuple[int, ...] | list[int],
    *,
    model_name: str | None = None,
    repeats: int = 3,
    warmup: int = 1,
    page_min_bytes: int = DEFAULT_MIN_BYTES,
    compute_watts: float | None = None,
    storage: StorageProfile | None = None,
    seed: int = 0,
) -> MemoryProfile:
    """Profile one training step of ``model`` on inputs of ``input_shape`` (batch first).

    All parameters are trained while measuring (the full-training profile;
    the planner discounts frozen blocks). The model's mode, ``requires_grad``
    flags, buffers and grads are restored afterwards.
    """
    name = model_name or type(model).__name__
    shape = [int(s) for s in input_shape]
    _check_args(shape, repeats)
    names = segment_model(model)
    state = _ModelState(model)
    try:
        model.train()
        for p in model.parameters():
            p.requires_grad_(True)
        x, y = _inputs(model, shape, seed, name)
        for _ in range(warmup):
            _step(model, x, y)
        order, items, pinned, inplace = _record(model, names, x, y, name)
        chain = [names[b] for b in order]
        recompute_all, page_all = _timing_runners(model, chain, inplace, shape, storage, page_min_bytes)
        fwd, bwd, extra, step_s = _time_blocks(model, names, order, x, y, repeats, recompute_all, page_all)
        peak = _unplanned_peak(model, x, y)
        blocks = _block_costs(model, chain, inplace, fwd, bwd, extra)
    finally:
        state.restore()
    if page_all is not None and page_all.io_samples:
        storage = in_step_storage(storage, page_all.io_samples)
    return MemoryProfile(
        model=name,
        input_shape=shape,
        blocks=blocks,
        items=items,
        pinned_bytes=int(pinned),
        measured_peak_bytes=peak,
        step_s=step_s,
        page_min_bytes=int(page_min_bytes),
        dtype=str(x.dtype).replace("torch.", ""),
        threads=torch.get_num_threads(),
        torch_version=str(torch.__version__),
        host=platform.node(),
        compute_watts=compute_watts,
        storage=storage,
    )

"""Run a :class:`~fleet.memory.planner.MemoryPlan` on a model in eager PyTorch.

    with apply_plan(model, plan, spill_dir) as run:
        loss = criterion(model(x), y)
        loss.backward()
    run.peak_bytes  # activation memory the step really held

Inside the ``with`` block every forward/backward of ``model`` follows the plan:

* ``recompute`` blocks run under ``torch.utils.checkpoint`` (non-reentrant).
  The recomputation restores the block's BatchNorm running statistics
  afterwards, so they are updated once per step as without the plan.
* ``page`` blocks run under ``saved_tensors_hooks`` of a
  :class:`~fleet.memory.spill.Pager` writing to a fresh directory inside
  ``spill_dir``; parameters, buffers, their views and the model input are
  never paged. Blocks with ``overlap`` write in the background (the forward of
  block k+2 waits for block k's writes) and are read back while the block above
  runs its backward. Spill files are deleted as soon as autograd frees them,
  and everything left (after an exception, say) when the ``with`` block exits.
* ``keep`` and ``frozen`` blocks run unchanged.

The pager follows the model's device (:func:`pager_kind`): spill files on the
CPU, pinned host memory on a CUDA GPU (:class:`~fleet.memory.hostpager.HostPager`,
which needs no spill directory). Both take the same calls, so the rest of the
runner does not know which one it drives.

Parameters, buffers, the model input and tensors the loss saves that did not
come out of the graph (its targets) are the caller's, not activations: they
are neither counted nor paged.

With ``track=True`` (the default) every saved storage is also counted by a
:class:`~fleet.memory.meter.StorageMeter` (``run.meter``), including
recomputed and paged-in copies, which gives the measured activation peak.
On a CUDA GPU the same meter counts the activations' GPU memory, and
``run.allocator`` (a :class:`~fleet.memory.meter.CudaMemoryMeter`) also reads
the whole step's GPU memory by the allocator's own statistics
(``allocator_peak_bytes``), which is reported but not budgeted.
``apply_plan(model, None)`` only measures.

The context can span many steps; the returned runner can also be entered
again for each step (cheaper than calling ``apply_plan`` every step). The
model's parameters and buffers are listed when ``apply_plan`` is called: call
it again if you replace parameter objects.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fleet.base.errors import ConfigError, ModelError, ProfileMismatchError
from fleet.memory.hostpager import HostPager
from fleet.memory.meter import CudaMemoryMeter, StorageMeter, allocator_meter, is_caller_data, storage_key
from fleet.memory.planner import FROZEN, PAGE, RECOMPUTE, MemoryPlan
from fleet.memory.spill import Kept, Pager

PAGERS = ("auto", "file", "host")


def pager_kind(device: torch.device, requested: str = "auto") -> str:
    """Where a plan on ``device`` pages: ``file`` (spill files) on the CPU, ``host`` (pinned host memory)
    on a CUDA GPU. ``requested`` other than ``auto`` forces one (``host`` on the CPU: tests of its logic)."""
    if requested not in PAGERS:
        raise ConfigError(f"pager: {requested!r} is not allowed; use one of {', '.join(PAGERS)}")
    if requested != "auto":
        return requested
    return "host" if device.type == "cuda" else "file"


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (the CPU for a model without any); memory sits below the
    engine, so it has its own copy of ``fleet.engine.accelerator.module_device``."""
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


class _Recompute:
    """Context for a checkpoint's recomputation: count what it re-creates and
    give the block's BatchNorm statistics back their pre-recompute values."""

    def __init__(self, buffers: list[torch.Tensor], meter: StorageMeter | None, excluded: set[int]) -> None:
        self.buffers = buffers
        self.meter = meter
        self.excluded = excluded
        self.saved: list[torch.Tensor] = []
        self.hooks = None

    def __enter__(self):
        self.saved = [b.clone() for b in self.buffers]
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and self.meter is not None:  # checkpoint's recomputation hooks: wrap them to count
            inner_pack, inner_unpack = top
            meter, excluded = self.meter, self.excluded

            def pack(t):
                storage = t.untyped_storage()
                if storage.data_ptr() not in excluded:
                    meter.watch_storage(storage)
                return inner_pack(t)

            self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, inner_unpack)
            self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        if self.hooks is not None:
            self.hooks.__exit__(*exc)
            self.hooks = None
        with torch.no_grad():
            for b, s in zip(self.buffers, self.saved):
                b.copy_(s)
        self.saved = []
        return False


def _bn_buffers(module: nn.Module) -> list[torch.Tensor]:
    out = []
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase):
            out += [b for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
    return out


class PlanRunner:
    """Context manager returned by :func:`apply_plan`."""

    def __init__(
        self,
        model: nn.Module,
        plan: MemoryPlan | None,
        spill_dir: str | os.PathLike | None,
        *,
        sync: bool,
        check_input: bool,
        track: bool = True,
        pager: str = "auto",
    ) -> None:
        self.model = model
        self.device = model_device(model)
        self.pager_kind = pager_kind(self.device, pager)
        self.plan = plan
        self.spill_dir = os.fspath(spill_dir) if spill_dir is not None else None
        self.sync = sync
        self.check_input = check_input
        self.track = track
        self.meter = StorageMeter()
        self.allocator: CudaMemoryMeter | None = None  # the whole step's GPU memory, on CUDA while tracking
        self.pager: Pager | HostPager | None = None
        self.io_samples: list[tuple[str, int, float]] | None = None  # set to a list to collect pager timings
        self._modules: list[nn.Module] = []
        self._handles: list[Any] = []
        self._patched: list[tuple[nn.Module, Any]] = []
        self._hooks = None
        self._excluded: set[int] = set()
        # Parameters and buffers are never activations; listed once (walking the module tree each step costs ms).
        self._state_tensors = list(model.parameters()) + list(model.buffers())
        self._bn: dict[int, list[torch.Tensor]] = {}
        if plan is not None:
            self._validate()

    @property
    def peak_bytes(self) -> int | None:
        """Activation high-water mark since entering (or the last :meth:`reset_peak`);
        None when not tracking."""
        return self.meter.peak_bytes if self.track else None

    @property
    def allocator_peak_bytes(self) -> int | None:
        """GPU memory the step allocated beyond what was allocated at its start (activations, gradients,
        workspaces), by the allocator; None off CUDA or when not tracking."""
        return self.allocator.peak_bytes if self.allocator is not None else None

    def reset_peak(self) -> None:
        self.meter.reset_peak()
        if self.allocator is not None:
            self.allocator.reset_peak()

    def spill_files(self) -> list[str]:
        return self.pager.files() if self.pager is not None else []

    # setup ---------------------------------------------------------------------
    def _validate(self) -> None:
        plan = self.plan
        for name in plan.blocks:
            try:
                self._modules.append(self.model.get_submodule(name) if name else self.model)
            except AttributeError:
                raise ProfileMismatchError(
                    f"memory plan: block {name!r} is not in this {type(self.model).__name__}; re-plan for this model"
                ) from None
        for k, a in enumerate(plan.actions):
            if a == FROZEN:
                for pname, p in self._modules[k].named_parameters():
                    if p.requires_grad:
                        where = f"{plan.blocks[k]}.{pname}" if plan.blocks[k] else pname
                        raise ConfigError(
                            f"frozen_below: the plan assumes block {plan.blocks[k]!r} is frozen but {where} "
                            f"requires grad; re-plan with frozen_below={k} or lower"
                        )
        if PAGE in plan.actions and self.pager_kind == "file" and self.spill_dir is None:
            raise ConfigError("spill_dir: the memory plan pages activations; pass a spill directory (--spill-dir)")

    def __enter__(self) -> PlanRunner:
        self.meter = StorageMeter()
        self.allocator = allocator_meter(self.device) if self.track else None
        self._excluded = {t.untyped_storage().data_ptr() for t in self._state_tensors}
        try:
            self._install()
        except BaseException:
            self._uninstall()
            raise
        return self

    def _install(self) -> None:
        plan = self.plan
        self._outside = True
        self._handles.append(self.model.register_forward_pre_hook(self._on_model_input))
        self._handles.append(self.model.register_forward_hook(self._on_model_output))
        if plan is not None:
            if PAGE in plan.actions and self.pager_kind == "host":
                meter = self.meter if self.track else None
                self.pager = HostPager(self.device, meter, self._excluded, min_bytes=plan.page_min_bytes or 1)
            elif PAGE in plan.actions:
                try:
                    os.makedirs(self.spill_dir, exist_ok=True)
                    directory = tempfile.mkdtemp(prefix="fleet-spill-", dir=self.spill_dir)
                except OSError as exc:
                    raise ConfigError(
                        f"spill_dir: cannot write to {self.spill_dir!r} ({exc.strerror}); pass a writable directory"
                    ) from None
                self.pager = Pager(
                    directory,
                    self.meter if self.track else None,
                    self._excluded,
                    sync=self.sync,
                    min_bytes=plan.page_min_bytes or 1,
                )
                self.pager.samples = self.io_samples
            for k, (module, action) in enumerate(zip(self._modules, plan.actions)):
                if action == RECOMPUTE:
                    if k not in self._bn:
                        self._bn[k] = _bn_buffers(module)
                    self._patch(module, self._recompute_forward(self._bn[k], module.forward))
                elif action == PAGE:
                    self._patch(module, self._paged_forward(k, module.forward, plan.overlap[k]))
                if k >= 2 and plan.actions[k - 2] == PAGE and plan.overlap[k - 2]:
                    self._handles.append(module.register_forward_pre_hook(self._waiter(k - 2)))
                if k >= 1 and plan.actions[k - 1] == PAGE and plan.overlap[k - 1]:
                    self._handles.append(module.register_forward_hook(self._prefetcher(k - 1)))
        if self.track:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()

    def __exit__(self, *exc) -> bool:
        self._uninstall(exc)
        return False

    def _uninstall(self, exc=(None, None, None)) -> None:
        try:
            if self._hooks is not None:
                self._hooks.__exit__(*exc)
        finally:
            self._hooks = None
            for h in self._handles:
                h.remove()
            self._handles.clear()
            for module, previous in reversed(self._patched):
                if previous is None:
                    del module.forward
                else:
                    module.forward = previous
            self._patched.clear()
            if self.pager is not None:
                self.pager.close()
            if self.allocator is not None:
                self.allocator.stop()

    def _patch(self, module: nn.Module, forward) -> None:
        self._patched.append((module, module.__dict__.get("forward")))
        module.forward = forward

    # hooks ------------------------------------------------------------------------
    def _on_model_output(self, _module, _args, _out) -> None:
        self._outside = True

    def _on_model_input(self, _module, args) -> None:
        self._outside = False
        for a in args if isinstance(args, tuple) else (args,):
            if isinstance(a, torch.Tensor):
                self._excluded.add(storage_key(a))
                if self.check_input and self.plan is not None:
                    planned = 1
                    for s in self.plan.input_shape:
                        planned *= s
                    if a.numel() > planned:
                        raise ProfileMismatchError(
                            f"memory plan: made for input {tuple(self.plan.input_shape)} but the step got "
                            f"{tuple(a.shape)}; re-plan with --batch-size {a.shape[0]}"
                        )
                break

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._excluded and not (self._outside and is_caller_data(t)):
            self.meter.watch_storage(storage)
        return Kept(t)

    @staticmethod
    def _unpack(handle: Kept) -> torch.Tensor:
        return handle.get()

    def _recompute_forward(self, buffers: list[torch.Tensor], forward):
        meter, excluded = (self.meter if self.track else None), self._excluded

        def context_fn():
            return contextlib.nullcontext(), _Recompute(buffers, meter, excluded)

        def recompute_forward(*args, **kwargs):
            return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

        return recompute_forward

    def _paged_forward(self, k: int, forward, overlap: bool):
        pager = self.pager

        def paged_forward(*args, **kwargs):
            pager.block, pager.overlap = k, overlap
            try:
                with torch.autograd.graph.saved_tensors_hooks(pager.pack, pager.unpack):
                    return forward(*args, **kwargs)
            finally:
                pager.block, pager.overlap = -1, False

        return paged_forward

    def _waiter(self, block: int):
        pager = self.pager

        def wait(_module, _args):
            pager.wait_writes(block)

        return wait

    def _prefetcher(self, block: int):
        pager = self.pager

        def attach(_module, _args, out):
            t = out if isinstance(out, torch.Tensor) else None
            if t is not None and t.requires_grad:
                t.register_hook(lambda _g: pager.prefetch(block))

        return attach


def first_trainable_block(model: nn.Module, blocks: list[str]) -> int:
    """Chain index of the input-most block with a parameter that requires grad
    (``len(blocks)`` if none): the ``frozen_below`` of the current elastic selection."""
    for k, name in enumerate(blocks):
        module = model.get_submodule(name) if name else model
        if any(p.requires_grad for p in module.parameters()):
            return k
    return len(blocks)


def apply_plan(
    model: nn.Module,
    plan: MemoryPlan | None,
    spill_dir: str | os.PathLike | None = None,
    *,
    sync: bool = False,
    check_input: bool = True,
    track: bool = True,
    pager: str = "auto",
) -> PlanRunner:
    """Make the steps run inside the returned context follow ``plan``.

    ``spill_dir``: where paged activations go (a fresh sub-directory is made
    and removed). ``sync``: fsync spill files and drop them from the page
    cache. ``check_input``: refuse inputs larger than the plan was made for.
    ``track``: count the activation peak (``run.peak_bytes``); costs a few
    microseconds per saved tensor, so leave it off in production steps.
    ``pager``: ``auto`` pages to files on the CPU and to pinned host memory on
    a CUDA GPU (:func:`pager_kind`); ``file`` or ``host`` forces one.
    ``plan=None`` keeps everything and only measures.
    """
    if plan is not None and not isinstance(plan, MemoryPlan):
        raise ModelError(f"plan: got {type(plan).__name__}; pass a MemoryPlan from plan_memory()")
    return PlanRunner(model, plan, spill_dir, sync=sync, check_input=check_input, track=track, pager=pager)

"""Count the activation memory a training step really holds.

A :class:`StorageMeter` is told about every tensor storage autograd keeps for
backward (saved tensors, checkpoint inputs, recomputed and paged-in copies)
and counts its bytes from that moment until the storage is actually freed,
whoever held it last. Storages are counted once however many tensors view
them. The high-water mark of that sum is the step's activation peak, the
figure a memory budget is checked against. Parameters, buffers, the
model input and the caller's data (:func:`is_caller_data`) are not
activations and are skipped by the callers.

On a CUDA GPU the same meter counts the activations' GPU memory, so a budget
means the same quantity on every device: the one the planner models. Beside it
a :class:`CudaMemoryMeter` reads the caching allocator's allocated and
peak-allocated bytes above what was allocated when the step began
(:func:`allocator_meter`): everything the step allocates, gradients and kernel
workspaces too. That whole-step figure is reported, not budgeted: budgeting it
against a plan of activations would let a plan that pages nothing pass (the
first GPU run did exactly that).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage: unique among storages alive at the same time."""
    return t.untyped_storage().data_ptr()


def module_storage_keys(module: torch.nn.Module) -> set[int]:
    """Storage keys of all parameters and buffers (and so of all their views)."""
    keys = {storage_key(p) for p in module.parameters()}
    keys |= {storage_key(b) for b in module.buffers()}
    keys.discard(0)
    return keys


def is_caller_data(t: torch.Tensor) -> bool:
    """Whether a tensor saved outside the model's forward belongs to the caller:
    not computed in the graph, like the loss's targets (often a view into the
    whole dataset). Such tensors are not activations: never counted or paged."""
    return t.grad_fn is None and not t.requires_grad


class _Ref(weakref.ref):
    """Weak reference to a watched storage; calls back when the memory is freed."""

    __slots__ = ("key", "nbytes")


class StorageMeter:
    """Live bytes of watched storages and their high-water mark (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._live: dict[int, _Ref] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def watch(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage until it is freed (no-op if already counted)."""
        self.watch_storage(t.untyped_storage())

    def watch_storage(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        if key == 0 or key in self._live:
            return
        # Storage objects live exactly as long as their memory, so the callback fires when it is freed.
        ref = _Ref(storage, self._release)
        ref.key = key
        ref.nbytes = nbytes = storage.nbytes()
        with self._lock:
            if key in self._live:
                return
            self._live[key] = ref
            self.live_bytes += nbytes
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes

    def _release(self, ref: _Ref) -> None:
        with self._lock:
            if self._live.get(ref.key) is ref:
                del self._live[ref.key]
                self.live_bytes -= ref.nbytes

    def reset_peak(self) -> None:
        """Start a new high-water mark from the bytes alive now."""
        with self._lock:
            self.peak_bytes = self.live_bytes


class CudaMemoryMeter:
    """GPU memory a step allocates beyond what was allocated when the step began (or :meth:`reset_peak`).

    It counts everything the step allocates on the GPU (activations, and also gradients made in
    backward and kernel workspaces), so it is at least the activation peak the planner models.
    Reported beside the activation peak, never budgeted.
    ``stats`` stands in for ``torch.cuda``'s memory statistics (tests)."""

    def __init__(self, device: torch.device, stats: Any = None) -> None:
        self.device = device
        self.stats = torch.cuda if stats is None else stats
        self._base = 0
        self._peak: int | None = None
        self.reset_peak()

    def watch(self, t: torch.Tensor) -> None:
        """No-op: the allocator counts every storage already."""

    def watch_storage(self, storage: torch.UntypedStorage) -> None:
        """No-op: the allocator counts every storage already."""

    @property
    def live_bytes(self) -> int:
        return max(int(self.stats.memory_allocated(self.device)) - self._base, 0)

    @property
    def peak_bytes(self) -> int:
        if self._peak is not None:
            return self._peak
        return max(int(self.stats.max_memory_allocated(self.device)) - self._base, 0)

    def reset_peak(self) -> None:
        """Start a new high-water mark from the bytes allocated now."""
        self.stats.reset_peak_memory_stats(self.device)
        self._base = int(self.stats.memory_allocated(self.device))
        self._peak = None

    def stop(self) -> None:
        """Freeze the peak at the end of a step, so later work on the GPU does not change it."""
        self._peak = self.peak_bytes


def allocator_meter(device: torch.device, stats: Any = None) -> CudaMemoryMeter | None:
    """The allocator's whole-step meter for a step on a CUDA ``device``; None elsewhere."""
    return CudaMemoryMeter(device, stats) if device.type == "cuda" else None

"""Count the activation memory a training step really holds.

A :class:`StorageMeter` is told about every tensor storage autograd keeps for
backward (saved tensors, checkpoint inputs, recomputed and paged-in copies)
and counts its bytes from that moment until the storage is actually freed,
whoever held it last. Storages are counted once however many tensors view
them. The high-water mark of that sum is the step's activation peak, the
figure a memory budget is checked against. Parameters, buffers, the
model input and the caller's data (:func:`is_caller_data`) are not
activations and are skipped by the callers.
"""

from __future__ import annotations

import threading
import weakref

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

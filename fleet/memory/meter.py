"""Count the activation memory a training step really holds.

A :class:`StorageMeter` is told about every tensor storage autograd keeps for
backward (saved tensors, checkpoint inputs, recomputed and paged-in copies)
and counts its bytes from that moment until the storage is actually freed,
whoever held it last. Storages are counted once however many tensors view
them. The high-water mark of that sum is the step's activation peak, the
figure a memory budget is checked against. Parameters, buffers and the
model input are not activations and are skipped by the callers.
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


class StorageMeter:
    """Live bytes of watched storages and their high-water mark (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._live: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def watch(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage until it is freed (no-op if already counted)."""
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        key = storage.data_ptr()
        if nbytes == 0 or key == 0:
            return
        with self._lock:
            if key in self._live:
                return
            self._live[key] = nbytes
            self.live_bytes += nbytes
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
        # Storage objects are kept alive with their memory, so this fires when the memory is freed.
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        with self._lock:
            nbytes = self._live.pop(key, 0)
            self.live_bytes -= nbytes

    def reset_peak(self) -> None:
        """Start a new high-water mark from the bytes alive now."""
        with self._lock:
            self.peak_bytes = self.live_bytes

"""Page saved activations of a model on a CUDA GPU out to pinned host memory and back.

:class:`HostPager` is the GPU's counterpart of :class:`fleet.memory.spill.Pager`: the executor
drives both through the same calls (``pack``/``unpack`` for ``saved_tensors_hooks``,
``wait_writes``, ``prefetch``, ``close``, ``files``). A GPU's activations are in its own memory,
and host memory is the cheapest place to put them: a copy over the bus, no file system.

* ``pack`` copies a saved storage (once, however many saved tensors view it) into a page-locked
  host buffer. The copy runs on a side CUDA stream, after an event of the compute stream (the
  kernels producing the activation), with ``non_blocking=True``. The source is marked as used
  by the side stream (``record_stream``), so the caching allocator hands its GPU memory to no
  other tensor before the copy is done, although the forward pass never waits for it.
* A block without ``overlap`` makes the compute stream wait for its copies at once; one with it
  is waited for at the forward of the block two above (:meth:`wait_writes`), as the file pager's
  writes are, which bounds how many activations are in flight.
* ``unpack`` returns the original storage while it is alive, else the copy a :meth:`prefetch`
  already queued on the side stream (the compute stream waits for its event), else copies back
  now on the compute stream.
* A host buffer is dropped when the last handle to it is freed; :meth:`close` drops the rest.

Without CUDA (tests on the CPU) the same bookkeeping runs with plain copies into host memory
that is not pinned: ``pin`` defaults to ``torch.cuda.is_available()`` because ``pin_memory``
needs CUDA.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch

from fleet.memory.meter import StorageMeter
from fleet.memory.spill import DEFAULT_MIN_BYTES, Kept, check_version, pack_saved


class _HostRecord:
    """One storage's bytes in host memory, and its copy back on the device while one exists."""

    __slots__ = ("nbytes", "original", "host", "copied", "device_copy", "ready", "handles", "pending", "__weakref__")

    def __init__(self, nbytes: int, original: torch.UntypedStorage) -> None:
        self.nbytes = nbytes
        self.original = weakref.ref(original)
        self.host: torch.Tensor | None = None  # the host buffer (pinned on CUDA)
        self.copied: Any = None  # CUDA event: the copy to the host is done (None: done already)
        self.device_copy: torch.Tensor | None = None  # bytes copied back (by a prefetch, or the first unpack)
        self.ready: Any = None  # CUDA event: the prefetch's copy back is done
        self.handles = 0  # live handles (graph references)
        self.pending = 0  # handles not unpacked yet


def _event(stream: Any) -> Any:
    """A CUDA event recorded on ``stream`` now (None without a stream: the CPU's copies are already done)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


class HostPager:
    """Host buffers for one planned step on ``device`` (or several, until :meth:`close`)."""

    def __init__(
        self,
        device: torch.device,
        meter: StorageMeter | Any | None,
        excluded: set[int],
        *,
        min_bytes: int = DEFAULT_MIN_BYTES,
        pin: bool | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.meter = meter
        self.excluded = excluded
        self.min_bytes = min_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._lock = threading.RLock()
        self._by_storage: dict[int, _HostRecord] = {}
        self._block_records: dict[int, list[weakref.ref]] = {}
        self._block_copies: dict[int, list[Any]] = {}
        self._closed = False
        self.block = -1  # block whose forward is running (set by the executor)
        self.overlap = False  # that block's copies may run behind the forward
        self.bytes_written = 0  # device -> host
        self.bytes_read = 0  # host -> device
        self.samples: list[tuple[str, int, float]] | None = None  # the executor's interface; copies are not timed

    # hooks --------------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        return pack_saved(self, t)

    def unpack(self, handle) -> torch.Tensor:
        if isinstance(handle, Kept):
            return handle.get()
        record = handle.record
        check_version(handle)
        storage = record.original()
        if storage is None:
            storage = self._copy_back(record).untyped_storage()
        with self._lock:
            record.pending -= 1
            if record.pending <= 0:
                record.device_copy = None  # the returned tensor keeps it alive while autograd needs it
        out = torch.empty(0, dtype=handle.dtype, device=storage.device)
        return out.set_(storage, handle.offset, handle.size, handle.stride)

    # forward / backward scheduling ---------------------------------------------
    def wait_writes(self, block: int) -> None:
        """Make the compute stream wait for the copies out of ``block`` (and earlier); the host never waits."""
        with self._lock:
            done = [b for b in self._block_copies if b <= block]
            events = [e for b in done for e in self._block_copies.pop(b)]
        if self.side is not None:
            compute = torch.cuda.current_stream(self.device)
            for event in events:
                compute.wait_event(event)

    def prefetch(self, block: int) -> None:
        """Queue the copies back of ``block``'s storages whose originals are gone (on the side stream)."""
        with self._lock:
            if self._closed:
                return
            refs = [r for r in self._block_records.get(block, []) if r() is not None]
            self._block_records[block] = refs
            records = [r() for r in refs]
        for record in records:
            if record is None or record.host is None or record.pending <= 0:
                continue
            if record.device_copy is not None or record.original() is not None:
                continue
            if self.side is None:
                copy = self._to_device(record)
            else:
                with torch.cuda.stream(self.side):
                    copy = self._to_device(record)
                record.ready = _event(self.side)
            with self._lock:
                record.device_copy = copy

    def close(self) -> None:
        """Drop every host buffer and device copy (after an exception mid-backward, say)."""
        with self._lock:
            self._closed = True
            for record in self._by_storage.values():
                record.host = record.device_copy = None
            self._by_storage.clear()
            self._block_records.clear()
            self._block_copies.clear()

    def files(self) -> list[str]:
        """No files: host memory only (the file pager's interface)."""
        return []

    # internals ------------------------------------------------------------------
    def _new_record(self, storage: torch.UntypedStorage, key: int) -> _HostRecord:
        if self._closed:
            raise RuntimeError("the memory plan's pager is closed; run the step inside `with apply_plan(...)`")
        record = _HostRecord(storage.nbytes(), storage)
        self._by_storage[key] = record
        self._block_records.setdefault(self.block, []).append(weakref.ref(record))
        # Forget the mapping when the original storage dies: its address may be reused.
        record.original = weakref.ref(storage, functools.partial(self._forget, key))
        source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        record.host = torch.empty(record.nbytes, dtype=torch.uint8, pin_memory=self.pin)
        self.bytes_written += record.nbytes
        if self.side is None:
            record.host.copy_(source)
            return record
        compute = torch.cuda.current_stream(self.device)
        self.side.wait_stream(compute)  # the kernels that produce the activation come first
        with torch.cuda.stream(self.side):
            record.host.copy_(source, non_blocking=True)
        source.record_stream(self.side)  # its GPU memory is reused only after the copy is done
        record.copied = _event(self.side)
        if self.overlap:
            self._block_copies.setdefault(self.block, []).append(record.copied)
        else:
            compute.wait_event(record.copied)
        return record

    def _to_device(self, record: _HostRecord) -> torch.Tensor:
        """A fresh device tensor with ``record``'s bytes (queued on the current stream on CUDA)."""
        if record.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(record.copied)
        out = torch.empty(record.nbytes, dtype=torch.uint8, device=self.device)
        out.copy_(record.host, non_blocking=self.side is not None)
        self.bytes_read += record.nbytes
        if self.meter is not None:
            self.meter.watch(out)
        return out

    def _copy_back(self, record: _HostRecord) -> torch.Tensor:
        """The device copy of ``record``: a prefetched one (waited for on the compute stream) or one made now."""
        with self._lock:
            copy, ready = record.device_copy, record.ready
        if copy is None:
            if record.host is None:
                raise RuntimeError("a paged activation was dropped before backward used it; the pager was closed")
            copy = self._to_device(record)
        elif ready is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(ready)
            copy.record_stream(compute)  # made on the side stream, used on the compute stream
        with self._lock:
            record.device_copy, record.ready = copy, None
        return copy

    def _forget(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            record = self._by_storage.get(key)
            if record is not None and record.original is ref:
                del self._by_storage[key]

    def _drop(self, record: _HostRecord) -> None:
        with self._lock:
            record.handles -= 1
            if record.handles > 0:
                return
            record.host = record.device_copy = None

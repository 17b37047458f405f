"""Page saved activations out to files in a spill directory and back in.

:class:`Pager` supplies the ``pack``/``unpack`` pair of
``torch.autograd.graph.saved_tensors_hooks`` for the blocks a plan pages:

* ``pack`` writes the tensor's whole storage to one file (once per storage,
  however many saved tensors view it) and returns a small handle, so the
  activation's memory is freed as soon as the forward pass drops it.
  Parameters, buffers, the model input (``excluded`` storage keys) and
  storages below ``min_bytes`` are kept in memory instead.
* ``unpack`` returns the original storage if it is still alive, otherwise the
  copy a prefetch already read, otherwise reads the file now.
* A file is deleted when the last handle to it is freed (normally right after
  the backward node that used it; a background thread does the unlinking,
  which frees the file's page-cache pages), and :meth:`Pager.close` waits for
  that and deletes whatever is left, e.g. after an exception mid-backward.

Blocks marked ``overlap`` write in a background thread (the forward pass
waits for a block's writes two blocks later, see :meth:`wait_writes`) and are
read ahead by :meth:`prefetch` while the block above runs its backward. Other
blocks write synchronously and read on demand.

``sync=True`` fsyncs every file and drops it from the page cache
(``POSIX_FADV_DONTNEED``), so paged bytes really leave RAM; without it the
kernel's page cache may keep them until it needs the memory.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from fleet.base.errors import ConfigError
from fleet.memory.meter import StorageMeter

DEFAULT_MIN_BYTES = 64 * 1024


# --- file primitives (also used by the storage benchmark) ------------------
def write_file(path: str, data: torch.Tensor, *, sync: bool = False) -> None:
    """Write a contiguous uint8 tensor to ``path``."""
    view = memoryview(data.numpy())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
        if sync:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_file(path: str, nbytes: int, *, sync: bool = False) -> torch.Tensor:
    """Read ``nbytes`` from ``path`` into a new uint8 tensor."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(out.numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            got = os.readv(fd, [view[done:]])
            if got == 0:
                raise EOFError(f"spill file {path} is shorter than {nbytes} bytes")
            done += got
        if sync:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return out


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over all of ``t``'s storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


# --- handles kept in the autograd graph ---------------------------------------
class Kept:
    """A saved tensor left in memory (with autograd's in-place check); the handle
    of every saved tensor that is not paged, in the pager and the executor alike."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.version = t._version

    def get(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: saved at version {self.version}, now at version {self.tensor._version}"
            )
        return self.tensor


class _Record:
    """One spill file: the bytes of one storage."""

    __slots__ = (
        "path",
        "nbytes",
        "original",
        "buffer",
        "write",
        "written",
        "read",
        "handles",
        "pending",
        "deleted",
        "__weakref__",
    )

    def __init__(self, path: str, nbytes: int, original: torch.UntypedStorage) -> None:
        self.path = path
        self.nbytes = nbytes
        self.original = weakref.ref(original)
        self.buffer: torch.Tensor | None = None  # bytes read back, kept until the last unpack
        self.write: Future | None = None
        self.written = False
        self.read: Future | None = None
        self.handles = 0  # live handles (graph references)
        self.pending = 0  # handles not unpacked yet
        self.deleted = False


class _Paged:
    """A saved tensor whose storage was paged out: to a spill file (:class:`Pager`), or to a host buffer
    (:class:`fleet.memory.hostpager.HostPager`); its ``record`` says where."""

    __slots__ = ("pager", "record", "dtype", "size", "stride", "offset", "tensor_ref", "version", "__weakref__")

    def __init__(self, pager, record, t: torch.Tensor) -> None:
        self.pager = pager
        self.record = record
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.tensor_ref = weakref.ref(t)
        self.version = t._version

    def __del__(self) -> None:
        self.pager._drop(self.record)


# --- the pager ------------------------------------------------------------------
def pack_saved(pager, t: torch.Tensor):
    """The ``pack`` hook both pagers share (:class:`Pager`, and the pinned-host one of
    :mod:`fleet.memory.hostpager`): excluded, empty and small storages are kept; any other storage gets one
    record however many saved tensors view it, and the tensor a handle on it."""
    storage = t.untyped_storage()
    key = storage.data_ptr()
    if key in pager.excluded or key == 0:
        return Kept(t)
    if pager.meter is not None:
        pager.meter.watch_storage(storage)
    if storage.nbytes() < pager.min_bytes:
        return Kept(t)
    with pager._lock:
        record = pager._by_storage.get(key)
        if record is None or record.original() is not storage:
            record = pager._new_record(storage, key)
        record.handles += 1
        record.pending += 1
    return _Paged(pager, record, t)


def check_version(handle) -> None:
    """Autograd's own error when a saved tensor was changed in place after it was saved."""
    t = handle.tensor_ref()
    if t is not None and t._version != handle.version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: saved at version {handle.version}, now at version {t._version}"
        )


class Pager:
    """Spill files for one planned step (or several, until :meth:`close`)."""

    def __init__(
        self,
        directory: str,
        meter: StorageMeter | None,
        excluded: set[int],
        *,
        sync: bool = False,
        min_bytes: int = DEFAULT_MIN_BYTES,
    ) -> None:
        self.directory = directory
        self.meter = meter
        self.excluded = excluded
        self.sync = sync
        self.min_bytes = min_bytes
        self._lock = threading.RLock()
        self._by_storage: dict[int, _Record] = {}
        self._block_records: dict[int, list[weakref.ref]] = {}
        self._block_writes: dict[int, list[Future]] = {}
        self._writer: ThreadPoolExecutor | None = None
        self._reader: ThreadPoolExecutor | None = None
        self._deleter: ThreadPoolExecutor | None = None  # unlinking frees page-cache pages: off the step
        self._counter = 0
        self._closed = False
        self.block = -1  # block whose forward is running (set by the executor)
        self.overlap = False  # that block writes in the background
        self.bytes_written = 0
        self.bytes_read = 0
        self.samples: list[tuple[str, int, float]] | None = None  # ("write"|"read"|"unlink", bytes, s)

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
            with self._lock:
                buffer, future = record.buffer, record.read
            if buffer is None:
                buffer = future.result() if future is not None else self._read(record)
            storage = buffer.untyped_storage()
            with self._lock:
                record.read = None
                record.buffer = buffer
        with self._lock:
            record.pending -= 1
            if record.pending <= 0:
                record.buffer = None  # the returned tensor keeps it alive while autograd needs it
        out = torch.empty(0, dtype=handle.dtype)
        return out.set_(storage, handle.offset, handle.size, handle.stride)

    # forward / backward scheduling ---------------------------------------------
    def wait_writes(self, block: int) -> None:
        """Block until the background writes of ``block`` (and earlier) finished."""
        with self._lock:
            done = [b for b in self._block_writes if b <= block]
            futures = [f for b in done for f in self._block_writes.pop(b)]
        for f in futures:
            f.result()

    def prefetch(self, block: int) -> None:
        """Start reading the files of ``block`` whose originals are gone."""
        with self._lock:
            if self._closed:
                return
            refs = [r for r in self._block_records.get(block, []) if r() is not None]
            self._block_records[block] = refs
            for ref in refs:
                record = ref()
                if record is None or record.deleted or record.pending <= 0:
                    continue
                if record.buffer is not None or record.read is not None or record.original() is not None:
                    continue
                if self._reader is None:
                    self._reader = ThreadPoolExecutor(1, thread_name_prefix="fleet-pagein")
                record.read = self._reader.submit(self._read, record)

    def close(self) -> None:
        """Finish background I/O and delete every spill file and the directory."""
        with self._lock:
            self._closed = True
            pools = [p for p in (self._writer, self._reader, self._deleter) if p is not None]
            self._writer = self._reader = self._deleter = None
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for record in self._by_storage.values():
                record.deleted = True
            self._by_storage.clear()
            self._block_records.clear()
            self._block_writes.clear()
        if os.path.isdir(self.directory):
            for name in os.listdir(self.directory):
                try:
                    os.unlink(os.path.join(self.directory, name))
                except FileNotFoundError:
                    pass
            try:
                os.rmdir(self.directory)
            except OSError:
                pass

    def files(self) -> list[str]:
        """Spill files on disk now (after deletions already requested have run)."""
        with self._lock:
            deleter = self._deleter
        if deleter is not None:
            try:
                deleter.submit(int).result()  # one worker: runs after every queued deletion
            except RuntimeError:  # shut down by close()
                pass
        return sorted(os.listdir(self.directory)) if os.path.isdir(self.directory) else []

    # internals ------------------------------------------------------------------
    def _new_record(self, storage: torch.UntypedStorage, key: int) -> _Record:
        if self._closed:
            raise RuntimeError("the memory plan's pager is closed; run the step inside `with apply_plan(...)`")
        self._counter += 1
        path = os.path.join(self.directory, f"{self._counter:06d}.bin")
        record = _Record(path, storage.nbytes(), storage)
        self._by_storage[key] = record
        self._block_records.setdefault(self.block, []).append(weakref.ref(record))
        # Forget the mapping when the original storage dies: its address may be reused.
        record.original = weakref.ref(storage, functools.partial(self._forget, key))
        data = torch.empty(0, dtype=torch.uint8).set_(storage)
        self.bytes_written += record.nbytes
        if self.overlap:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="fleet-pageout")
            record.write = self._writer.submit(self._write, record, data)
            self._block_writes.setdefault(self.block, []).append(record.write)
        else:
            self._write(record, data)
        return record

    def _forget(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            record = self._by_storage.get(key)
            if record is not None and record.original is ref:
                del self._by_storage[key]

    def _write(self, record: _Record, data: torch.Tensor) -> None:
        try:
            start = time.perf_counter()
            write_file(record.path, data, sync=self.sync)
            if self.samples is not None:
                self.samples.append(("write", record.nbytes, time.perf_counter() - start))
        except OSError as exc:
            raise ConfigError(
                f"spill_dir: cannot write {record.nbytes} bytes to {self.directory!r} ({exc.strerror}); "
                "free space there or pass another spill directory"
            ) from None
        finally:
            del data
            with self._lock:
                record.written = True
                gone = record.deleted
            if gone:
                _unlink(record.path)

    def _read(self, record: _Record) -> torch.Tensor:
        if record.write is not None:
            record.write.result()
        start = time.perf_counter()
        buffer = read_file(record.path, record.nbytes, sync=self.sync)
        if self.samples is not None:
            self.samples.append(("read", record.nbytes, time.perf_counter() - start))
        if self.meter is not None:
            self.meter.watch(buffer)
        self.bytes_read += record.nbytes
        return buffer

    def _drop(self, record: _Record) -> None:
        with self._lock:
            record.handles -= 1
            if record.handles > 0 or record.deleted:
                return
            record.deleted = True
            record.buffer = None
            if not record.written or self._closed:  # the writer, or close(), deletes it
                return
            if self._deleter is None:
                self._deleter = ThreadPoolExecutor(1, thread_name_prefix="fleet-unlink")
            self._deleter.submit(self._delete, record)

    def _delete(self, record: _Record) -> None:
        start = time.perf_counter()
        _unlink(record.path)
        if self.samples is not None:
            self.samples.append(("unlink", record.nbytes, time.perf_counter() - start))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

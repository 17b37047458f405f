"""Freed memory handed back to the kernel at once: glibc's ``malloc_trim``.

glibc serves a large allocation by ``mmap`` and unmaps it on ``free``, but each such free raises its mmap
threshold to the freed size (up to 32 MiB). After a device task's first large buffer, the model's tensors,
their gradients and the optimizer's state all come from the heap, and a heap keeps the pages of what was freed
in its middle until it is told to let them go. A ResNet-18 train task on the testbed still held 800-850 MB
resident after its app had returned the reply, of which about 300 MB was freed memory.

Design notes:

* **Where it matters: before the reply is copied out.** Flower's push serializes the reply in the task and
  the SuperNode stores it, both while the task holds its training memory: on a memory-limited pi4 (1,202 MB)
  that moment was the device's peak, and the OOM killer took the task that had just replied.
* **Not in the steps.** Trimming walks the heap (milliseconds for hundreds of MB) and the next step would fault
  the pages in again; a task trims once, when its training is done.
* **glibc only.** ``malloc_trim`` is looked up in the running C library; where there is none (musl, macOS) this
  does nothing and says so.
"""

from __future__ import annotations

import ctypes


def release_freed() -> bool:
    """Give the pages of every free heap chunk back to the kernel; False where the C library has no trim."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False

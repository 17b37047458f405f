"""glibc's trim gives freed heap memory back: the pages a task's app freed leave its resident set."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from fleet.base.malloc import release_freed

HEAP_HELD = """
import ctypes
from fleet.base.malloc import release_freed

def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 100 KB buffers come from the heap, as after a first big free
chunks = [bytearray(100_000) for _ in range(2000)]  # 200 MB, pages touched
pin = bytearray(100_000)  # above them, so that free() alone cannot shrink the heap from its top
held = resident_mb()
del chunks
freed = resident_mb()
released = release_freed()
print(held, freed, resident_mb(), released)
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "malloc_trim"), reason="not glibc: nothing to trim")
def test_freed_heap_memory_leaves_the_resident_set_once_released():
    out = subprocess.run([sys.executable, "-c", HEAP_HELD], capture_output=True, text=True, check=True).stdout
    held, freed, after, released = out.split()
    assert float(freed) > float(held) - 20, "free() alone should keep the heap's pages: nothing to test"
    assert released == "True" and float(after) < float(freed) - 150, out  # at least 150 of the 200 MB back


def test_release_is_a_no_op_where_the_c_library_has_no_trim(monkeypatch):
    monkeypatch.setattr(ctypes, "CDLL", lambda _: object())
    assert release_freed() is False

"""What paging costs on this device's storage: ``time = latency + bytes / throughput``
per direction.

* :func:`measure_storage` times writing and reading spill files of a few sizes
  in the spill directory, the way the pager does them (``source="probe"``).
* :func:`in_step_storage` fits the same model to the pager's own writes, reads
  (into fresh buffers) and deletions during real training steps
  (``source="in-step"``; deleting a file is charged to writing it), which
  include what a probe of a quiet file misses.
  :func:`fleet.memory.measure.measure_block_costs` uses it when it is given a
  storage profile.
* On a CUDA GPU activations are paged to pinned host memory, not to files:
  :func:`measure_host_copies` times the pager's copies (device to host is
  "write", host to device is "read") with CUDA events on a side stream
  (``source="pinned-host"``), and :func:`measure_paging` picks the probe by
  the device.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import torch

from fleet.base.errors import ConfigError
from fleet.memory.records import StorageProfile
from fleet.memory.spill import read_file, write_file

DEFAULT_STORAGE_SIZES = (64 * 1024, 1024 * 1024, 8 * 1024 * 1024)


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``t = a + n / thr`` with ``a >= 0``; returns (latency, throughput)."""
    n = len(points)
    sx = sum(p[0] for p in points)
    sy = sum(p[1] for p in points)
    sxx = sum(p[0] * p[0] for p in points)
    sxy = sum(p[0] * p[1] for p in points)
    den = n * sxx - sx * sx
    slope = (n * sxy - sx * sy) / den if den > 0 else 0.0
    a = (sy - slope * sx) / n
    if a < 0 or slope <= 0:
        a = max(a, 0.0)
        slope = max(sum(p[0] * (p[1] - a) for p in points) / sxx, 1e-12)
    return a, 1.0 / slope


def in_step_storage(probe: StorageProfile, samples: list[tuple[str, int, float]]) -> StorageProfile:
    """Storage costs fitted to the pager's own operations during real steps.

    Per direction, the median time of each distinct size is fitted to
    ``latency + bytes / throughput``. Deleting a file (which frees its
    page-cache pages) is charged to writing it: it runs on a background
    thread, but on a device whose cores are all computing it is not free.
    A direction seen at fewer than two sizes keeps the probe's figures."""
    by: dict[tuple[str, int], list[float]] = {}
    for kind, nbytes, seconds in samples:
        by.setdefault((kind, nbytes), []).append(seconds)
    med = {k: statistics.median(v) for k, v in by.items()}
    for (kind, n), t in list(med.items()):
        if kind == "write":
            med[("write", n)] = t + med.get(("unlink", n), 0.0)

    def fit(kind: str, fallback: tuple[float, float]) -> tuple[float, float]:
        pts = [(n, t) for (k, n), t in med.items() if k == kind]
        return _fit(pts) if len({n for n, _ in pts}) >= 2 else fallback

    w_lat, w_thr = fit("write", (probe.write_latency_s, probe.write_bytes_per_s))
    r_lat, r_thr = fit("read", (probe.read_latency_s, probe.read_bytes_per_s))
    sizes = sorted({n for (k, n) in med if k != "unlink"})
    return StorageProfile(
        spill_dir=probe.spill_dir,
        sync=probe.sync,
        write_latency_s=w_lat,
        write_bytes_per_s=w_thr,
        read_latency_s=r_lat,
        read_bytes_per_s=r_thr,
        storage_watts=probe.storage_watts,
        samples=[{"bytes": n, "write_s": med.get(("write", n)), "read_s": med.get(("read", n))} for n in sizes],
        source="in-step",
    )


def fit_host_copies(samples: list[dict], *, storage_watts: float | None = None) -> StorageProfile:
    """A pinned-host paging profile from median copy times per size (``bytes``, ``write_s``: device to
    host, ``read_s``: host to device), fitted as the file probe is; the planner reads it the same way."""
    return fitted_profile(samples, "", False, storage_watts, source="pinned-host")


def fitted_profile(
    samples: list[dict], spill_dir: str, sync: bool, storage_watts: float | None, **extra
) -> StorageProfile:
    """``latency + bytes / throughput`` per direction, fitted to median times per size (``bytes``,
    ``write_s``, ``read_s``)."""
    w_lat, w_thr = _fit([(s["bytes"], s["write_s"]) for s in samples])
    r_lat, r_thr = _fit([(s["bytes"], s["read_s"]) for s in samples])
    return StorageProfile(
        spill_dir=spill_dir,
        sync=sync,
        write_latency_s=w_lat,
        write_bytes_per_s=w_thr,
        read_latency_s=r_lat,
        read_bytes_per_s=r_thr,
        storage_watts=storage_watts,
        samples=samples,
        **extra,
    )


def _copy_times(device: torch.device, size: int, repeats: int) -> dict:
    """Median device-to-host and host-to-device copy of ``size`` bytes with pinned memory on a side
    stream, as the pager makes them, timed by CUDA events (one unmeasured copy each way first)."""
    stream = torch.cuda.Stream(device)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    writes, reads = [], []
    with torch.cuda.stream(stream):
        for r in range(repeats + 1):
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            marks[0].record(stream)
            host.copy_(src, non_blocking=True)
            marks[1].record(stream)
            src.copy_(host, non_blocking=True)
            marks[2].record(stream)
            marks[2].synchronize()
            if r > 0:
                writes.append(marks[0].elapsed_time(marks[1]) / 1000.0)
                reads.append(marks[1].elapsed_time(marks[2]) / 1000.0)
    return {"bytes": size, "write_s": statistics.median(writes), "read_s": statistics.median(reads)}


def measure_host_copies(
    device: torch.device,
    *,
    sizes: tuple[int, ...] = DEFAULT_STORAGE_SIZES,
    repeats: int = 5,
    storage_watts: float | None = None,
) -> StorageProfile:
    """What paging to pinned host memory costs on the CUDA GPU ``device`` (``source="pinned-host"``)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError(
            f"device: pinned-host paging is measured on a CUDA GPU and this is {device}; "
            "measure spill files with measure_storage on the CPU"
        )
    return fit_host_copies([_copy_times(device, int(s), repeats) for s in sizes], storage_watts=storage_watts)


def measure_paging(device: torch.device, spill_dir: str | os.PathLike, *, sync: bool = False) -> StorageProfile:
    """What paging costs where the model trains: pinned-host copies on a CUDA GPU, spill files elsewhere."""
    if device.type == "cuda":
        return measure_host_copies(device)
    return measure_storage(spill_dir, sync=sync)


def _probe_dir(spill_dir: str) -> str:
    """A fresh directory for the probe files inside ``spill_dir`` (created if missing)."""
    try:
        os.makedirs(spill_dir, exist_ok=True)
        return tempfile.mkdtemp(prefix="fleet-storage-", dir=spill_dir)
    except OSError as exc:
        raise ConfigError(
            f"spill_dir: cannot write to {spill_dir!r} ({exc.strerror}); pass a writable directory with --spill-dir"
        ) from None


def _probe(work: str, size: int, repeats: int, sync: bool, gen: torch.Generator) -> dict:
    """Median write and read time of a spill file of ``size`` bytes."""
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
    writes, reads = [], []
    for r in range(repeats):
        path = os.path.join(work, f"probe{r}.bin")
        t0 = time.perf_counter()
        write_file(path, data, sync=sync)
        t1 = time.perf_counter()
        read_file(path, size, sync=sync)
        t2 = time.perf_counter()
        os.unlink(path)
        writes.append(t1 - t0)
        reads.append(t2 - t1)
    return {"bytes": size, "write_s": statistics.median(writes), "read_s": statistics.median(reads)}


def measure_storage(
    spill_dir: str | os.PathLike,
    *,
    sizes: tuple[int, ...] = DEFAULT_STORAGE_SIZES,
    repeats: int = 5,
    sync: bool = False,
    storage_watts: float | None = None,
) -> StorageProfile:
    """Time spill-file writes and reads in ``spill_dir`` the way the pager does them."""
    spill_dir = os.fspath(spill_dir)
    work = _probe_dir(spill_dir)
    try:
        gen = torch.Generator().manual_seed(0)
        samples = [_probe(work, int(size), repeats, sync, gen) for size in sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return fitted_profile(samples, spill_dir, sync, storage_watts)

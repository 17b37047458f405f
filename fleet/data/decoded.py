"""A device's decoded images, kept between messages so that a round does not decode its image files again.

A deployed device handles every message in a new process (one forked per task, ``fleet device runtime``), so
whatever it read is gone when the message ends. Decoding a few hundred PNG files is about a tenth of a
CPU-second on this project's development machine: half a second of a Raspberry Pi-class core, on every
message, before its work starts. Here the decoded array is written once to the device's state directory
and read back (a single ``np.load``) by the next message while the image files are unchanged.

Design notes:

* **Keyed by the listing, not the content.** The key is every file's path, size and modification time (as
  ``make`` decides what to rebuild), with the image format asked for: an image added, removed, replaced or
  re-saved changes it, and the next read decodes the tree again. Hashing the bytes instead would cost most
  of what the cache saves.
* **The cache is only a copy.** It lives in the device's own state directory, is checked against the array it
  stands for (dtype and shape) when read, and anything wrong with it (missing, damaged, foreign, unwritable
  directory) only means the images are decoded again. It is never loaded with pickle.
* **One entry per folder.** Writing a folder's new entry removes its older ones, so the cache never holds
  more than one copy of each folder's images.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from fleet.base.atomic import write_atomic


def cached_decode(
    folder: Path,
    files: Sequence[Path],
    shape: tuple[int, ...],
    tag: str,
    cache_dir: Path | None,
    decode: Callable[[], np.ndarray],
) -> np.ndarray:
    """``decode()`` (the uint8 array of ``shape`` that ``folder``'s ``files`` decode to in format ``tag``), from
    the cache in ``cache_dir`` when an entry for exactly this listing is there; with ``cache_dir`` None, decoded."""
    if cache_dir is None:
        return decode()
    prefix = _digest(str(Path(folder).absolute()))[:12]
    try:
        entry = cache_dir / f"{prefix}-{_listing_key(files, shape, tag)}.npy"
    except OSError:  # a file gone since the listing: decoding names it in its own error
        return decode()
    cached = _read(entry, shape)
    if cached is not None:
        return cached
    images = decode()
    with contextlib.suppress(OSError):
        for old in cache_dir.glob(f"{prefix}-*.npy"):
            old.unlink(missing_ok=True)
        write_atomic(entry, lambda fh: np.save(fh, images, allow_pickle=False), binary=True)
    return images


def _listing_key(files: Sequence[Path], shape: tuple[int, ...], tag: str) -> str:
    """What the decoded array depends on: the format asked for and each file's path, size and change time."""
    parts = [repr((tuple(shape), tag))]
    for f in files:
        st = Path(f).stat()
        parts.append(f"{f}\0{st.st_size}\0{st.st_mtime_ns}")
    return _digest("\n".join(parts))[:24]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def _read(entry: Path, shape: tuple[int, ...]) -> np.ndarray | None:
    """The entry's array when it is exactly what it stands for (uint8 of ``shape``), else None."""
    try:
        array = np.load(entry, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.shape != tuple(shape):
        return None
    return array

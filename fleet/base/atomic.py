"""Atomic file writes: readers see the old file or the new one, never half of one.

Results, profiles, checkpoints and device state are written this way so that a
crash or a kill mid-write never destroys what was already saved.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def write_atomic(path: str | os.PathLike, write: Callable[[IO], object], *, binary: bool = False) -> Path:
    """Call ``write(fh)`` on a temporary file beside ``path``, fsync it, then rename it over ``path``."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_atomic(path, lambda fh: fh.write(text))


def write_json(path: str | os.PathLike, data: dict) -> Path:
    """Atomic JSON write: a crash never leaves half a results file."""
    return write_text_atomic(path, json.dumps(data, indent=2))


def save_torch(path: str | os.PathLike, obj: dict) -> Path:
    """Atomic torch.save of a checkpoint or device state."""
    import torch  # here, not above: the device runtime's poller writes files and must not hold torch

    return write_atomic(path, lambda fh: torch.save(obj, fh), binary=True)


def torch_bytes(obj: dict) -> bytes:
    """What :func:`save_torch` would write, as bytes."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def load_torch(path: str | os.PathLike) -> dict | None:
    """What :func:`save_torch` wrote, or None when the file is absent or unreadable (never a crash).

    ``weights_only=True``: a file that crosses a boundary must not run code when loaded."""
    import torch

    path = Path(path)
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        return None

"""Atomic file writes: readers see the old file or the new one, never half of one.

Results, profiles and checkpoints are written this way so that a crash or a
kill mid-write never destroys what was already saved.
"""

from __future__ import annotations

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

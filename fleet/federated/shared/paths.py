"""Where the app lives, and how a relative path in a config is found."""

from __future__ import annotations

from pathlib import Path

APP_ROOT = Path(__file__).resolve().parents[3]  # holds pyproject.toml and simulations/


def resolve_path(path: str | Path) -> Path:
    """Relative config paths are looked up in the working directory, then the app root."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    return APP_ROOT / p

"""The server's per-round checkpoint: global model plus everything needed to continue.

Written atomically after each round, so a server killed at any moment resumes
from the last completed round with nothing lost.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from fleet.atomic import load_torch, save_torch

CHECKPOINT_FILE = "checkpoint.pt"


@dataclass
class ServerState:
    """What the loop carries from round to round."""

    round: int = 0
    sim_time_s: float = 0.0
    wall_time_s: float = 0.0
    run_tag: str = ""
    full_times: dict[str, float] = field(default_factory=dict)  # node id -> full-training time per round
    global_importance: dict[str, float] = field(default_factory=dict)


def save_checkpoint(out: Path, arrays: dict[str, np.ndarray], state: ServerState) -> Path:
    path = out / CHECKPOINT_FILE
    save_torch(path, {"model": {k: torch.from_numpy(np.array(v)) for k, v in arrays.items()}, "meta": asdict(state)})
    return path


def load_checkpoint(out: Path) -> tuple[dict[str, torch.Tensor], ServerState] | None:
    obj = load_torch(out / CHECKPOINT_FILE)
    if not obj or "model" not in obj or "meta" not in obj:
        return None
    return obj["model"], ServerState(**obj["meta"])

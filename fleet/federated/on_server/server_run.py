"""A server's run, Flower-free: start or resume, round after round, checkpoint, summary.

The round loop (fleet.federated.on_server.server_loop) drives the rounds' messages; everything that outlives one
round is kept here: the run's folder, the metrics.jsonl tracker, the checkpoint written after every
round (so a server killed at any moment resumes from the last completed round), the progress
line, and summary.json and the plots at the end.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleet.engine.experiment import make_model
from fleet.federated.on_server.coordinator import Coordinator, out_of_time
from fleet.federated.on_server.server_eval import reference_set, server_test_set
from fleet.federated.on_server.state import (
    ServerState,
    check_resumable,
    keep_previous_run,
    load_checkpoint,
    save_checkpoint,
)
from fleet.federated.on_server.tracking import Tracker, plot_run, progress_line, write_progress
from fleet.federated.shared.classes import FleetClasses
from fleet.federated.shared.config import FleetConfig, run_dir
from fleet.federated.shared.names import simulated_names
from fleet.federated.shared.round_record import RoundRecord
from fleet.federated.shared.run_summary import RunSummary


def initial_arrays(cfg: FleetConfig) -> dict[str, np.ndarray]:
    model = make_model(cfg.model, cfg.train.seed)
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


def start_state(
    cfg: FleetConfig, out: Path, resume: bool, simulated: bool = False
) -> tuple[dict[str, np.ndarray], ServerState]:
    """The checkpointed model and state when resuming, else a fresh start (an older run is kept aside)."""
    if resume:
        check_resumable(out)
        loaded = load_checkpoint(out)
        if loaded is not None:
            model, state = loaded
            print(f"resuming {cfg.name} after round {state.round} (simulated time {state.sim_time_s:.1f}s)", flush=True)
            return {k: v.numpy() for k, v in model.items()}, state
        print(f"no checkpoint in {out}; starting {cfg.name} from round 1", flush=True)
    else:
        keep_previous_run(out, cfg.name, lambda line: print(line, flush=True))
    return initial_arrays(cfg), ServerState(run_tag=uuid.uuid4().hex[:12], screen_secret=screen_secret(cfg, simulated))


def screen_secret(cfg: FleetConfig, simulated: bool) -> int:
    """ServerState.screen_secret: from the OS for real devices, from train.seed in a simulation."""
    if not simulated:
        return secrets.randbits(64)
    return int(np.random.SeedSequence([cfg.train.seed, SCREEN_SALT]).generate_state(1, np.uint64)[0])


SCREEN_SALT = 0x5C12EE  # keeps a simulation's screen secret apart from the other streams drawn from train.seed


@dataclass
class ServerRun:
    """One run of the fleet on the server: its folder, its coordinator and its metrics."""

    cfg: FleetConfig
    out: Path
    coordinator: Coordinator
    tracker: Tracker

    @classmethod
    def start(cls, cfg: FleetConfig, *, resume: bool, simulated: bool = False) -> ServerRun:
        """A fresh run, or the checkpointed one continued (``resume``). ``simulated``: Flower's simulation
        engine, whose devices are known by name (their classes, their data sizes)."""
        out = run_dir(cfg)
        arrays, state = start_state(cfg, out, resume, simulated)
        out.mkdir(parents=True, exist_ok=True)
        tracker = Tracker(out, resume_round=state.round if resume else None)
        classes = FleetClasses(cfg, simulated_names(cfg) if simulated else {})
        coordinator = Coordinator(cfg, state, arrays, classes=classes, simulated=simulated)
        if cfg.evaluation.server_test:
            coordinator.server_test = server_test_set(cfg)
        if cfg.robust.validate is not None:
            coordinator.accept.reference = reference_set(cfg)
        return cls(cfg, out, coordinator, tracker)

    def rounds(self) -> Iterator[int]:
        """The rounds left to run, until ``federation.rounds`` or the simulated clock's ``time_budget_s``."""
        state = self.coordinator.state
        for server_round in range(state.round + 1, self.cfg.federation.rounds + 1):
            if out_of_time(self.cfg, state):
                print(
                    f"simulated time {state.sim_time_s:.1f}s reached federation.time_budget_s; stopping after "
                    f"round {state.round}",
                    flush=True,
                )
                return
            yield server_round

    def keep(self, records: list[RoundRecord]) -> None:
        """A finished round: the metrics lines it releases (its own, or the last round's: evaluation.pipelined
        holds a record until the next round's trainers have scored its model), the checkpoint, the progress lines."""
        for record in records:
            self.tracker.add(record)
        save_checkpoint(self.out, self.coordinator.arrays, self.coordinator.state)
        write_progress(self.out, self.coordinator.state)
        for record in records:
            print(progress_line(record, self.cfg.federation.rounds), flush=True)

    def finish(self) -> RunSummary:
        """summary.json and the plots; returns the summary."""
        cfg, fed = self.cfg, self.cfg.federation
        summary = self.tracker.summary(cfg.name, fed.strategy)
        plot_run(self.out, self.tracker.records, f"{cfg.name} ({fed.strategy})")
        return summary

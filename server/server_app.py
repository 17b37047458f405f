"""Flower ServerApp of the fleet (Message API).

Each round: send the global model and the round's deadline, aggregate only the
tensors each device trained (:class:`ElasticFedAvg`), evaluate global and
personalized accuracy on every device, advance the simulated clock, write a
metrics line and a progress line, and checkpoint. ``resume = true`` in the run
config continues from the last checkpoint. The round's state lives in one
:class:`~fleet.federated.state.ServerState`; the tracking is Flower-free.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fleet.errors import FleetError
from fleet.experiment import make_model
from fleet.federated import keys
from fleet.federated.aggregate import error_summary
from fleet.federated.config import FleetConfig, config_from_run_config, run_dir
from fleet.federated.state import ServerState, keep_previous_run, load_checkpoint, save_checkpoint
from fleet.federated.tracking import Tracker, plot_run, progress_line, round_record, round_time
from server.strategy import ElasticFedAvg

app = ServerApp()
log = logging.getLogger("fleet.server")


def initial_arrays(cfg: FleetConfig) -> dict[str, np.ndarray]:
    model = make_model(cfg.model, cfg.train.seed)
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


def param_names(cfg: FleetConfig) -> list[str]:
    return [n for n, _ in make_model(cfg.model, cfg.train.seed).named_parameters()]


def wait_for_devices(grid: Grid, cfg: FleetConfig, timeout: float) -> list[int]:
    """The connected devices once all ``federation.num_devices`` are there; a FleetError after
    ``timeout`` seconds (a SuperNode that never starts, or a simulation backend that died
    while starting, would otherwise leave the server waiting forever)."""
    want = cfg.federation.num_devices
    deadline = time.monotonic() + timeout
    node_ids = list(grid.get_node_ids())
    while len(node_ids) < want:
        if time.monotonic() > deadline:
            raise FleetError(
                f"only {len(node_ids)} of {want} devices connected within {timeout:.0f}s (federation.timeout_s); "
                "start the missing SuperNodes or lower federation.num_devices"
            )
        log.info("waiting for devices: %d of %d connected", len(node_ids), want)
        time.sleep(1.0)
        node_ids = list(grid.get_node_ids())
    return node_ids


def query_full_times(grid: Grid, node_ids: list[int], timeout: float) -> dict[str, float]:
    """Ask every device for its full-training time of one round (for the default deadline)."""
    content = RecordDict({keys.CONFIG: ConfigRecord({})})
    messages = [Message(content, dst_node_id=n, message_type=MessageType.QUERY) for n in node_ids]
    times = {}
    for reply in grid.send_and_receive(messages, timeout=timeout):
        node = reply.metadata.src_node_id
        if reply.has_error():
            log.warning("device on node %d could not report its profile: %s", node, error_summary(reply.error.reason))
            continue
        times[str(node)] = float(reply.content[keys.METRICS][keys.FULL_TIME_S])
    return times


def out_of_time(cfg: FleetConfig, state: ServerState) -> bool:
    """True once the simulated clock has reached ``federation.time_budget_s`` (if set):
    rounds that started before the horizon still finish."""
    budget = cfg.federation.time_budget_s
    return budget is not None and state.sim_time_s >= budget


def start_state(cfg: FleetConfig, out: Path, resume: bool) -> tuple[dict[str, np.ndarray], ServerState]:
    """The checkpointed model and state when resuming, else a fresh start (an older run is kept aside)."""
    if resume:
        loaded = load_checkpoint(out)
        if loaded is not None:
            model, state = loaded
            print(f"resuming {cfg.name} after round {state.round} (simulated time {state.sim_time_s:.1f}s)", flush=True)
            return {k: v.numpy() for k, v in model.items()}, state
        print(f"no checkpoint in {out}; starting {cfg.name} from round 1", flush=True)
    else:
        keep_previous_run(out, cfg.name, lambda line: print(line, flush=True))
    return initial_arrays(cfg), ServerState(run_tag=uuid.uuid4().hex[:12])


def make_strategy(cfg: FleetConfig, state: ServerState, arrays: dict[str, np.ndarray]) -> ElasticFedAvg:
    fed = cfg.federation
    full_upload_s = sum(a.nbytes for a in arrays.values() if a.dtype.kind == "f") / fed.bandwidth_bytes_per_s
    return ElasticFedAvg(
        state,
        method=fed.strategy,
        deadline_s=fed.deadline_s,
        deadline_factor=fed.deadline_factor,
        full_upload_s=full_upload_s if fed.deadline_includes_upload else 0.0,
        param_names=param_names(cfg),
        lr=cfg.train.lr,
        blend=fed.strategy == "fleet" and fed.blend_beta is not None,
        min_train_nodes=1,
        min_evaluate_nodes=1,
        min_available_nodes=fed.num_devices,
    )


def run_round(
    grid: Grid, cfg: FleetConfig, strategy: ElasticFedAvg, arrays: dict[str, np.ndarray], server_round: int
) -> tuple[dict[str, np.ndarray], dict]:
    """One round: train, aggregate, evaluate, advance the clocks; (new global arrays, metrics record)."""
    state, timeout = strategy.state, cfg.federation.timeout_s
    started = time.perf_counter()
    record = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})
    deadline = strategy.round_deadline()
    replies = grid.send_and_receive(
        strategy.configure_train(server_round, record, ConfigRecord(), grid), timeout=timeout
    )
    new_record, _ = strategy.aggregate_train(server_round, replies)
    if new_record is not None:
        arrays, record = {k: a.numpy() for k, a in new_record.items()}, new_record
    replies = grid.send_and_receive(
        strategy.configure_evaluate(server_round, record, ConfigRecord(), grid), timeout=timeout
    )
    accuracy = strategy.aggregate_evaluate(server_round, replies)
    accuracy = None if accuracy is None else dict(accuracy)
    rt = round_time(state.replies.train, cfg.federation.bandwidth_bytes_per_s)
    state.finish_round(server_round, rt, time.perf_counter() - started)
    return arrays, round_record(state, cfg.federation.strategy, deadline, rt, accuracy, strategy.param_names)


def run_fleet(grid: Grid, cfg: FleetConfig, *, resume: bool) -> dict:
    """Run (or continue) the fleet until ``federation.rounds`` or, when set, until the
    simulated clock reaches ``federation.time_budget_s``; returns the summary."""
    fed = cfg.federation
    out = run_dir(cfg)
    arrays, state = start_state(cfg, out, resume)
    out.mkdir(parents=True, exist_ok=True)
    tracker = Tracker(out, resume_round=state.round if resume else None)
    strategy = make_strategy(cfg, state, arrays)
    node_ids = wait_for_devices(grid, cfg, fed.timeout_s)
    if fed.strategy != "fedavg" and fed.deadline_s is None and not state.full_times:
        state.full_times = query_full_times(grid, node_ids, fed.timeout_s)
    for server_round in range(state.round + 1, fed.rounds + 1):
        if out_of_time(cfg, state):
            print(
                f"simulated time {state.sim_time_s:.1f}s reached federation.time_budget_s; stopping after "
                f"round {state.round}",
                flush=True,
            )
            break
        arrays, record = run_round(grid, cfg, strategy, arrays, server_round)
        tracker.add(record)
        save_checkpoint(out, arrays, state)
        print(progress_line(record, fed.rounds), flush=True)
    summary = tracker.summary({"name": cfg.name, "strategy": fed.strategy, "run_dir": str(out)})
    plot_run(out, tracker.records, f"{cfg.name} ({fed.strategy})")
    return summary


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = config_from_run_config({k: v for k, v in context.run_config.items() if k != "resume"})
    run_fleet(grid, cfg, resume=bool(context.run_config.get("resume", False)))

"""Flower ServerApp of the fleet (Message API).

Each round: admit devices that answered a query, sample the round's devices, send
them the global model and the round's deadline, close the round at deadline +
``grace_s`` at the latest, aggregate only the tensors each device trained
(:class:`ElasticFedAvg`), evaluate global and personalized accuracy on the devices
that trained, advance the simulated clock, write a metrics line and a progress
line, and checkpoint. ``resume = true`` in the run
config continues from the last checkpoint. The round's state lives in one
:class:`~fleet.federated.state.ServerState`; the tracking is Flower-free.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from fleet.data.datasets import ArrayDataset
from fleet.engine.experiment import make_model
from fleet.federated import keys
from fleet.federated.classes import FleetClasses
from fleet.federated.config import FleetConfig, config_from_run_config, run_dir
from fleet.federated.device import simulated_names
from fleet.federated.membership import EVAL_STREAM, full_times, name_of, record_attendance, sample
from fleet.federated.personal import personal_names
from fleet.federated.robust import Defense
from fleet.federated.round import compute_steps
from fleet.federated.server_eval import server_accuracy, server_test_set
from fleet.federated.split import known_data_sizes
from fleet.federated.state import (
    RoundReplies,
    ServerState,
    check_resumable,
    keep_previous_run,
    load_checkpoint,
    save_checkpoint,
)
from fleet.federated.tracking import Tracker, plot_run, progress_line, round_record, round_speedup, round_time
from server.mailbox import Mailbox
from server.roster import Membership, connected_nodes, wait_for_devices
from server.strategy import ElasticFedAvg

app = ServerApp()
log = logging.getLogger("fleet.server")


def initial_arrays(cfg: FleetConfig) -> dict[str, np.ndarray]:
    model = make_model(cfg.model, cfg.train.seed)
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


def out_of_time(cfg: FleetConfig, state: ServerState) -> bool:
    """True once the simulated clock has reached ``federation.time_budget_s`` (if set):
    rounds that started before the horizon still finish."""
    budget = cfg.federation.time_budget_s
    return budget is not None and state.sim_time_s >= budget


def start_state(cfg: FleetConfig, out: Path, resume: bool) -> tuple[dict[str, np.ndarray], ServerState]:
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
    return initial_arrays(cfg), ServerState(run_tag=uuid.uuid4().hex[:12])


def make_strategy(
    cfg: FleetConfig,
    state: ServerState,
    arrays: dict[str, np.ndarray],
    simulated: bool = False,
    classes: FleetClasses | None = None,
) -> ElasticFedAvg:
    fed = cfg.federation
    defense = Defense(
        aggregation=cfg.robust.aggregation,
        trim=cfg.robust.trim_fraction,
        norm_bound=cfg.robust.norm_bound,
        norm_action=cfg.robust.norm_action,
        min_pull=cfg.robust.min_pull,
        max_samples=cfg.robust.max_samples_per_device,
        time_band=cfg.robust.time_band,
        sample_caps=known_data_sizes(cfg) if simulated else {},  # a simulation knows every device's data
    )
    model = make_model(cfg.model, cfg.train.seed)  # its tensor names: trainable ones, and the personal ones
    personal = personal_names(model, cfg.personalization.policy)
    full_bytes = shared_bytes(arrays, personal)
    full_upload_s = full_bytes / cfg.devices.bandwidth_bytes_per_s
    upload_s_of = None  # device classes: each device's full upload over its own uplink sets its full round
    if classes is not None and classes.partitions and cfg.devices.device_classes and fed.deadline_includes_upload:
        upload_s_of = lambda name: full_bytes / classes.bandwidth(name)  # noqa: E731
    return ElasticFedAvg(
        state,
        method=fed.strategy,
        deadline_s=fed.deadline_s,
        deadline_factor=fed.deadline_factor,
        full_upload_s=full_upload_s if fed.deadline_includes_upload else 0.0,
        param_names=[n for n, _ in model.named_parameters()],
        lr=cfg.train.lr,
        blend=fed.strategy == "fleet" and cfg.elastic.blend_beta is not None,
        defense=defense,
        upload_s_of=upload_s_of,
        personal=personal,
        server_momentum=fed.server_momentum,
        server_lr=fed.server_lr,
    )


def shared_bytes(arrays: dict[str, np.ndarray], personal: frozenset[str]) -> int:
    """Bytes of a full upload: every float tensor but the personal ones, which never leave a device."""
    return sum(a.nbytes for name, a in arrays.items() if a.dtype.kind == "f" and name not in personal)


def round_bounds(ctx: RoundContext, deadline: float, nodes: list[str]) -> tuple[float, float]:
    """(train, evaluate) wall-time bounds of a round. Deployed: the deadline (a FedAvg round: the
    slowest sampled device's full round and upload) plus ``grace_s``, and ``grace_s`` to evaluate.
    Simulated devices share this machine's CPUs, so their wall time is not the deadline's:
    ``timeout_s`` bounds both."""
    fed, strategy = ctx.cfg.federation, ctx.strategy
    if ctx.simulated:
        return fed.timeout_s, fed.timeout_s
    expected = deadline
    if expected <= 0:
        expected = max(full_times(strategy.state.roster, nodes).values(), default=0.0) + strategy.full_upload_s
    return expected + ctx.cfg.membership.grace_s, ctx.cfg.membership.grace_s


@dataclass
class TrainPhase:
    """What the train half of a round leaves for the evaluate half and the record."""

    arrays: dict[str, np.ndarray]
    record: ArrayRecord
    answered: list[str]  # nodes whose train reply came in without an error: they are evaluated
    deadline_s: float
    bound_s: float
    eval_bound_s: float


def train_phase(grid: Grid, ctx: RoundContext, arrays: dict[str, np.ndarray], server_round: int) -> TrainPhase:
    """Admit, sample, send the train messages, wait until they are in or the round closes, aggregate."""
    strategy, state, fed = ctx.strategy, ctx.strategy.state, ctx.cfg.federation
    att, t = state.replies.attendance, time.perf_counter()
    eligible = ctx.members.open_round(grid, server_round, fed.timeout_s)
    t = state.replies.lap("open_s", t)
    online = [n for n in eligible if ctx.classes.online(state.roster[n]["name"], server_round, state.sim_time_s)]
    att.offline = [state.roster[n]["name"] for n in eligible if n not in online]
    nodes = sample(online, fed.devices_per_round, ctx.cfg.train.seed, server_round)
    att.sampled = [state.roster[n]["name"] for n in nodes]
    log.info("round %d: sampled %d of %d online devices: %s", server_round, len(nodes), len(online), att.sampled)
    deadline = strategy.round_deadline(online)
    bound, eval_bound = round_bounds(ctx, deadline, nodes)
    record = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})
    messages = strategy.train_messages(server_round, record, [int(n) for n in nodes], deadline)
    ids = ctx.mailbox.push(messages, "train", server_round)
    t = state.replies.lap("push_train_s", t)
    pulled = ctx.mailbox.collect(ids, bound, server_round, "train")
    t = state.replies.lap("wait_train_s", t)
    replies = ctx.members.take(pulled, connected_nodes(grid), server_round)
    answered = sorted({str(m.metadata.src_node_id) for m in replies})
    att.missed = record_attendance(state.roster, nodes, answered)
    for name in att.missed:
        log.warning("round %d: no reply from device %s within %.0fs; went on without it", server_round, name, bound)
    new_record, _ = strategy.aggregate_train(server_round, replies)
    if new_record is not None:
        arrays, record = {k: a.numpy() for k, a in new_record.items()}, new_record
    state.replies.lap("aggregate_s", t)
    ok = sorted({str(m.metadata.src_node_id) for m in replies if not m.has_error()})
    return TrainPhase(arrays, record, ok, deadline, bound, eval_bound)


def evaluates(cfg: FleetConfig, server_round: int, sim_time_after_s: float) -> bool:
    """Whether this round evaluates: every ``eval_every`` rounds, and always the run's last round
    (the one at ``rounds``, or the one that takes the simulated clock to ``time_budget_s``)."""
    fed = cfg.federation
    last = server_round >= fed.rounds or (fed.time_budget_s is not None and sim_time_after_s >= fed.time_budget_s)
    return last or server_round % cfg.evaluation.every == 0


def evaluate_phase(grid: Grid, ctx: RoundContext, phase: TrainPhase, server_round: int) -> dict | None:
    """Ask a seeded sample (``eval_devices``, else all) of the round's trained devices to score the new
    global model and their own; their weighted accuracies, or None when nobody answered in time."""
    nodes = sample(phase.answered, ctx.cfg.evaluation.devices, ctx.cfg.train.seed, server_round, EVAL_STREAM)
    messages = ctx.strategy.evaluate_messages(server_round, phase.record, [int(n) for n in nodes], phase.deadline_s)
    ids = ctx.mailbox.push(messages, "evaluate", server_round)
    pulled = ctx.mailbox.collect(ids, phase.eval_bound_s, server_round, "evaluate")
    replies = ctx.members.take(pulled, connected_nodes(grid), server_round)
    accuracy = ctx.strategy.aggregate_evaluate(server_round, replies)
    return None if accuracy is None else dict(accuracy)


def finetune_time(cfg: FleetConfig, state: ServerState) -> float:
    """The slowest evaluated device's fine-tuning (personalization.finetune_steps), each held to ``time_band``
    times what those steps take it when it trains fully (from the full-round time it joined with): a
    device reporting an hour cannot stop the clock."""
    longest = 0.0
    for row in state.replies.evaluation:
        member = state.roster.get(str(row.get("node_id")))
        if keys.FINETUNE_TIME_S not in row or member is None:
            continue
        cap = cfg.robust.time_band * member["profile_s"] * cfg.personalization.finetune_steps / compute_steps(cfg)
        longest = max(longest, min(float(row[keys.FINETUNE_TIME_S]), cap))
    return longest


def annotate_devices(
    rows: list[dict], classes: FleetClasses, sent: dict[str, np.ndarray], personal: frozenset[str]
) -> None:
    """Each device row's class (simulated device classes) and round speedup (compute plus upload,
    against training and uploading every shared tensor of ``sent``, the global arrays the round started from)."""
    full_bytes = shared_bytes(sent, personal)
    for d in rows:
        name = d.get("device")
        class_name = classes.class_name(name)
        if class_name is not None:
            d["class"] = class_name
        if "predicted_time_s" in d:
            d["round_speedup"] = round_speedup(d, full_bytes, classes.bandwidth(name))


def run_round(
    grid: Grid, ctx: RoundContext, arrays: dict[str, np.ndarray], server_round: int
) -> tuple[dict[str, np.ndarray], dict]:
    """One round: admit, sample, train, aggregate, evaluate, advance the clocks; (new global arrays, metrics record)."""
    state = ctx.strategy.state
    state.replies = RoundReplies()
    started = time.perf_counter()
    phase = train_phase(grid, ctx, arrays, server_round)
    rt = round_time(state.replies.train, ctx.classes.bandwidth)
    accuracy, t = None, time.perf_counter()
    if evaluates(ctx.cfg, server_round, state.sim_time_s + rt):
        accuracy = evaluate_phase(grid, ctx, phase, server_round)
        state.replies.lap("evaluate_s", t)
        rt += finetune_time(ctx.cfg, state)  # fine-tuning before evaluation is on the devices' clock
    wall = time.perf_counter() - started
    state.finish_round(server_round, rt, wall)
    ctx.mailbox.forget_old(server_round)
    rec = round_record(state, ctx.cfg.federation.strategy, phase.deadline_s, rt, accuracy, ctx.strategy.param_names)
    rec.update({"round_wall_s": wall, "wall_bound_s": phase.bound_s, **state.replies.attendance.as_dict()})
    annotate_devices(rec["devices"], ctx.classes, state.replies.sent, ctx.strategy.personal)
    if ctx.server_test is not None:
        t = time.perf_counter()
        rec["server_accuracy"] = server_accuracy(ctx.cfg, phase.arrays, ctx.server_test)
        state.replies.lap("server_eval_s", t)
    return phase.arrays, rec


@dataclass
class RoundContext:
    """What every round of a run shares: config, strategy (holding the state), mailbox, membership."""

    cfg: FleetConfig
    strategy: ElasticFedAvg
    mailbox: Mailbox
    members: Membership
    simulated: bool  # Flower's simulation engine: wall time says nothing about the simulated deadline
    classes: FleetClasses  # simulated device classes: who is online, at what uplink, in which class
    server_test: ArrayDataset | None = None  # evaluation.server_test: the global model is also scored on this


def run_fleet(grid: Grid, cfg: FleetConfig, *, resume: bool, simulated: bool = False) -> dict:
    """Run (or continue) the fleet until ``federation.rounds`` or, when set, until the
    simulated clock reaches ``federation.time_budget_s``; returns the summary."""
    fed = cfg.federation
    out = run_dir(cfg)
    arrays, state = start_state(cfg, out, resume)
    out.mkdir(parents=True, exist_ok=True)
    tracker = Tracker(out, resume_round=state.round if resume else None)
    classes = FleetClasses(cfg, simulated_names(cfg) if simulated else {})
    strategy = make_strategy(cfg, state, arrays, simulated, classes)
    mailbox = Mailbox(grid, lambda node: name_of(state.roster, str(node)))
    ctx = RoundContext(cfg, strategy, mailbox, Membership(cfg, state, mailbox), simulated, classes)
    if cfg.evaluation.server_test:
        ctx.server_test = server_test_set(cfg)
    wait_for_devices(grid, cfg)
    for server_round in range(state.round + 1, fed.rounds + 1):
        if out_of_time(cfg, state):
            print(
                f"simulated time {state.sim_time_s:.1f}s reached federation.time_budget_s; stopping after "
                f"round {state.round}",
                flush=True,
            )
            break
        arrays, record = run_round(grid, ctx, arrays, server_round)
        tracker.add(record)
        save_checkpoint(out, arrays, state)
        print(progress_line(record, fed.rounds), flush=True)
    summary = tracker.summary({"name": cfg.name, "strategy": fed.strategy, "run_dir": str(out)})
    plot_run(out, tracker.records, f"{cfg.name} ({fed.strategy})")
    return summary


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_config = dict(context.run_config)
    cfg = config_from_run_config(run_config)
    run_fleet(
        grid, cfg, resume=bool(run_config.get("resume", False)), simulated=bool(run_config.get("simulation", False))
    )

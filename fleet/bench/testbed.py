"""``fleet bench testbed``: FedAvg, naive and fleet on the same emulated fleet in real seconds, and the
simulator held to what the testbed measured.

Design notes:

* **One start, one budget.** FedAvg runs first, ``federation.rounds`` rounds, from a model pretrained on
  held-out samples; its wall clock is the budget. naive and fleet then start from the same checkpoint on
  the same devices and run until one of their rounds ends past that budget; only the rounds that ended
  within it count.
* **Real seconds, from the fleet's assembly.** A run's clock is the server's ``wall_time_s``, its rounds' wall
  seconds, counted from the moment its first round has every device's answer to its query: a device measures
  its timing and memory profiles as it joins, once and not once per job (a pi4 at 48 px: about 90 s), and
  that wait is the same work in every method. Each method's wait is reported apart (``assembly_s``).
* **A target FedAvg reaches late.** The accuracy the bench judges is the global model's on the server's
  balanced test split (``evaluation.server_test``: a thousand images, where the devices' own splits of tens
  each move by points from round to round). The target is FedAvg's final figure less one point, so FedAvg
  itself should reach it only in its last two rounds; a target FedAvg passes sooner tells no method apart,
  and the report says so (``fedavg_reaches_target_late``). Time to target is the clock when a method's
  figure first reaches it; "not reached" where it never does.
* **Accuracy over the budget.** A method's mean accuracy is the area under its accuracy-against-seconds
  step curve over the budget, divided by it: the start model's figure until its first round closes.
* **Two regimes.** simulations/testbed.yaml is upload-bound (ResNet-18 at 16 px: a pi4's upload outlasts
  its ten steps); simulations/testbed-compute.yaml makes training the slow part, as on a real board (48 px).
  The report names the regime the run measured: the slowest class's compute against its transfers under
  FedAvg (``compute`` at 2x or more), and holds fleet to that regime's speed target.
* **Where a device's round goes.** The server times each reply (``wall_s``: sending the message to pulling
  the reply); the device reports its compute (its training, and apart its scoring inside the message: the
  model it received and its personalized one) and ``ready_s`` (its ClientApp's age when its work starts);
  the transfers are the bytes at the link's rate; the rest is neither (the start, polling, serialization,
  its state). The overhead share counts scoring as compute: it is the device's own model work, which
  FedAvg's devices do too.
* **The simulator against it.** ``fleet simulate`` runs the fleet method with one class per testbed class:
  its devices' own measured profile, its uplink and downlink, and as its start everything else a round cost
  the class in FedAvg's rounds (the median ``wall_s`` less compute and transfers, :func:`class_fixed_s`: the
  start alone left 13-21 s a round out; FedAvg is another run than the one it is compared with), with the
  testbed's pipelined evaluation.
  Per class, predicted and measured round are medians over rounds of the class's slowest device.
  ``compute_upload_s`` keeps the older model's figure (compute and upload only), to show what start and
  download add.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from fleet.bench.figures import WALL_CLOCK, first_reaching, speedup, time_to_target
from fleet.engine.config import config_to_dict
from fleet.engine.device_profile import DeviceProfile
from fleet.federated.on_device.device import MEASURED_PROFILE
from fleet.federated.on_server.tracking import honest_rejections, honest_tensors_left_out, read_records
from fleet.federated.shared.class_config import DeviceClassConfig
from fleet.federated.shared.config import pipelined, run_dir
from fleet.federated.shared.names import DEVICES_DIR
from fleet.federated.shared.round_record import JSON_KEY, DeviceRow, RoundRecord, fields_json
from fleet.testbed.config import TestbedConfig, TestbedFleetConfig
from fleet.testbed.run import TestbedRun, assembly_s, run_testbed

METHODS = ("fedavg", "naive", "fleet")
ROUND_CAP = 3  # an elastic method may take this many times FedAvg's rounds to fill its budget
ACCURACY_SLACK, SIMULATOR_ERROR = 0.005, 0.15  # the targets the report checks
OVERHEAD_SHARE = 0.15  # at most this share of a slowest-class round may go to anything but compute and transfers
TARGET_DROP = 0.01  # the target is FedAvg's final accuracy less this: a figure FedAvg reaches only late
ACCURACY = "server_accuracy"  # the figure the bench judges: the server's balanced test split
# How much sooner than FedAvg fleet should reach the target, by the regime a run measured (regime_of).
SPEED_TARGETS = {"upload": 2.0, "compute": 3.0}
COMPUTE_RATIO = 2.0  # a compute regime: the slowest class computes at least 2x its transfer time under FedAvg


def method_config(cfg: TestbedFleetConfig, method: str, rounds: int, weights: str | None) -> TestbedFleetConfig:
    """``cfg`` for one method: its own run name, strategy and rounds, the shared start."""
    fed = dataclasses.replace(cfg.federation, strategy=method, rounds=rounds)
    model = dataclasses.replace(cfg.model, weights=weights) if weights else cfg.model
    return dataclasses.replace(cfg, name=f"{cfg.name}-{method}", federation=fed, model=model)


def within(records: list[RoundRecord], budget_s: float | None) -> list[RoundRecord]:
    """The rounds that ended within the wall-clock budget (all of them without one)."""
    return [r for r in records if budget_s is None or r.wall_time_s <= budget_s + 1e-9]


def mean_accuracy(curve: list[list], start: float | None, budget_s: float) -> float | None:
    """The area under the step curve of ``(seconds, accuracy)`` over ``[0, budget_s]``, divided by the
    budget: ``start`` (the start model's figure) until the first point, each point's until the next."""
    if start is None or budget_s <= 0:
        return None
    area, t, acc = 0.0, 0.0, start
    for when, value in curve:
        if value is None or when > budget_s + 1e-9:
            continue
        area += acc * (when - t)
        t, acc = when, value
    return (area + acc * (budget_s - t)) / budget_s


def last_evaluated(records: list[RoundRecord], key: str) -> float | None:
    """The last figure ``key`` (a :class:`RoundRecord` accuracy) the rounds made; None if none was."""
    values = [v for r in records if (v := getattr(r, key)) is not None]
    return values[-1] if values else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


@dataclass
class DeviceFigures:
    """A device in one method's run, as the report keeps it (its ``devices``): medians over its rounds within the
    budget, where a round went, and what it cost."""

    device_class: str = field(default="", metadata={JSON_KEY: "class"})
    cpu: float | None = None  # its class's CPU share; None: unlimited
    rounds: int = 0
    round_s: float | None = None  # the server's wall seconds from its message to its reply
    compute_s: float | None = None  # its training
    # its scoring: the model it received (the last round's evaluation, riding on this message) and its personalized
    # model on its held-out split; the device's own model work, as training is, which the overhead does not count
    scoring_s: float | None = None
    ready_s: float | None = None  # its ClientApp's age when its work started
    upload_s: float | None = None  # its bytes at its link's rate
    download_s: float | None = None
    overhead_share: float | None = None  # the share of its round neither compute (training, scoring) nor transfer
    trained_fraction: float = 0.0
    bytes_uploaded: int = 0
    link_bytes_sent: int | None = None  # what its link carried up over the whole run, Flower's framing included
    link_bytes_received: int | None = None  # ... and down
    memory_peak_mb: float | None = None
    oom_kills: int = 0


def device_entries(run: TestbedRun, records: list[RoundRecord], download_bytes: int) -> dict[str, DeviceFigures]:
    """Per device: its measured round, compute, start and transfers (medians over its rounds), its
    trained fraction, bytes and memory."""
    out = {}
    for name, cls in sorted(run.classes.items()):
        rows = [d for r in records for d in r.devices if d.device == name and d.wall_s is not None]
        if not rows:
            continue
        peak, kills = run.memory.get(name, (None, 0))
        sent, received = run.traffic.get(name, (None, None))
        upload = [8 * d.bytes_uploaded / (cls.uplink_mbps * 1e6) for d in rows]
        download = 8 * download_bytes / (cls.downlink_mbps * 1e6)
        scoring = [(d.train_eval_time_s or 0.0) + (d.score_time_s or 0.0) for d in rows]
        work = [d.measured_time_s + s + up + download for d, s, up in zip(rows, scoring, upload, strict=True)]
        out[name] = DeviceFigures(
            device_class=cls.name,
            cpu=cls.cpu,
            rounds=len(rows),
            round_s=_median([d.wall_s for d in rows]),
            compute_s=_median([d.measured_time_s for d in rows]),
            scoring_s=_median(scoring),
            ready_s=_median([d.ready_s for d in rows if d.ready_s is not None]),
            upload_s=_median(upload),
            download_s=download,
            overhead_share=_median([1 - w / d.wall_s for d, w in zip(rows, work, strict=True) if d.wall_s]),
            trained_fraction=statistics.fmean(d.trained_fraction for d in rows),
            bytes_uploaded=sum(d.bytes_uploaded for d in rows),
            link_bytes_sent=sent,
            link_bytes_received=received,
            memory_peak_mb=peak,
            oom_kills=kills,
        )
    return out


def download_bytes(cfg: TestbedFleetConfig) -> int:
    """The global model's size: what every train and evaluate message carries down, as the coordinator
    counts it for the simulator's download."""
    from fleet.federated.on_server.coordinator import shared_bytes
    from fleet.federated.on_server.server_run import initial_arrays

    return shared_bytes(initial_arrays(cfg), frozenset(), cfg.federation.transfer)


def method_entry(
    run: TestbedRun, budget_s: float, target: float, start: float | None, devices: dict[str, DeviceFigures]
) -> dict:
    """One method's figures over its rounds within the budget; ``devices``: its :func:`device_entries` over them."""
    records = within(run.records, budget_s)
    curve = [[r.wall_time_s, getattr(r, ACCURACY)] for r in records]
    hit = first_reaching(records, target, ACCURACY)
    return {
        "rounds": len(records),
        "assembly_s": assembly_s(run.records),  # before its clock starts: every device's join, its profiling
        "wall_s": records[-1].wall_time_s if records else 0.0,
        "time_to_target_s": time_to_target(records, target, clock=WALL_CLOCK, key=ACCURACY),
        "target_round": None if hit is None else hit.round,
        "final_server_accuracy": last_evaluated(records, ACCURACY),
        "mean_accuracy": mean_accuracy(curve, start, budget_s),
        "final_accuracy": last_evaluated(records, "global_accuracy"),
        "honest_rejected": honest_rejections(records),  # nobody attacks here
        "honest_tensors_left_out": honest_tensors_left_out(records),
        "personalized_accuracy_mean": last_evaluated(records, "personal_accuracy"),
        "curve": curve,
        "devices": {name: fields_json(d) for name, d in devices.items()},
    }


def start_accuracy(cfg: TestbedFleetConfig) -> float:
    """The start model's (``model.weights``) figure on the server's test split: every method's curve
    begins there."""
    from fleet.federated.on_server.server_eval import server_accuracy, server_test_set
    from fleet.federated.on_server.server_run import initial_arrays

    return server_accuracy(cfg, initial_arrays(cfg), server_test_set(cfg))


def class_start_s(run: TestbedRun, cls: str) -> float:
    """The median ``ready_s`` of a class's devices over a run's rounds: what every message costs them."""
    names = {n for n, c in run.classes.items() if c.name == cls}
    ready = [d.ready_s for r in run.records for d in r.devices if d.device in names]
    return _median([v for v in ready if v is not None]) or 0.0


def class_fixed_s(run: TestbedRun, cls: str, down_bytes: int) -> float:
    """What a round cost a class's devices beyond compute, upload and download, as a run (FedAvg's) measured
    it: the median over their rounds of ``wall_s`` less those three. It holds the message's start
    (``ready_s``), the scoring, and the rest of the message's way through Flower that no figure of the device
    names (docs/results.md: about 17 s of a pi4's round)."""
    rest = []
    for r in run.records:
        for d in r.devices:
            c = run.classes.get(d.device or "")
            if c is None or c.name != cls or d.wall_s is None or d.measured_time_s is None:
                continue
            transfers = 8 * d.bytes_uploaded / (c.uplink_mbps * 1e6) + 8 * down_bytes / (c.downlink_mbps * 1e6)
            rest.append(d.wall_s - d.measured_time_s - transfers)
    return max(0.0, _median(rest) or 0.0)


def class_profile(run: TestbedRun, cls: str) -> Path:
    """The profile the class's first device measured under its limits, in its state folder."""
    return run.run_dir / DEVICES_DIR / f"{cls}-0" / MEASURED_PROFILE


def simulation_config(
    cfg: TestbedFleetConfig, fleet: TestbedRun, fixed: dict[str, float], rounds: int
) -> TestbedFleetConfig:
    """The fleet method in Flower's simulation, a device class per testbed class: its devices' profile
    as measured under their limits, its links, and as its start ``fixed`` of its class: what else a round
    cost it beyond compute and transfers, as FedAvg's rounds measured it (:func:`class_fixed_s`)."""
    total, classes = cfg.testbed.num_devices, []
    for c in cfg.testbed.classes:
        classes.append(
            DeviceClassConfig(
                name=c.name,
                share=c.count / total,
                profile=str(class_profile(fleet, c.name)),
                bandwidth_mbps=c.uplink_mbps,
                downlink_mbps=c.downlink_mbps,
                start_s=round(fixed[c.name], 3),
            )
        )
    devices = dataclasses.replace(cfg.devices, num_devices=total, newcomers=0, device_classes=classes)
    sim = method_config(cfg, "fleet", rounds, cfg.model.weights)
    # the rounds the testbed ran: evaluation riding on the next round's training where it was deployed
    evaluation = dataclasses.replace(cfg.evaluation, pipelined=pipelined(cfg, simulated=False))
    return dataclasses.replace(
        sim, name=f"{cfg.name}-simulated", devices=devices, evaluation=evaluation, testbed=TestbedConfig()
    )


def simulate(cfg: TestbedFleetConfig, log) -> list[RoundRecord]:
    """Run ``cfg`` with ``fleet simulate`` (its own session, killed whole); its metrics.jsonl records."""
    from fleet.base.errors import FleetError
    from fleet.bench.launch import HONEST_APP, launch

    path = run_dir(cfg).parent / f"{cfg.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    failed = launch(path, HONEST_APP, timeout_s=3600, echo=lambda line: None)
    if failed is not None:
        raise FleetError(f"the simulation of the testbed's classes failed ({failed}); see {run_dir(cfg)}")
    return read_records(run_dir(cfg))


def slowest_by_class(
    records: list[RoundRecord], figure: Callable[[DeviceRow], float | None], class_of: Callable[[DeviceRow], str | None]
) -> dict[str, float]:
    """Per class, the median over rounds of its slowest device's ``figure``."""
    per_round: dict[str, list[float]] = {}
    for r in records:
        worst: dict[str, float] = {}
        for d in r.devices:
            cls, value = class_of(d), figure(d)
            if cls is not None and value is not None:
                worst[cls] = max(worst.get(cls, 0.0), float(value))
        for cls, v in worst.items():
            per_round.setdefault(cls, []).append(v)
    return {cls: statistics.median(v) for cls, v in per_round.items()}


def compute_upload_s(row: DeviceRow) -> float | None:
    """A simulated row's round by the simulator's older model: compute and upload alone, without its fixed
    start and download."""
    return None if row.round_time_s is None else row.round_time_s - (row.fixed_s or 0.0)


def class_entries(
    cfg: TestbedFleetConfig,
    fleet: TestbedRun,
    fedavg: TestbedRun,
    simulated: list[RoundRecord],
    fixed: dict[str, float],
) -> dict:
    """Per testbed class: its limits, its measured full step, and its measured against predicted round."""
    measured = slowest_by_class(fleet.records, lambda d: d.wall_s, lambda d: _class(fleet, d))
    predicted = slowest_by_class(simulated, lambda d: d.round_time_s, lambda d: d.device_class)
    older = slowest_by_class(simulated, compute_upload_s, lambda d: d.device_class)
    out = {}
    for c in cfg.testbed.classes:
        ran = next(k for n, k in fleet.classes.items() if k.name == c.name)
        profile = class_profile(fleet, c.name)
        m, p = measured.get(c.name), predicted.get(c.name)
        out[c.name] = {
            "cpu": ran.cpu,
            "memory_mb": c.memory_mb,
            "uplink_mbps": c.uplink_mbps,
            "downlink_mbps": c.downlink_mbps,
            "measured_full_step_s": DeviceProfile.load(profile).full_step_time if profile.is_file() else None,
            "start_s": class_start_s(fedavg, c.name),
            "fixed_s": fixed[c.name],  # the simulator's start: all but compute and transfers
            "measured_round_s": m,
            "predicted_round_s": p,
            "compute_upload_s": older.get(c.name),
            "error": None if not (m and p) else p / m - 1,
        }
    return out


def _class(run: TestbedRun, row: DeviceRow) -> str | None:
    cls = run.classes.get(row.device or "")
    return None if cls is None else cls.name


def memory_entries(runs: dict[str, TestbedRun]) -> dict[str, dict]:
    """Per device under a memory limit, per method: its activation budget against an unplanned step's
    activation peak (the device's memory profile), its cgroup's peak, OOM kills, and the rounds it was
    sampled for against those it trained and answered (a reply the server's screen then rejected was
    trained all the same: the limit held; ``rejected`` counts them)."""
    out: dict[str, dict] = {}
    for method, run in runs.items():
        for name, cls in run.classes.items():
            if cls.memory_mb is None:
                continue
            path = run.run_dir / DEVICES_DIR / name / "memory-profile.json"
            unplanned = json.loads(path.read_text())["measured_peak_bytes"] if path.is_file() else None
            rows = [d for r in run.records for d in r.devices if d.device == name and d.steps is not None]
            peak, kills = run.memory.get(name, (None, 0))
            out.setdefault(name, {})[method] = {
                "memory_mb": cls.memory_mb,
                "budget_mb": (rows[0].memory_budget_bytes or 0) / 2**20 if rows else None,
                "unplanned_activation_peak_mb": None if unplanned is None else unplanned / 2**20,
                "planned_activation_peak_mb": max((d.memory_peak_bytes or 0 for d in rows), default=0) / 2**20,
                "cgroup_peak_mb": peak,
                "oom_kills": kills,
                "rounds": sum(name in r.sampled for r in run.records),
                "rounds_trained": sum(name in r.sampled and name not in r.missed for r in run.records),
                "rejected": sum(e.device == name for r in run.records for e in r.rejections),
            }
    return out


def slowest_class(devices: dict[str, DeviceFigures]) -> list[DeviceFigures]:
    """A method's devices of the lowest CPU share (a pi4's class); none if every class is unlimited."""
    limited = [d for d in devices.values() if d.cpu is not None]  # an unlimited class is not slow
    return [d for d in limited if d.cpu == min(d.cpu for d in limited)]


def regime_ratio(fedavg: dict[str, DeviceFigures]) -> float | None:
    """The slowest class's compute against its transfers (upload and download) under FedAvg's devices: the
    median over that class's devices of their median rounds."""
    ratios = [d.compute_s / (d.upload_s + d.download_s) for d in slowest_class(fedavg)]
    return statistics.median(ratios) if ratios else None


def overhead_share(methods: dict[str, dict[str, DeviceFigures]]) -> float | None:
    """The largest, over methods (each its devices), of the median share of a slowest-class device's round that
    is neither compute (training and scoring) nor transfer: what a round costs beyond the device's own work."""
    shares = [
        statistics.median(found)
        for devices in methods.values()
        if (found := [d.overhead_share for d in slowest_class(devices) if d.overhead_share is not None])
    ]
    return max(shares, default=None)


def regime_of(ratio: float | None) -> str:
    """compute where the slowest class computes at least :data:`COMPUTE_RATIO` x its transfer time, else
    upload: the regime is measured, not claimed by the config."""
    return "compute" if ratio is not None and ratio >= COMPUTE_RATIO else "upload"


def targets(report: dict) -> dict[str, bool | None]:
    """Each target of the bench, met or not (None: not measurable in this run)."""
    methods, speed = report["methods"], report["fleet"]["speedup_vs_fedavg"]
    fedavg, fleet = methods["fedavg"]["final_server_accuracy"], methods["fleet"]["final_server_accuracy"]
    late, errors = methods["fedavg"]["target_round"], [c["error"] for c in report["classes"].values()]
    overhead = report["overhead_share"]
    memory = [m for device in report["memory"].values() for m in device.values()]
    need = SPEED_TARGETS[report["regime"]]
    return {
        "fedavg_reaches_target_late": None if late is None else late >= methods["fedavg"]["rounds"] - 1,
        f"fleet_{need:g}x_sooner_than_fedavg": None if speed is None else speed >= need,
        "fleet_final_within_half_a_point": None if None in (fedavg, fleet) else fleet >= fedavg - ACCURACY_SLACK,
        "slowest_class_overhead_at_most_15pct": None if overhead is None else overhead <= OVERHEAD_SHARE,
        "simulator_within_15pct_every_class": None
        if None in errors
        else all(abs(e) <= SIMULATOR_ERROR for e in errors),
        "memory_limited_devices_train_to_the_end": None
        if not memory
        else all(m["oom_kills"] == 0 and m["rounds_trained"] == m["rounds"] for m in memory),
    }


def bench_config(cfg: TestbedFleetConfig) -> TestbedFleetConfig:
    """``cfg`` as the bench runs it: the server scores the global model on its balanced test split."""
    return dataclasses.replace(cfg, evaluation=dataclasses.replace(cfg.evaluation, server_test=True))


def run_methods(cfg: TestbedFleetConfig, rounds: int, log) -> tuple[dict[str, TestbedRun], TestbedFleetConfig]:
    """FedAvg for ``rounds`` rounds, then naive and fleet for its wall clock, all from one start;
    returns the runs and ``cfg`` with that start as its weights."""
    cfg = bench_config(cfg)
    fedavg = from_assembly(run_testbed(method_config(cfg, "fedavg", rounds, None), [], log))
    start = fedavg.run_dir / "pretrained.pt"
    if cfg.model.weights is None and start.is_file():
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, weights=str(start)))
    budget = fedavg.records[-1].wall_time_s
    runs = {"fedavg": fedavg}
    for method in METHODS[1:]:
        log(f"bench: {method} for FedAvg's {budget:.0f} wall seconds, from the same start")
        run = run_testbed(method_config(cfg, method, ROUND_CAP * rounds, cfg.model.weights), [], log, budget)
        runs[method] = from_assembly(run)
    return runs, cfg


def from_assembly(run: TestbedRun) -> TestbedRun:
    """``run`` on the bench's clock: its rounds' wall seconds since the fleet assembled (:func:`assembly_s`)."""
    offset = assembly_s(run.records)
    return dataclasses.replace(
        run, records=[dataclasses.replace(r, wall_time_s=r.wall_time_s - offset) for r in run.records]
    )


def bench_testbed(cfg: TestbedFleetConfig, rounds: int, log) -> dict:
    """The whole bench: the three methods on the testbed, the simulator on its classes, the report."""
    runs, cfg = run_methods(cfg, rounds, log)
    down, start = download_bytes(cfg), start_accuracy(cfg)
    budget = runs["fedavg"].records[-1].wall_time_s
    target = (last_evaluated(runs["fedavg"].records, ACCURACY) or 0.0) - TARGET_DROP
    devices = {m: device_entries(runs[m], within(runs[m].records, budget), down) for m in METHODS}
    methods = {m: method_entry(runs[m], budget, target, start, devices[m]) for m in METHODS}
    log(f"bench: the simulator on the testbed's classes, {len(runs['fleet'].records)} rounds of fleet")
    fixed = {c.name: class_fixed_s(runs["fedavg"], c.name, down) for c in cfg.testbed.classes}
    simulated = simulate(simulation_config(cfg, runs["fleet"], fixed, len(runs["fleet"].records)), log)
    report = {
        "config": cfg.name,
        "seed": cfg.train.seed,
        "budget_s": budget,
        "start_accuracy": start,
        "target_accuracy": target,
        "download_bytes": down,
        "compute_to_transfer": regime_ratio(devices["fedavg"]),
        "regime": regime_of(regime_ratio(devices["fedavg"])),
        "overhead_share": overhead_share(devices),
        "methods": methods,
        "classes": class_entries(cfg, runs["fleet"], runs["fedavg"], simulated, fixed),
        "memory": memory_entries(runs),
    }
    for m in METHODS[1:]:
        t, base = methods[m]["time_to_target_s"], methods["fedavg"]["time_to_target_s"]
        report[m] = {"speedup_vs_fedavg": speedup(base, t)}
    report["targets"] = targets(report)
    return report


def _pct(v: float | None) -> str:
    return "   n/a" if v is None else f"{100 * v:5.1f}%"


def _s(v: float | None) -> str:
    return "not reached" if v is None else f"{v:.0f}s"


def bench_table(report: dict) -> str:
    """The methods, then the classes (measured against predicted), then the targets."""
    lines = [
        f"{report['regime']} regime (the slowest class computes {report['compute_to_transfer'] or 0:.1f}x its "
        f"transfer time), seed {report['seed']}: target {_pct(report['target_accuracy'])} on the server's test "
        f"split (FedAvg's final less {100 * TARGET_DROP:g} point), start {_pct(report['start_accuracy'])}, "
        f"budget {report['budget_s']:.0f} wall seconds",
        f"{'method':>7} {'rounds':>6} {'to target':>11} {'final':>6} {'mean':>6} {'devices':>7} {'personal':>8} "
        f"{'speedup':>8}",
    ]
    for m, e in report["methods"].items():
        speed = (report.get(m) or {}).get("speedup_vs_fedavg")
        lines.append(
            f"{m:>7} {e['rounds']:>6} {_s(e['time_to_target_s']):>11} {_pct(e['final_server_accuracy']):>6} "
            f"{_pct(e['mean_accuracy']):>6} {_pct(e['final_accuracy']):>7} {_pct(e['personalized_accuracy_mean']):>8} "
            f"{'' if speed is None else f'{speed:.2f}x':>8}"
        )
    lines.append("final, mean (over the budget): the server's test split; devices: the devices' own splits")
    lines.append(
        f"{'class':>7} {'cpu':>5} {'up/down Mbit/s':>14} {'full step':>9} {'start':>6} "
        f"{'measured':>8} {'predicted':>9} {'error':>6} {'before':>7}"
    )
    for name, c in report["classes"].items():
        err = "   n/a" if c["error"] is None else f"{100 * c['error']:+5.0f}%"
        step = "n/a" if c["measured_full_step_s"] is None else f"{1000 * c['measured_full_step_s']:.0f} ms"
        lines.append(
            f"{name:>7} {c['cpu'] or 0:>5.2f} {c['uplink_mbps']:>6g}/{c['downlink_mbps']:<7g} {step:>9} "
            f"{c['start_s']:>5.1f}s {c['measured_round_s'] or 0:>7.1f}s {c['predicted_round_s'] or 0:>8.1f}s "
            f"{err:>6} {c['compute_upload_s'] or 0:>6.1f}s"
        )
    lines.append("rounds: medians of each class's slowest device; before: the simulator without start and download")
    share = report["overhead_share"]
    rest = "neither compute (training, scoring) nor transfer"
    lines.append(f"slowest class: {_pct(share).strip()} of a round {rest} (start, polling, the state)")
    lines += [f"  {'met' if ok else 'MISSED' if ok is False else 'n/a'}: {k}" for k, ok in report["targets"].items()]
    return "\n".join(lines)


def plot_bench(report: dict, stem: Path) -> list[Path]:
    """Accuracy against wall seconds per method (``<stem>-accuracy.png``); each class's measured
    against predicted round (``<stem>-classes.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, e in report["methods"].items():
        pts = [(0.0, report["start_accuracy"])] + [(t, a) for t, a in e["curve"] if a is not None]
        ax.step([t for t, _ in pts], [100 * a for _, a in pts], where="post", marker="o", label=m)
    ax.axhline(100 * report["target_accuracy"], color="grey", linestyle=":", label="target")
    ax.set(
        xlabel="wall-clock seconds",
        ylabel="global accuracy, server's test split (%)",
        title=f"emulated fleet, real time ({report['regime']} regime)",
    )
    ax.legend()
    paths = [stem.with_name(f"{stem.name}-accuracy.png")]
    fig.savefig(paths[0], dpi=120, bbox_inches="tight")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(report["classes"])
    for k, (key, label) in enumerate(
        (("measured_round_s", "measured"), ("predicted_round_s", "simulator"), ("compute_upload_s", "before"))
    ):
        ax.bar(
            [i + 0.27 * (k - 1) for i in range(len(names))],
            [report["classes"][n][key] or 0 for n in names],
            0.27,
            label=label,
        )
    ax.set_xticks(range(len(names)), names)
    ax.set(ylabel="round seconds (median, slowest device)", title="simulator against the testbed")
    ax.legend()
    paths.append(stem.with_name(f"{stem.name}-classes.png"))
    fig.savefig(paths[1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return paths

"""``fleet bench scale``: what a round costs in wall time and memory as the simulated fleet grows.

Each fleet size runs as ``fleet simulate`` would (:func:`fleet.bench.launch.launch`), from one
shared profile and pretrained start, with a :class:`~fleet.bench.launch.MemoryWatch` on its
processes. Per fleet it reports, over the rounds after the first (the first also starts Ray's
actors and loads the data):

* ``wall_s_per_round``: the server's wall time from sampling a round to its last evaluation
  reply, aggregation included, or to its aggregation when its evaluation rides on the next round's
  training (``evaluation.pipelined``: the scoring is then that round's work) (median);
* ``overhead_ratio``: that wall time over the devices' own work, the sampled devices' measured
  training and evaluation seconds divided by the parallel ClientApp workers (median). 1.0 would
  mean the round is nothing but training and evaluation; the rest is messaging, process and
  state overhead;
* ``peak_rss_bytes``: the whole simulation's peak (the largest sum of its processes' proportional
  set sizes), and ``peak_rss_bytes_by_process``: the driver's (ServerApp) and the largest ClientApp
  worker's own peaks;
* ``sim_s_per_round``: the simulated clock's advance per round (median);
* ``state_bytes``: the devices' saved state on disk as the run ends, and ``state_bytes_per_device`` its mean
  over the devices that keep any (the ones that trained), so a fleet that samples few does not flatter it.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fleet.base.errors import ConfigError
from fleet.bench.floor_app import BUSY_KEY, FLOOR_FILE
from fleet.bench.launch import HONEST_APP, Log, MemoryWatch, launch, progress_log, shared_start
from fleet.federated.launch.prepare import prepare
from fleet.federated.on_server.tracking import read_records
from fleet.federated.shared.config import load_fleet_config, run_dir
from fleet.federated.shared.names import DEVICES_DIR
from fleet.federated.shared.round_record import DeviceRow, RoundRecord

DEFAULT_CONFIG = "simulations/scale.yaml"
REPORT_FILE = "scale.json"
PLOT_FILE = "scale.png"
FLEETS = ((8, 8), (64, 16), (256, 16), (1000, 16), (1000, 32))  # (devices, sampled per round)
FLOOR_SERVER, FLOOR_CLIENT = "fleet.bench.floor_app:server", "fleet.bench.floor_app:app"


def parse_fleets(specs: Sequence[str]) -> list[tuple[int, int]]:
    """``["8:8", "256:16"]`` -> [(8, 8), (256, 16)], each checked."""
    fleets = []
    for spec in specs:
        try:
            devices, per_round = (int(x) for x in spec.split(":"))
        except ValueError:
            raise ConfigError(f"--fleets: {spec!r} is not DEVICES:PER_ROUND; use e.g. 256:16") from None
        if not 1 <= per_round <= devices:
            raise ConfigError(f"--fleets: {spec!r} samples {per_round} of {devices}; use 1 <= PER_ROUND <= DEVICES")
        fleets.append((devices, per_round))
    return fleets


def workers(client_cpus: float) -> int:
    """ClientApp actors running at once: Flower's Ray backend packs one per ``client_cpus`` CPUs."""
    return max(1, int((os.cpu_count() or 1) // client_cpus))


def round_figures(records: list[RoundRecord], parallel: int) -> dict[str, Any]:
    """Medians over the rounds after the first (all of them when there is only one); None for a fleet
    that recorded no round."""
    steady = records[1:] or records
    work = [sum(device_work(d) for d in r.devices) for r in steady]
    ratios = [r.round_wall_s / (w / parallel) for r, w in zip(steady, work) if w > 0]
    return {
        "first_round_wall_s": records[0].round_wall_s if records else None,
        "wall_s_per_round": median_of([r.round_wall_s for r in steady], None),
        "overhead_ratio": median_of(ratios, None),
        "sim_s_per_round": median_of([r.round_time_s for r in steady], None),
        "device_work_s_per_round": median_of(work, None),
    }


def state_figures(devices_dir: Path) -> dict[str, Any]:
    """The devices' state on disk: bytes in all, how many devices keep any, and the mean per such device."""
    sizes: dict[str, int] = {}
    for file in devices_dir.rglob("*") if devices_dir.is_dir() else ():
        if file.is_file():
            device = file.relative_to(devices_dir).parts[0]
            sizes[device] = sizes.get(device, 0) + file.stat().st_size
    total = sum(sizes.values())
    return {
        "state_bytes": total,
        "devices_with_state": len(sizes),
        "state_bytes_per_device": total / len(sizes) if sizes else 0.0,
    }


def device_work(row: DeviceRow) -> float:
    """A device's own seconds in a round: training, evaluating, and scoring its personalized model as its
    training ended (evaluation work its train reply carries)."""
    return sum(s or 0.0 for s in (row.measured_time_s, row.score_time_s, row.eval_time_s))


def floor_work(records: list[RoundRecord]) -> dict[str, Any]:
    """What a floor device sleeps for: the median seconds fleet's devices measured over the steady rounds, training
    (with the scoring its train reply carries) and evaluation apart; over all devices, and per tier
    (``train_s_by_tier``, keyed by the tier as text): an elastic fleet's slow tiers train less."""
    steady = records[1:] or records
    rows = [d for r in steady for d in r.devices]
    trainers = [d for d in rows if d.measured_time_s]
    train = [(d.tier, d.measured_time_s + (d.score_time_s or 0.0)) for d in trainers]
    evaluate = [(d.tier, d.eval_time_s) for d in rows if d.eval_time_s]
    return {
        "train_s": median_of([s for _, s in train]),
        "eval_s": median_of([s for _, s in evaluate]),
        "train_s_by_tier": by_tier(train),
        "eval_s_by_tier": by_tier(evaluate),
    }


def median_of(values: list[float], empty: float | None = 0.0) -> float | None:
    """The median, or ``empty`` when there are no values."""
    return statistics.median(values) if values else empty


def by_tier(pairs: list[tuple[float | None, float]]) -> dict[str, float]:
    """The median seconds per tier (the tier's exact repr as the key, for JSON), of the rows that name one."""
    tiers = sorted({t for t, _ in pairs if t is not None})
    return {repr(float(t)): median_of([s for u, s in pairs if u == t]) for t in tiers}


FLOORS = {False: "flower_floor", True: "flower_busy_floor"}  # busy -> the keys of that floor's figures


def run_floor(
    path: str, overrides: dict, work: dict[str, Any], timeout_s: float, log: Log, busy: bool = False
) -> dict[str, Any]:
    """Flower's own floor on the same fleet (:mod:`fleet.bench.floor_app`): its overhead ratio and wall time.
    ``busy``: its devices spin on their CPU for the work instead of sleeping (see the floor app)."""
    key = FLOORS[busy]
    floor_cfg = load_fleet_config(path, {**overrides, "name": f"{overrides['name']}-{key.split('_', 1)[1]}"})
    cfg, config_path = prepare(floor_cfg, resume=False, log=log)
    (run_dir(cfg) / FLOOR_FILE).write_text(json.dumps({**work, BUSY_KEY: busy}))
    how = "spin" if busy else "sleep"
    log(f"--- {cfg.name}: Flower's floor, devices {how} {work['train_s']:.2f}s + {work['eval_s']:.2f}s ---")
    error = launch(config_path, FLOOR_CLIENT, timeout_s, log, server_app=FLOOR_SERVER)
    figures = round_figures(read_records(run_dir(cfg)), workers(cfg.simulation.client_cpus))
    out = {
        f"{key}_overhead_ratio": figures["overhead_ratio"],
        f"{key}_wall_s_per_round": figures["wall_s_per_round"],
        f"{key}_work_s": work,
    }
    return {**out, f"{key}_error": error} if error is not None else out


def run_size(
    path: str, common: dict, devices: int, per_round: int, timeout_s: float, log: Log, floor: bool = True
) -> dict[str, Any]:
    """One fleet size: its simulation, launched and watched, and its figures; then Flower's floor on it."""
    name = load_fleet_config(path, common).name
    overrides = {
        **common,
        "name": f"{name}-{devices}-{per_round}",  # 1,000 devices run at 16 and at 32 a round
        "devices.num_devices": devices,
        "federation.devices_per_round": per_round,
    }
    cfg, config_path = prepare(load_fleet_config(path, overrides), resume=False, log=log)
    log(f"--- {cfg.name}: {devices} devices, {per_round} per round, {cfg.federation.rounds} rounds ---")
    watch = MemoryWatch()
    started = time.monotonic()
    error = launch(config_path, HONEST_APP, timeout_s, log, watch)
    records = read_records(run_dir(cfg))
    parallel = workers(cfg.simulation.client_cpus)
    entry = {
        "devices": devices,
        "per_round": per_round,
        "rounds": len(records),
        "workers": parallel,
        "run_wall_s": time.monotonic() - started,
        **round_figures(records, parallel),
        "peak_rss_bytes": watch.total,
        "peak_rss_bytes_by_process": {"server": watch.server, "worker": watch.worker},
        "run_dir": str(run_dir(cfg)),
    }
    entry.update(state_figures(run_dir(cfg) / DEVICES_DIR))
    if error is not None:
        entry["error"] = error
    shutil.rmtree(run_dir(cfg) / DEVICES_DIR, ignore_errors=True)
    if floor and records:
        work = floor_work(records)
        for busy in FLOORS:
            entry.update(run_floor(path, overrides, work, timeout_s, log, busy))
    return entry


def bench_scale(
    path: str = DEFAULT_CONFIG,
    overrides: dict[str, Any] | None = None,
    *,
    fleets: Sequence[tuple[int, int]] = FLEETS,
    timeout_s: float = 1800.0,
    quiet: bool = False,
    floor: bool = True,
) -> dict[str, Any]:
    """Every fleet size in turn; the report is rewritten after each, so a killed bench keeps what it measured."""
    log = progress_log(quiet)
    overrides = dict(overrides or {})
    base = load_fleet_config(path, overrides)
    shared = shared_start(path, overrides, log)
    common = {**overrides, "hardware.profile": shared.hardware.profile, "model.weights": shared.model.weights}
    out = Path(base.output_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"config": str(path), "cpus": os.cpu_count(), "fleets": []}
    for devices, per_round in fleets:
        report["fleets"].append(run_size(path, common, devices, per_round, timeout_s, log, floor))
        (out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    report["plot"] = str(plot_scale(out / PLOT_FILE, report["fleets"]))
    report["report"] = str(out / REPORT_FILE)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    return report


def plot_scale(path: Path, fleets: list[dict]) -> Path:
    """Wall time per round and peak memory for each fleet (devices:per round, in the order run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(range(len(fleets)))  # one slot per fleet: 1,000 devices run at 16 and at 32 a round
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].plot(sizes, [f["wall_s_per_round"] or 0 for f in fleets], marker="o", label="wall s / round")
    axes[0].plot(sizes, [f["device_work_s_per_round"] or 0 for f in fleets], marker="s", label="device work s / round")
    floor = [f.get("flower_floor_wall_s_per_round") or 0 for f in fleets]
    axes[0].plot(sizes, floor, marker="^", label="Flower's floor: wall s / round")
    busy = [f.get("flower_busy_floor_wall_s_per_round") or 0 for f in fleets]
    axes[0].plot(sizes, busy, marker="v", label="Flower's floor, devices spinning: wall s / round")
    axes[0].set_ylabel("seconds")
    axes[1].plot(sizes, [f["peak_rss_bytes"] / 2**30 for f in fleets], marker="o", label="whole simulation (PSS)")
    for key, label in (("server", "server (driver)"), ("worker", "largest worker")):
        axes[1].plot(sizes, [f["peak_rss_bytes_by_process"][key] / 2**30 for f in fleets], marker="o", label=label)
    axes[1].set_ylabel("peak resident memory (GiB)")
    for ax in axes:
        ax.set_xticks(sizes, [f"{f['devices']}:{f['per_round']}" for f in fleets])
        ax.set_xlabel("devices in the fleet : sampled per round")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def scale_table(report: dict[str, Any]) -> str:
    heads = (("devices", 7), ("per rnd", 7), ("wall s/rnd", 10), ("overhead", 8), ("sim s/rnd", 9), ("peak GiB", 8))
    lines = [" ".join(f"{h:>{w}}" for h, w in (*heads, ("MB/device", 9), ("floor", 5), ("busy", 5)))]
    for f in report["fleets"]:
        wall, ratio, sim = f.get("wall_s_per_round"), f.get("overhead_ratio"), f.get("sim_s_per_round")
        lines.append(
            f"{f['devices']:>7} {f['per_round']:>7} {wall or 0:>10.1f} {ratio or 0:>8.2f} {sim or 0:>9.1f} "
            f"{f['peak_rss_bytes'] / 2**30:>8.2f} {f.get('state_bytes_per_device', 0) / 1e6:>9.1f} "
            f"{f.get('flower_floor_overhead_ratio') or 0:>5.2f} {f.get('flower_busy_floor_overhead_ratio') or 0:>5.2f}"
            + (f"  {f['error']}" if f.get("error") else "")
        )
    return "\n".join(lines)

"""Flower's own floor for ``fleet bench scale``: the same fleet and sampling, with apps that do nothing else.

What a round of Flower's simulation costs when the devices do no work of fleet's: the ServerApp is Flower's
own FedAvg sampling ``federation.devices_per_round`` of the fleet each round, for training and again for
evaluation, and the ClientApp sleeps for the seconds fleet's devices of its tier measured at the same fleet size
(the median over that tier; over all devices for a tier fleet never sampled), then returns the model it got. The
model is the fleet's, so every message carries what a FedAvg round would. Per tier, because an elastic fleet's
devices do not work alike (a slow tier trains less): with every device sleeping the same median, the floor's two
workers would finish together, where fleet's wait for each other's last device.

**The busy floor.** A sleeping device leaves its core free to Flower's own threads, and a computing one does not.
With ``busy`` the ClientApp spins on its CPU for the same seconds instead: Flower's floor with its cores as taken
as fleet's. It was added when Flower's thread that hands messages to the workers took a quarter to a half of a
core at 1,000 nodes (it asked every node every 0.1 s); fleet's launcher now asks only the nodes with a message
waiting (:mod:`fleet.commands.flower_dispatch`), for fleet's runs and both floors alike. Measured before that
change, the two floors came out level within 0.03 of overhead at 8 to 1,000 devices (docs/results.md).

The bench writes ``<run_dir>/floor.json`` (:func:`fleet.bench.scale.floor_work`, with ``busy``) before launching.
Each round the ServerApp appends the fields :func:`fleet.bench.scale.round_figures` reads to ``metrics.jsonl``
(``round_wall_s`` from sampling the round's trainers to aggregating its evaluations, and the seconds each device
reported it slept as its ``measured_time_s``/``eval_time_s``), so fleet's overhead ratio and the floor's are the
same arithmetic over the same kind of record.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fleet.engine.experiment import make_model
from fleet.federated.on_device.device import partition_of, tier_of
from fleet.federated.on_server.tracking import METRICS_FILE, read_records, summarize
from fleet.federated.shared.config import config_from_run_config, run_dir
from fleet.federated.shared.round_record import DeviceRow, RoundRecord

FLOOR_FILE = "floor.json"
FLOOR_STRATEGY = "flower-floor"  # its summary's strategy: Flower's FedAvg with devices that only sleep or spin
WORK_KEY = "work-s"  # the seconds a device sleeps for, in each message's config (and in its reply, as slept)
BUSY_KEY = "busy"  # floor.json: the devices spin on their CPU for their work instead of sleeping
TIERS_KEY, TIER_WORK_KEY = "tiers", "tier-work-s"  # a message's config: each tier's seconds (WORK_KEY: the rest)


class TimedFedAvg(FedAvg):
    """FedAvg that writes each round's wall time and its devices' slept seconds to ``metrics``."""

    def __init__(self, metrics: Path, **kwargs) -> None:
        super().__init__(**kwargs)
        self.metrics = metrics
        self.started: dict[int, float] = {}
        self.trained: dict[int, list[float]] = {}  # the seconds each trainer of the round reported it worked

    def configure_train(self, server_round: int, arrays, config, grid) -> Iterable[Message]:
        self.started[server_round] = time.perf_counter()
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        self.trained[server_round] = worked(replies)
        return super().aggregate_train(server_round, replies)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        replies = list(replies)
        out = super().aggregate_evaluate(server_round, replies)
        trained = self.trained.get(server_round, [])
        devices = [DeviceRow(measured_time_s=s, eval_time_s=0.0) for s in trained]
        devices += [DeviceRow(measured_time_s=0.0, eval_time_s=s) for s in worked(replies)]
        wall = time.perf_counter() - self.started[server_round]
        record = RoundRecord(round=server_round, round_wall_s=wall, devices=devices)
        with self.metrics.open("a") as f:
            f.write(json.dumps(record.to_json()) + "\n")
        print(f"floor round {server_round}: {wall:.2f}s wall, {len(trained)} trained", flush=True)
        return out


def worked(replies: list[Message]) -> list[float]:
    """The seconds each reply's device slept or spun for."""
    return [float(r.content["metrics"][WORK_KEY]) for r in replies if r.has_content()]


def work_config(work: dict, phase: str) -> ConfigRecord:
    """What a device of ``phase`` ("train" or "eval") works for: the fleet's per-tier medians, else its median."""
    by_tier = work.get(f"{phase}_s_by_tier") or {}
    return ConfigRecord(
        {
            WORK_KEY: float(work[f"{phase}_s"]),
            BUSY_KEY: bool(work.get(BUSY_KEY)),
            TIERS_KEY: [float(t) for t in by_tier],
            TIER_WORK_KEY: [float(v) for v in by_tier.values()],
        }
    )


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    cfg = config_from_run_config(dict(context.run_config))
    folder = run_dir(cfg)
    work = json.loads((folder / FLOOR_FILE).read_text())
    devices, per_round = cfg.devices.taking_part, cfg.federation.devices_per_round or cfg.devices.taking_part
    (folder / METRICS_FILE).write_text("")
    strategy = TimedFedAvg(
        folder / METRICS_FILE,
        fraction_train=per_round / devices,
        fraction_evaluate=per_round / devices,
        min_train_nodes=per_round,
        min_evaluate_nodes=per_round,
        min_available_nodes=devices,
    )
    strategy.start(
        grid,
        ArrayRecord(make_model(cfg.model, 0).state_dict()),
        num_rounds=cfg.federation.rounds,
        train_config=work_config(work, "train"),
        evaluate_config=work_config(work, "eval"),
    )
    summarize(read_records(folder), name=cfg.name, strategy=FLOOR_STRATEGY, run_dir=str(folder)).write(folder)


app = ClientApp()


def seconds_for(config: ConfigRecord, tier: float) -> float:
    """This device's seconds: its tier's median when the fleet measured that tier, else the fleet's median."""
    by_tier = dict(zip(config.get(TIERS_KEY, []), config.get(TIER_WORK_KEY, [])))
    return float(by_tier.get(tier, config[WORK_KEY]))


def work(config: ConfigRecord, tier: float = 1.0) -> float:
    """Sleep for the device's seconds, or with ``busy`` spin on the CPU for them, as a computing device holds its
    core; returns them."""
    seconds = seconds_for(config, tier)
    if not config.get(BUSY_KEY, False):
        time.sleep(seconds)
        return seconds
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return seconds


def device_tier(context: Context) -> float:
    """The tier fleet's own device of this node has (devices.tiers in turn by partition, or its class's)."""
    cfg = config_from_run_config(dict(context.run_config))
    node_config = dict(context.node_config)
    return tier_of(cfg, partition_of(cfg, node_config), node_config)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Sleep (or spin) for a fleet device's training seconds; return the model unchanged."""
    slept = work(msg.content["config"], device_tier(context))
    metrics = MetricRecord({"num-examples": 1, WORK_KEY: slept})
    return Message(content=RecordDict({"arrays": msg.content["arrays"], "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Sleep (or spin) for a fleet device's evaluation seconds."""
    slept = work(msg.content["config"], device_tier(context))
    return Message(content=RecordDict({"metrics": MetricRecord({"num-examples": 1, WORK_KEY: slept})}), reply_to=msg)

"""Flower's own floor for ``fleet bench scale``: the same fleet and sampling, with apps that do nothing else.

What a round of Flower's simulation costs when the devices do no work of fleet's: the ServerApp is Flower's
own FedAvg sampling ``federation.devices_per_round`` of the fleet each round, for training and again for
evaluation, and the ClientApp sleeps for the seconds a fleet device measured at the same fleet size, then
returns the model it got. The model is the fleet's, so every message carries what a FedAvg round would.

**The busy floor.** A sleeping device leaves its core free, and Flower's simulation needs one: its thread that
hands messages to the workers polls every node every 0.1 s and scans every stored message for each, which at
1,000 nodes took a quarter of a core (py-spy on the driver of a 1,000:16 fleet). fleet's devices compute, so
that thread takes its share from them. With ``busy`` the ClientApp spins on its CPU for the same seconds
instead: Flower's floor with its cores as taken as fleet's.

The bench writes ``<run_dir>/floor.json`` (``{"train_s": ..., "eval_s": ..., "busy": ...}``) before launching. Each round
the ServerApp appends the fields :func:`fleet.bench.scale.round_figures` reads to ``metrics.jsonl``
(``round_wall_s`` from sampling the round's trainers to aggregating its evaluations, and each device's
slept seconds as its ``measured_time_s``/``eval_time_s``), so fleet's overhead ratio and the floor's are the
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
from fleet.federated.config import config_from_run_config, run_dir
from fleet.federated.tracking import METRICS_FILE, SUMMARY_FILE

FLOOR_FILE = "floor.json"
WORK_KEY = "work-s"  # the seconds a device sleeps for, in each message's config
BUSY_KEY = "busy"  # floor.json: the devices spin on their CPU for their work instead of sleeping


class TimedFedAvg(FedAvg):
    """FedAvg that writes each round's wall time and its devices' slept seconds to ``metrics``."""

    def __init__(self, metrics: Path, work: dict[str, float], **kwargs) -> None:
        super().__init__(**kwargs)
        self.metrics, self.work = metrics, work
        self.started: dict[int, float] = {}
        self.trained: dict[int, int] = {}

    def configure_train(self, server_round: int, arrays, config, grid) -> Iterable[Message]:
        self.started[server_round] = time.perf_counter()
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.trained[server_round] = len(messages)
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        replies = list(replies)
        out = super().aggregate_evaluate(server_round, replies)
        trained, evaluated = self.trained.get(server_round, 0), len(replies)
        devices = [{"measured_time_s": self.work["train_s"], "eval_time_s": 0.0}] * trained
        devices += [{"measured_time_s": 0.0, "eval_time_s": self.work["eval_s"]}] * evaluated
        record = {
            "round": server_round,
            "round_wall_s": time.perf_counter() - self.started[server_round],
            "round_time_s": 0.0,
            "devices": devices,
        }
        with self.metrics.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"floor round {server_round}: {record['round_wall_s']:.2f}s wall, {trained} trained", flush=True)
        return out


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
        work,
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
        train_config=ConfigRecord({WORK_KEY: work["train_s"], BUSY_KEY: bool(work.get(BUSY_KEY))}),
        evaluate_config=ConfigRecord({WORK_KEY: work["eval_s"], BUSY_KEY: bool(work.get(BUSY_KEY))}),
    )
    (folder / SUMMARY_FILE).write_text(json.dumps({"floor": True, "rounds": cfg.federation.rounds, **work}))


app = ClientApp()


def work(config: ConfigRecord) -> None:
    """Sleep for the seconds, or with ``busy`` spin on the CPU for them, as a computing device holds its core."""
    seconds = float(config[WORK_KEY])
    if not config.get(BUSY_KEY, False):
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Sleep (or spin) for a fleet device's training seconds; return the model unchanged."""
    work(msg.content["config"])
    content = RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord({"num-examples": 1})})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Sleep (or spin) for a fleet device's evaluation seconds."""
    work(msg.content["config"])
    return Message(content=RecordDict({"metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

"""Flower ClientApp of one edge device (Message API).

train:    load the global tensors, derive ``rho`` from the server's deadline and this
          device's profile, train elastically, reply with only the trained tensors.
evaluate: accuracy of the global model and of this device's personalized model on
          its own held-out split.
query:    this device's full-training time for a round (the server's default deadline).

State that must outlive a round (personalized weights, momentum, importance) is
written atomically to a per-device directory: in deployment a new ClientApp
process starts for every message, so nothing in memory survives.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fleet.federated.round import RoundPlan, local_round
from fleet.federated.split import device_data
from fleet.federated.device import (
    build_model,
    device_memory,
    device_profile,
    load_state,
    memory_budget_of,
    partition_of,
    save_state,
    state_dir_of,
    tier_of,
)
from fleet.trainer import accuracy
from fleet.federated.config import FleetConfig, config_from_run_config

app = ClientApp()

STATE_FILE = "state.pt"


class InjectedFailure(RuntimeError):
    """Raised on purpose (federation.fail_device/fail_round) to test a device failing mid-round."""


def _setup(context: Context) -> tuple[FleetConfig, int, dict]:
    cfg = config_from_run_config(dict(context.run_config))
    node_config = dict(context.node_config)
    torch.set_num_threads(cfg.federation.client_threads)
    return cfg, partition_of(cfg, node_config), node_config


def _profile(cfg: FleetConfig, pid: int, node_config: dict, model=None):
    base = device_profile(cfg, model, node_config, state_dir_of(cfg, pid, node_config))
    return base.scaled(tier_of(cfg, pid, node_config))


@app.query()
def query(msg: Message, context: Context) -> Message:
    cfg, pid, node_config = _setup(context)
    profile = _profile(cfg, pid, node_config)
    metrics = MetricRecord(
        {
            "partition-id": pid,
            "tier": profile.speed_factor,
            "full-time-s": cfg.federation.local_steps * profile.full_step_time,
            "min-rho": profile.min_rho,
        }
    )
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg, pid, node_config = _setup(context)
    config = msg.content["config"]
    server_round = int(config["server-round"])
    if cfg.federation.fail_device == pid and cfg.federation.fail_round == server_round:
        raise InjectedFailure(f"device {pid} failed on purpose in round {server_round} (federation.fail_device)")
    model = build_model(cfg)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict(), strict=True)
    profile = _profile(cfg, pid, node_config, model)
    data = device_data(cfg, pid)
    state_dir = state_dir_of(cfg, pid, node_config)
    budget_mb = memory_budget_of(cfg, pid, node_config, profile)
    memory = device_memory(cfg, model, budget_mb, state_dir, node_config) if budget_mb is not None else None
    state_path = state_dir / STATE_FILE
    names = list(config.get("gi-names", []))
    values = list(config.get("gi-values", []))
    plan = RoundPlan(
        server_round=server_round,
        strategy=str(config.get("strategy", cfg.federation.strategy)),
        deadline_s=float(config.get("deadline-s", 0.0)),
        global_importance=dict(zip(names, values)),
    )
    run_tag = str(config.get("run-tag", ""))
    result = local_round(cfg, model, profile, data.train, load_state(state_path, run_tag), plan, pid, memory)
    save_state(state_path, {**result.state, "run_tag": run_tag})
    arrays = ArrayRecord.from_torch_state_dict(result.arrays)
    return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(result.metrics)}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    cfg, pid, node_config = _setup(context)
    data = device_data(cfg, pid)
    model = build_model(cfg)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict(), strict=True)
    global_acc = accuracy(model, data.test, cfg.data.input_size)
    run_tag = str(msg.content["config"].get("run-tag", "")) if "config" in msg.content.config_records else None
    state = load_state(state_dir_of(cfg, pid, node_config) / STATE_FILE, run_tag)
    personal_acc = global_acc  # a device that never trained is personalized to nothing yet
    if state and "personal" in state:
        model.load_state_dict(state["personal"], strict=True)
        personal_acc = accuracy(model, data.test, cfg.data.input_size)
    metrics = MetricRecord(
        {
            "partition-id": pid,
            "num-examples": len(data.test),
            "global-accuracy": global_acc,
            "personal-accuracy": personal_acc,
        }
    )
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)

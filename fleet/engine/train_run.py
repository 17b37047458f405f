"""``fleet train``: one method on one device, with a JSON record of what happened."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from fleet.base.atomic import write_json
from fleet.engine.accelerator import check_memory_budget, device_name, resolve_device
from fleet.engine.config import ExperimentConfig, config_to_dict
from fleet.engine.device_profile import DeviceProfile
from fleet.engine.experiment import check_model_fits_data, load_data, make_model, obtain_profile
from fleet.engine.trainer import EpochStats, Trainer


def experiment_dir(cfg: ExperimentConfig) -> Path:
    """Where one experiment's records go: ``output_dir/name`` (relative when ``output_dir`` is).

    Not :func:`fleet.federated.shared.config.run_dir`, which is a fleet run's absolute folder.
    """
    return Path(cfg.output_dir) / cfg.name


def format_epoch(method: str, epochs: int, s: EpochStats, total: int) -> str:
    acc = f"{100 * s.accuracy:5.1f}%" if s.accuracy is not None else "  n/a "
    return (
        f"[{method:>10}] epoch {s.epoch + 1}/{epochs}  acc {acc}  loss {s.loss:.3f}  "
        f"train {s.train_time_s:6.1f}s (predicted {s.predicted_time_s:6.1f}s)  trained {s.selected}/{total} tensors"
    )


def epoch_record(s: EpochStats) -> dict:
    return {
        "epoch": s.epoch + 1,
        "accuracy": s.accuracy,
        "loss": s.loss,
        "steps": s.steps,
        "train_time_s": s.train_time_s,
        "predicted_time_s": s.predicted_time_s,
        "probe_time_s": s.probe_time_s,
        "selected": s.selected,
    }


def trainer_record(trainer: Trainer, history: list[EpochStats], profile: DeviceProfile | None) -> dict:
    return {
        "method": trainer.config.method,
        "rho": trainer.config.rho if trainer.config.method == "elastic" else None,
        "final_accuracy": history[-1].accuracy if history else None,
        "train_time_s": sum(s.train_time_s for s in history),
        "probe_time_s": sum(s.probe_time_s for s in history),  # importance probes, inside train_time_s
        "probe_share": (
            sum(s.probe_time_s for s in history) / sum(s.train_time_s for s in history)
            if sum(s.train_time_s for s in history) > 0
            else None
        ),
        "predicted_time_s": sum(s.predicted_time_s for s in history),
        "epochs": [epoch_record(s) for s in history],
        "selections": [sel.summary(trainer.names) for sel in trainer.selections],
        "tensors": len(trainer.names),
        "device": device_name(trainer.device),  # what trained: cpu, or cuda with the GPU's name
        "precision": trainer.precision.dtype,
        "profile": None
        if profile is None
        else {"t_full_s": profile.full_step_time, "t_fw_s": profile.forward_time, "min_rho": profile.min_rho},
    }


def run_training(cfg: ExperimentConfig, log: Callable[[str], None] = print) -> tuple[dict, Path]:
    """Train ``cfg.train.method`` and write ``runs/<name>/train-<method>.json``."""
    if cfg.hardware.threads:
        torch.set_num_threads(cfg.hardware.threads)
    out = experiment_dir(cfg)
    device = resolve_device(cfg.train.device)
    check_memory_budget(device, cfg.hardware.memory_budget_mb, amp=cfg.train.amp)  # before any data is read
    train_ds, test_ds = load_data(cfg.data, cfg.train.seed)
    check_model_fits_data(cfg, train_ds, test_ds)
    model = make_model(cfg.model, cfg.train.seed)
    profile = obtain_profile(cfg, model, out / "device-profile.yaml", log=log)
    memory = None
    if cfg.hardware.memory_budget_mb is not None:
        from fleet.memory.budgeted import MemoryBudget

        shape = (cfg.train.batch_size, cfg.model.in_channels, cfg.data.input_size, cfg.data.input_size)
        memory = MemoryBudget.measure(
            model,
            shape,
            cfg.hardware.memory_budget_mb,
            cfg.hardware.spill_dir,
            model_name=cfg.model.name,
            cache=out / "memory-profile.json",
            device=device,
        )
        log(
            f"memory budget {cfg.hardware.memory_budget_mb:g} MB for activations "
            f"(unconstrained peak {memory.profile.unconstrained_peak_bytes / 1e6:.1f} MB); spill dir {memory.spill_dir}"
        )
    trainer = Trainer(model, cfg.train, profile, memory, input_size=cfg.data.input_size)
    log(
        f"training {cfg.model.name} with {cfg.train.method} on {len(train_ds)} samples "
        f"({train_ds.name}), testing on {len(test_ds)}"
    )
    history: list[EpochStats] = []
    started = time.time()
    for epoch in range(cfg.train.epochs):
        stats = trainer.train_epoch(train_ds, epoch)
        stats.accuracy = trainer.evaluate(test_ds)
        history.append(stats)
        log(format_epoch(cfg.train.method, cfg.train.epochs, stats, len(trainer.names)))
    record = {
        "name": cfg.name,
        **trainer_record(trainer, history, profile),
        "elapsed_s": time.time() - started,
        "memory": None
        if memory is None
        else {
            "budget_bytes": memory.budget_bytes,
            "unconstrained_peak_bytes": memory.profile.unconstrained_peak_bytes,
            "measured_peak_bytes": memory.peak_bytes,
            "plans": {
                str(fb): {
                    "actions": p.actions,
                    "predicted_peak_bytes": p.predicted_peak_bytes,
                    "added_time_s": p.added_time_s,
                }
                for fb, p in memory.plans.items()
            },
        },
        "config": config_to_dict(cfg),
        "host": profile.host if profile else {},
    }
    suffix = f"-rho{cfg.train.rho:g}" if cfg.train.method == "elastic" else ""
    path = write_json(out / f"train-{cfg.train.method}{suffix}.json", record)
    return record, path

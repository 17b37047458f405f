"""``fleet personalize``: every method personalizes the same pretrained model.

Methods advance epoch by epoch in turn (interleaved), so a slow spell on a
shared machine hits all of them alike and the time ratios stay honest.
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from fleet.base.atomic import write_json
from fleet.engine.config import ExperimentConfig, config_to_dict
from fleet.engine.experiment import load_data, make_model, obtain_profile
from fleet.engine.pretrain import ensure_pretrained
from fleet.engine.train_run import experiment_dir, format_epoch, trainer_record
from fleet.engine.trainer import EpochStats, Trainer
from fleet.federated.shared.paths import resolve_path


def personalize(
    cfg: ExperimentConfig, methods: Sequence[str] | None = None, log: Callable[[str], None] = print
) -> tuple[dict, Path]:
    methods = list(methods or cfg.methods)
    if cfg.hardware.profile is not None:  # a reference profile in profiles/ is found from any working directory
        profile_file = str(resolve_path(cfg.hardware.profile))
        cfg = dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, profile=profile_file))
        # checked before pretraining: a wrong file is a one-line error at once, not after minutes of training
        obtain_profile(cfg, make_model(dataclasses.replace(cfg.model, weights=None), cfg.train.seed))
    checkpoint = cfg.model.weights or str(ensure_pretrained(cfg, log))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, weights=checkpoint, reset_head=True))
    out = experiment_dir(cfg)
    train_ds, test_ds = load_data(cfg.data, cfg.train.seed)
    profile = obtain_profile(cfg, make_model(cfg.model, cfg.train.seed), out / "device-profile.yaml", log=log)
    trainers = {
        m: Trainer(
            make_model(cfg.model, cfg.train.seed),
            dataclasses.replace(cfg.train, method=m),
            profile,
            input_size=cfg.data.input_size,
        )
        for m in methods
    }
    start_accuracy = next(iter(trainers.values())).evaluate(test_ds)
    log(
        f"personalizing {cfg.model.name} from {checkpoint} on {len(train_ds)} samples of classes "
        f"{cfg.data.classes or 'all'} ({train_ds.name}); start accuracy {100 * start_accuracy:.1f}%"
    )
    histories: dict[str, list[EpochStats]] = {m: [] for m in methods}
    for epoch in range(cfg.train.epochs):
        for m, trainer in trainers.items():
            stats = trainer.train_epoch(train_ds, epoch)
            stats.accuracy = trainer.evaluate(test_ds)
            histories[m].append(stats)
            log(format_epoch(m, cfg.train.epochs, stats, len(trainer.names)))
    results = {m: trainer_record(trainers[m], histories[m], profile) for m in methods}
    if "full" in results:
        full = results["full"]
        for r in results.values():
            r["time_vs_full"] = r["train_time_s"] / full["train_time_s"] if full["train_time_s"] else None
            r["accuracy_vs_full_points"] = 100 * (r["final_accuracy"] - full["final_accuracy"])
    record = {
        "name": cfg.name,
        "start_accuracy": start_accuracy,
        "checkpoint": checkpoint,
        "train_samples": len(train_ds),
        "test_samples": len(test_ds),
        "profiling_time_s": profile.profiling_time_s,
        "full_epoch_time_s": results["full"]["epochs"][0]["train_time_s"] if "full" in results else None,
        "methods": results,
        "config": config_to_dict(cfg),
        "host": profile.host,
    }
    path = write_json(out / "personalize.json", record)
    write_csv(out / "personalize.csv", results)
    plot_personalize(out / "personalize.png", record)
    return record, path


def write_csv(path: Path, results: dict) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["method", "epoch", "accuracy", "loss", "train_time_s", "predicted_time_s", "selected"])
        for m, r in results.items():
            for e in r["epochs"]:
                w.writerow(
                    [m, e["epoch"], e["accuracy"], e["loss"], e["train_time_s"], e["predicted_time_s"], e["selected"]]
                )


def plot_personalize(path: Path, record: dict) -> None:
    """Accuracy against cumulative training time, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for m, r in record["methods"].items():
        times, accs, t = [0.0], [100 * record["start_accuracy"]], 0.0
        for e in r["epochs"]:
            t += e["train_time_s"]
            times.append(t)
            accs.append(100 * e["accuracy"])
        label = f"{m} (rho={r['rho']})" if r.get("rho") else m
        ax1.plot(times, accs, marker="o", label=label)
    ax1.set_xlabel("training wall time (s)")
    ax1.set_ylabel("test accuracy (%)")
    ax1.set_title("Accuracy while personalizing")
    ax1.grid(alpha=0.3)
    ax1.legend()
    names = list(record["methods"])
    finals = [100 * record["methods"][m]["final_accuracy"] for m in names]
    times = [record["methods"][m]["train_time_s"] for m in names]
    ax2.bar(names, times, color="tab:gray")
    ax2.set_ylabel("training wall time (s)")
    ax2.set_title("Final accuracy (labels) and time (bars)")
    for i, (t, a) in enumerate(zip(times, finals)):
        ax2.text(i, t, f"{a:.1f}%", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_table(record: dict) -> str:
    rows = [f"{'method':>11} {'accuracy':>9} {'train time':>11} {'vs full':>8} {'probes':>7}"]
    for m, r in record["methods"].items():
        ratio, share = r.get("time_vs_full"), r.get("probe_share")
        rows.append(
            f"{m:>11} {100 * r['final_accuracy']:8.2f}% {r['train_time_s']:10.1f}s "
            + (f"{ratio:7.2f}x" if ratio is not None else " " * 8)
            + (f" {100 * share:6.1f}%" if share else "")
        )
    return "\n".join(rows)

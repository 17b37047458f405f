"""Per-round, per-device tracking: runs/<name>/metrics.jsonl, summary.json and PNG plots.

The simulated clock: each device's time is its profile (times its tier) applied to
what it actually trained; a round lasts as long as its slowest device plus that
device's upload time (bytes / bandwidth).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np

from fleet.base.atomic import write_json, write_text_atomic
from fleet.federated.classes import FleetClasses
from fleet.federated.records import Accuracy, EvaluateReply, TrainReply
from fleet.federated.state import ServerState

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
# the last closed round and the run's wall seconds then: metrics.jsonl holds a round's line back until the next
# round's trainers have scored its model (evaluation.pipelined), so what acts between rounds reads this
PROGRESS_FILE = "progress.json"


def round_time(
    train: list[TrainReply], bandwidth: Callable[[str | None], float], fixed: Callable[[str | None], float]
) -> float:
    """The slowest device's round: its fixed cost (``fixed`` of its name: start and download), its
    simulated training time and its upload over its own uplink (``bandwidth`` of its name, bytes/s)."""
    return max((r.round_time_s(bandwidth(r.device), fixed(r.device)) for r in train), default=0.0)


def device_key(row: dict) -> str:
    """A row's device: its name (the server's roster), else its node id."""
    return str(row.get("device") or f"node-{row.get('node_id')}")


def device_name(reply: TrainReply | EvaluateReply) -> str:
    """A reply's device: its name (the server's roster), else its node id (as :func:`device_key` reads it)."""
    return reply.device or f"node-{reply.node_id}"


def device_rows(
    train: list[TrainReply],
    evaluation: list[EvaluateReply],
    classes: FleetClasses,
    full_bytes: int,
    fixed: Callable[[str | None], float] = lambda name: 0.0,
) -> list[dict]:
    """One row per device, by name: its train reply joined with its evaluation, its class (simulated
    device classes), its round on the simulated clock and its round speedup (against training and
    uploading all ``full_bytes``; ``fixed`` of its name is what its round costs whatever it trains).
    A device's test samples are ``test_examples`` and, when it also trained, its sample weight
    ``train_examples``."""
    trained = {device_name(r): r for r in train}
    evaluated = {device_name(e): e for e in evaluation}
    rows = []
    for name in sorted(trained.keys() | evaluated.keys()):
        t, e = trained.get(name), evaluated.get(name)
        row = {**(t.row() if t else {}), **(e.row() if e else {}), "device": name}
        if t is not None and e is not None and t.eval_time_s is not None and e.eval_time_s is not None:
            row["eval_time_s"] = t.eval_time_s + e.eval_time_s  # it also scored the model it received
        class_name = classes.class_name(name)
        if class_name is not None:
            row["class"] = class_name
        if t is not None:
            bandwidth, fixed_s = classes.bandwidth(name), fixed(name)
            row["round_time_s"] = t.round_time_s(bandwidth, fixed_s)
            if fixed_s:
                row["fixed_s"] = fixed_s  # of its round: its start and download
            row["round_speedup"] = t.round_speedup(full_bytes, bandwidth, fixed_s)
        rows.append(row)
    return rows


def with_evaluation(record: dict, evaluation: list[EvaluateReply], classes: FleetClasses, scored_in: int) -> dict:
    """A held round's record (``evaluation.pipelined``) with the evaluation the trainers of round ``scored_in``
    made of its model: each evaluated device's scores joined to its row (a row of its own if it did not train in
    the held round), and the round's accuracies as :func:`round_record` weighs them."""
    rows = {d["device"]: dict(d) for d in record["devices"]}
    for e in evaluation:
        name = device_name(e)
        row = rows.setdefault(name, {})
        row.update({**e.row(), "device": name})
        class_name = classes.class_name(name)
        if class_name is not None:
            row["class"] = class_name
    devices = [rows[name] for name in sorted(rows)]
    accuracy = Accuracy.of(evaluation)
    return {
        **record,
        "global_accuracy": None if accuracy is None else accuracy.global_accuracy,
        "personal_accuracy": None if accuracy is None else accuracy.personal_accuracy,
        "personal_accuracy_p10": p10([d["personal_accuracy"] for d in devices if "personal_accuracy" in d]),
        "evaluated_in_round": scored_in,
        "devices": devices,
    }


def round_record(
    state: ServerState,
    strategy: str,
    deadline_s: float,
    round_time_s: float,
    param_names: list[str],
    rows: list[dict],
) -> dict:
    """The metrics.jsonl line of the round ``state`` has just finished; ``rows``: its :func:`device_rows`."""
    accuracy = state.replies.accuracy
    return {
        "round": state.round,
        "strategy": strategy,
        "deadline_s": deadline_s,
        "round_time_s": round_time_s,
        "sim_time_s": state.sim_time_s,
        "wall_time_s": state.wall_time_s,
        "global_accuracy": None if accuracy is None else accuracy.global_accuracy,
        "personal_accuracy": None if accuracy is None else accuracy.personal_accuracy,
        "personal_accuracy_p10": p10([d["personal_accuracy"] for d in rows if "personal_accuracy" in d]),
        **finetuned_figures(accuracy, rows),
        "bytes_uploaded": int(sum(r.bytes_uploaded for r in state.replies.train)),
        "tensors_trained_by_nobody": sum(1 for k in param_names if k not in state.replies.senders),
        "rejections": [r.as_dict() for r in state.replies.rejections],
        "defense": state.replies.defense.as_dict(),
        "server_s": state.replies.timings,  # the server's wall seconds per part of the round
        "devices": rows,
    }


def finetuned_figures(accuracy: Accuracy | None, devices: list[dict]) -> dict:
    """A round's fine-tuned accuracy (personalization.finetune_steps): the weighted mean and p10; nothing without it."""
    if accuracy is None or accuracy.finetuned_accuracy is None:
        return {}
    tuned = [d["finetuned_accuracy"] for d in devices if "finetuned_accuracy" in d]
    return {"finetuned_accuracy": accuracy.finetuned_accuracy, "finetuned_accuracy_p10": p10(tuned)}


def read_records(run: Path) -> list[dict]:
    """A run folder's per-round records from its ``metrics.jsonl`` (none when it wrote none). The file is
    only appended to, so a line that does not parse is the last one, still being written or cut short by a
    crash: the records stop before it."""
    metrics = run / METRICS_FILE
    records: list[dict] = []
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def write_progress(run: Path, state: ServerState) -> None:
    write_json(run / PROGRESS_FILE, {"round": state.round, "wall_time_s": state.wall_time_s})


def read_progress(run: Path) -> tuple[int, float]:
    """The last closed round and the run's wall seconds at its close; (0, 0.0) before the first closes."""
    try:
        progress = json.loads((run / PROGRESS_FILE).read_text())
        return int(progress["round"]), float(progress["wall_time_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0, 0.0


def trained_rows(records: list[dict]) -> dict[str, list[dict]]:
    """Each device's rows of the rounds it trained in, with the round number, by device name."""
    per_device: dict[str, list[dict]] = {}
    for rec in records:
        for d in rec["devices"]:
            if "speedup" in d:
                per_device.setdefault(device_key(d), []).append({"round": rec["round"], **d})
    return per_device


def honest_rejections(records: list[dict], adversaries: Collection[str] = ()) -> int:
    """The replies the server rejected from devices not among ``adversaries``: in a fleet nobody attacks each is
    an honest device's round thrown away, which every bench reports and should find 0."""
    return sum(j.get("device") not in adversaries for r in records for j in r.get("rejections", []))


def p10(values: list[float]) -> float | None:
    return float(np.percentile(values, 10)) if values else None


class Tracker:
    """Appends one JSON line per round; on resume, drops lines past the checkpoint."""

    def __init__(self, out: Path, *, resume_round: int | None) -> None:
        self.out = out
        self.path = out / METRICS_FILE
        out.mkdir(parents=True, exist_ok=True)
        self.records: list[dict] = []
        if resume_round is not None and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a kill
                if rec.get("round", 10**9) <= resume_round:
                    self.records.append(rec)
        self._rewrite()

    def _rewrite(self) -> None:
        write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.records))

    def add(self, record: dict) -> None:
        self.records.append(record)
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def summary(self, extra: dict) -> dict:
        recs = self.records
        last = recs[-1] if recs else {}
        per_device = trained_rows(recs)
        personal = [d["personal_accuracy"] for d in last.get("devices", []) if "personal_accuracy" in d]
        tuned = [d["finetuned_accuracy"] for d in last.get("devices", []) if "finetuned_accuracy" in d]
        summary = {
            **extra,
            "rounds": len(recs),
            "sim_time_s": last.get("sim_time_s", 0.0),
            "final_accuracy": last.get("global_accuracy"),
            "final_server_accuracy": last.get("server_accuracy"),  # evaluation.server_test only
            "personalized_accuracy_mean": float(np.mean(personal)) if personal else None,
            "personalized_accuracy_p10": p10(personal),
            "finetuned_accuracy_mean": float(np.mean(tuned)) if tuned else None,  # personalization.finetune_steps only
            "finetuned_accuracy_p10": p10(tuned),
            "bytes_uploaded": int(sum(r["bytes_uploaded"] for r in recs)),
            "rejections": sum(len(r["rejections"]) for r in recs),
            "rounds_without_training": [r["round"] for r in recs if not any("speedup" in d for d in r["devices"])],
            "first_rejection": next((j["reason"] for r in recs for j in r["rejections"]), None),
            "classes": class_summary(recs),
            "devices": {
                name: {
                    **({"class": rows[-1]["class"]} if "class" in rows[-1] else {}),
                    "tier": rows[-1]["tier"],
                    "rounds_trained": len(rows),
                    **trained_means(rows),
                    "rho_mean": float(np.mean([r["rho"] for r in rows])),
                }
                for name, rows in sorted(per_device.items())
            },
            "history": [
                {
                    k: r[k]
                    for k in (
                        "round",
                        "sim_time_s",
                        "global_accuracy",
                        "personal_accuracy",
                        "personal_accuracy_p10",
                        "bytes_uploaded",
                    )
                }
                | {k: r[k] for k in ("server_accuracy", "finetuned_accuracy", "finetuned_accuracy_p10") if k in r}
                for r in recs
            ],
        }
        write_json(self.out / SUMMARY_FILE, summary)
        return summary


def trained_means(rows: list[dict]) -> dict:
    """What trained rows (one device's, or one class's) did on average, and the bytes they uploaded."""
    return {
        "speedup_mean": float(np.mean([r["speedup"] for r in rows])),
        "round_speedup_mean": float(np.mean([r.get("round_speedup", r["speedup"]) for r in rows])),
        "trained_fraction_mean": float(np.mean([r["trained_fraction"] for r in rows])),
        "bytes_uploaded": int(sum(r.get("bytes_uploaded", 0) for r in rows)),
    }


def class_summary(records: list[dict]) -> dict[str, dict]:
    """Per device class (devices.device_classes): what its devices' trained rounds did, and their
    personalized accuracy when last evaluated; empty without classes."""
    trained: dict[str, list[dict]] = {}
    last_eval: dict[str, dict] = {}
    for rec in records:
        for d in rec["devices"]:
            if "class" not in d:
                continue
            if "speedup" in d:
                trained.setdefault(d["class"], []).append(d)
            if "personal_accuracy" in d:
                last_eval[device_key(d)] = d
    out = {}
    for cls, rows in sorted(trained.items()):
        personal = [d["personal_accuracy"] for d in last_eval.values() if d["class"] == cls]
        out[cls] = {
            "devices_trained": len({device_key(d) for d in rows}),
            "device_rounds": len(rows),
            **trained_means(rows),
            "round_time_s_mean": float(np.mean([d["predicted_time_s"] for d in rows])),
            "personalized_accuracy_mean": float(np.mean(personal)) if personal else None,
        }
    return out


def progress_line(rec: dict, rounds: int) -> str:
    def pct(v):
        return f"{100 * v:5.1f}%" if isinstance(v, (int, float)) else "  n/a "

    speedups = [d.get("round_speedup", d["speedup"]) for d in rec["devices"] if "speedup" in d]  # whole rounds
    return (
        f"round {rec['round']:>3}/{rounds}  sim {rec['sim_time_s']:8.1f}s (+{rec['round_time_s']:.1f}s)  "
        f"global {pct(rec['global_accuracy'])}  personal {pct(rec['personal_accuracy'])}  "
        + (f"finetuned {pct(rec['finetuned_accuracy'])}  " if "finetuned_accuracy" in rec else "")
        + (f"server {pct(rec['server_accuracy'])}  " if "server_accuracy" in rec else "")
        + f"speedup {min(speedups, default=0):.2f}-{max(speedups, default=0):.2f}x  "
        f"up {rec['bytes_uploaded'] / 1e6:6.2f} MB  devices {len(speedups)}  rejected {len(rec['rejections'])}"
        + attendance_note(rec)
    )


def _names(names: list[str]) -> str:
    return ",".join(names) if len(names) <= 4 else f"{len(names)} devices"


def attendance_note(rec: dict) -> str:
    """Who missed, joined or was refused this round: said on the progress line only when it happened."""
    parts = [f"{key} {_names(rec[key])}" for key in ("missed", "joined") if rec.get(key)]
    for key in ("refused", "offline"):
        if rec.get(key):
            parts.append(f"{key} {len(rec[key])}")
    return ("  " + "  ".join(parts)) if parts else ""


MAX_LEGEND_DEVICES = 16  # a larger fleet's device plot has no legend


def plot_run(out: Path, records: list[dict], title: str) -> list[Path]:
    """Accuracy against simulated time and rounds; per-device speedup, trained fraction; bytes per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records:
        return []
    rounds = [r["round"] for r in records]
    evaluated = [r for r in records if r["global_accuracy"] is not None]  # evaluation.every skips rounds
    sim = [r["sim_time_s"] for r in evaluated]
    g = [r["global_accuracy"] for r in evaluated]
    p = [r["personal_accuracy"] for r in evaluated]
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, x, label in ((axes[0], sim, "simulated time (s)"), (axes[1], [r["round"] for r in evaluated], "round")):
        ax.plot(x, g, marker="o", label="global")
        ax.plot(x, p, marker="s", label="personalized (mean)")
        ax.set_xlabel(label)
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    paths.append(out / "accuracy.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    by_device = trained_rows(records)
    for name, rows in sorted(by_device.items()):
        xs = [r["round"] for r in rows]
        axes[0].plot(xs, [r["speedup"] for r in rows], marker=".", label=f"{name} ({rows[-1]['tier']:g}x)")
        axes[1].plot(xs, [r["trained_fraction"] for r in rows], marker=".", label=name)
    axes[0].set_title("speedup vs full training")
    axes[1].set_title("trained fraction of weights")
    axes[2].bar(rounds, [r["bytes_uploaded"] / 1e6 for r in records])
    axes[2].set_title("MB uploaded per round")
    for ax in axes:
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    if len(by_device) <= MAX_LEGEND_DEVICES:
        axes[0].legend(fontsize=7)
    else:  # hundreds of entries would not fit: the per-class plot names the kinds of device
        axes[0].set_title(f"speedup vs full training ({len(by_device)} devices)")
    fig.tight_layout()
    paths.append(out / "devices.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    classes = class_summary(records)
    if classes:
        paths.append(plot_classes(out / "classes.png", classes, title))
    return paths


def plot_classes(path: Path, classes: dict[str, dict], title: str) -> Path:
    """Per device class: mean speedup, trained fraction and personalized accuracy, side by side."""
    import matplotlib.pyplot as plt

    names = list(classes)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, label in (
        (axes[0], "round_speedup_mean", "round speedup vs training fully"),
        (axes[1], "trained_fraction_mean", "trained fraction of weights"),
        (axes[2], "personalized_accuracy_mean", "personalized accuracy (last evaluation)"),
    ):
        ax.bar(names, [classes[n][key] or 0.0 for n in names])
        ax.set_title(label)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{title}: per device class")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

"""Per-round, per-device tracking: runs/<name>/metrics.jsonl, summary.json and PNG plots.

The simulated clock: each device's time is its profile (times its tier) applied to
what it actually trained; a round lasts as long as its slowest device plus that
device's upload time (bytes / bandwidth).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np

from fleet.base.atomic import write_json, write_text_atomic
from fleet.federated.on_server.defense import SKEWED
from fleet.federated.on_server.membership import Attendance
from fleet.federated.on_server.state import ServerState
from fleet.federated.shared.classes import FleetClasses
from fleet.federated.shared.records import Accuracy, EvaluateReply, TrainReply
from fleet.federated.shared.round_record import DeviceRow, RejectionRow, RoundRecord
from fleet.federated.shared.run_summary import ClassSummary, DeviceSummary, RunSummary, history_of

METRICS_FILE = "metrics.jsonl"
# the last closed round and the run's wall seconds then: metrics.jsonl holds a round's line back until the next
# round's trainers have scored its model (evaluation.pipelined), so what acts between rounds reads this
PROGRESS_FILE = "progress.json"


def round_time(
    train: list[TrainReply], bandwidth: Callable[[str | None], float], fixed: Callable[[str | None], float]
) -> float:
    """The slowest device's round: its fixed cost (``fixed`` of its name: start and download), its
    simulated training time and its upload over its own uplink (``bandwidth`` of its name, bytes/s)."""
    return max((r.round_time_s(bandwidth(r.device), fixed(r.device)) for r in train), default=0.0)


def device_key(row: DeviceRow) -> str:
    """A row's device: its name (the server's roster), else its node id."""
    return str(row.device or f"node-{row.node_id}")


def device_name(reply: TrainReply | EvaluateReply) -> str:
    """A reply's device: its name (the server's roster), else its node id (as :func:`device_key` reads it)."""
    return reply.device or f"node-{reply.node_id}"


def device_rows(
    train: list[TrainReply],
    evaluation: list[EvaluateReply],
    classes: FleetClasses,
    full_bytes: int,
    fixed: Callable[[str | None], float] = lambda name: 0.0,
) -> list[DeviceRow]:
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
        row = DeviceRow.from_json({**(t.row() if t else {}), **(e.row() if e else {}), "device": name})
        if t is not None and e is not None and t.eval_time_s is not None and e.eval_time_s is not None:
            row.eval_time_s = t.eval_time_s + e.eval_time_s  # it also scored the model it received
        row.train_eval_time_s = None if t is None else t.eval_time_s
        row.device_class = classes.class_name(name)
        if t is not None:
            bandwidth, fixed_s = classes.bandwidth(name), fixed(name)
            row.round_time_s = t.round_time_s(bandwidth, fixed_s)
            row.fixed_s = fixed_s or None  # of its round: its start and download
            row.round_speedup = t.round_speedup(full_bytes, bandwidth, fixed_s)
        rows.append(row)
    return rows


def with_evaluation(
    record: RoundRecord, evaluation: list[EvaluateReply], classes: FleetClasses, scored_in: int
) -> RoundRecord:
    """A held round's record (``evaluation.pipelined``) with the evaluation the trainers of round ``scored_in``
    made of its model: each evaluated device's scores joined to its row (a row of its own if it did not train in
    the held round), and the round's accuracies as :func:`round_record` weighs them."""
    rows = {d.device: dataclasses.replace(d) for d in record.devices}
    for e in evaluation:
        name = device_name(e)
        scores = DeviceRow.from_json({**e.row(), "device": name})
        row = rows.setdefault(name, DeviceRow(device=name))
        rows[name] = dataclasses.replace(row, **{k: v for k, v in vars(scores).items() if v is not None})
        rows[name].device_class = classes.class_name(name) or rows[name].device_class
    devices = [rows[name] for name in sorted(rows)]
    record = dataclasses.replace(record, devices=devices, evaluated_in_round=scored_in)
    with_accuracy(record, Accuracy.of(evaluation))
    return record


def with_accuracy(record: RoundRecord, accuracy: Accuracy | None) -> None:
    """The round's accuracies from its evaluation, and the p10s of its rows: the one place they are made."""
    record.global_accuracy = None if accuracy is None else accuracy.global_accuracy
    record.personal_accuracy = None if accuracy is None else accuracy.personal_accuracy
    record.personal_accuracy_p10 = p10([d.personal_accuracy for d in record.devices if d.personal_accuracy is not None])
    if accuracy is not None and accuracy.finetuned_accuracy is not None:
        record.finetuned_accuracy = accuracy.finetuned_accuracy
        tuned = [d.finetuned_accuracy for d in record.devices if d.finetuned_accuracy is not None]
        record.finetuned_accuracy_p10 = p10(tuned)


def round_record(
    state: ServerState,
    strategy: str,
    deadline_s: float,
    round_time_s: float,
    param_names: list[str],
    rows: list[DeviceRow],
) -> RoundRecord:
    """The metrics.jsonl line of the round ``state`` has just finished; ``rows``: its :func:`device_rows`."""
    got = state.replies
    record = RoundRecord(
        round=state.round,
        strategy=strategy,
        deadline_s=deadline_s,
        round_time_s=round_time_s,
        sim_time_s=state.sim_time_s,
        wall_time_s=state.wall_time_s,
        bytes_uploaded=int(sum(r.bytes_uploaded for r in got.train)),
        tensors_trained_by_nobody=sum(1 for k in param_names if k not in got.senders),
        rejections=[RejectionRow(**r.as_dict()) for r in got.rejections],
        defense=got.defense.as_dict(),
        server_s=got.timings,
        devices=rows,
    )
    with_accuracy(record, got.accuracy)
    return record


def with_attendance(record: RoundRecord, attendance: Attendance) -> None:
    """What the round's membership did, into its record."""
    a = attendance
    record.connected, record.sampled, record.missed, record.miss_reasons = a.connected, a.sampled, a.missed, a.misses
    record.joined, record.refused = a.joined, [dataclasses.asdict(r) for r in a.refused]
    record.benched, record.offline, record.online, record.sampled_at_s = a.benched, a.offline, a.online, a.sampled_at_s


def read_records(run: Path) -> list[RoundRecord]:
    """A run folder's per-round records from its ``metrics.jsonl`` (none when it wrote none). The file is
    only appended to, so a line that does not parse is the last one, still being written or cut short by a
    crash: the records stop before it."""
    metrics = run / METRICS_FILE
    records: list[RoundRecord] = []
    for line in metrics.read_text().splitlines() if metrics.is_file() else []:
        if not line.strip():
            continue
        try:
            records.append(RoundRecord.from_json(json.loads(line)))
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


def trained_rows(records: list[RoundRecord]) -> dict[str, list[tuple[int, DeviceRow]]]:
    """Each device's rows of the rounds it trained in, with the round number, by device name."""
    per_device: dict[str, list[tuple[int, DeviceRow]]] = {}
    for rec in records:
        for d in rec.trained_rows():
            per_device.setdefault(device_key(d), []).append((rec.round, d))
    return per_device


def honest_rejections(records: list[RoundRecord], adversaries: Collection[str] = ()) -> int:
    """The replies the server rejected from devices not among ``adversaries``: in a fleet nobody attacks each is
    an honest device's round thrown away, which every bench reports and should find 0."""
    return sum(j.device not in adversaries for r in records for j in r.rejections)


def honest_tensors_left_out(records: list[RoundRecord], adversaries: Collection[str] = ()) -> int:
    """The tensors the defense left out of the replies of devices not among ``adversaries`` for their own sign skew
    (``robust.held_alone``): each one an honest device's step on a tensor thrown away, which a fleet nobody attacks
    should find none of."""
    return sum(n for r in records for device, n in r.defense.get(SKEWED, {}).items() if device not in adversaries)


def p10(values: list[float]) -> float | None:
    return float(np.percentile(values, 10)) if values else None


class Tracker:
    """Appends one JSON line per round; on resume, drops lines past the checkpoint."""

    def __init__(self, out: Path, *, resume_round: int | None) -> None:
        self.out = out
        self.path = out / METRICS_FILE
        out.mkdir(parents=True, exist_ok=True)
        self.records: list[RoundRecord] = []
        if resume_round is not None and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    rec = RoundRecord.from_json(json.loads(line))
                except (json.JSONDecodeError, TypeError, AttributeError, KeyError):
                    continue  # a line cut short by a kill
                if rec.round <= resume_round:
                    self.records.append(rec)
        self._rewrite()

    def _rewrite(self) -> None:
        write_text_atomic(self.path, "".join(json.dumps(r.to_json()) + "\n" for r in self.records))

    def add(self, record: RoundRecord) -> None:
        self.records.append(record)
        with self.path.open("a") as fh:
            fh.write(json.dumps(record.to_json()) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def summary(self, name: str, strategy: str) -> RunSummary:
        """The run's summary, written to summary.json."""
        summary = summarize(self.records, name=name, strategy=strategy, run_dir=str(self.out))
        summary.write(self.out)
        return summary


def summarize(records: list[RoundRecord], *, name: str, strategy: str, run_dir: str) -> RunSummary:
    """A run's summary from its rounds: the last round's accuracies, the totals, and each class's and device's
    means."""
    last = records[-1] if records else RoundRecord(round=0)
    personal = [d.personal_accuracy for d in last.devices if d.personal_accuracy is not None]
    tuned = [d.finetuned_accuracy for d in last.devices if d.finetuned_accuracy is not None]
    return RunSummary(
        name=name,
        strategy=strategy,
        run_dir=run_dir,
        rounds=len(records),
        sim_time_s=last.sim_time_s,
        final_accuracy=last.global_accuracy,
        final_server_accuracy=last.server_accuracy,
        personalized_accuracy_mean=float(np.mean(personal)) if personal else None,
        personalized_accuracy_p10=p10(personal),
        finetuned_accuracy_mean=float(np.mean(tuned)) if tuned else None,
        finetuned_accuracy_p10=p10(tuned),
        bytes_uploaded=int(sum(r.bytes_uploaded for r in records)),
        rejections=sum(len(r.rejections) for r in records),
        rounds_without_training=[r.round for r in records if not r.trained_rows()],
        first_rejection=next((j.reason for r in records for j in r.rejections), None),
        classes=class_summary(records),
        devices=device_summary(records),
        history=[history_of(r) for r in records],
    )


def device_summary(records: list[RoundRecord]) -> dict[str, DeviceSummary]:
    """Per device that trained: its class and tier as last seen, its rounds, and what they did on average."""
    out = {}
    for name, pairs in sorted(trained_rows(records).items()):
        rows = [d for _, d in pairs]
        out[name] = DeviceSummary(
            device_class=rows[-1].device_class,
            tier=rows[-1].tier,
            rounds_trained=len(rows),
            **trained_means(rows),
            rho_mean=float(np.mean([r.rho for r in rows])),
        )
    return out


def trained_means(rows: list[DeviceRow]) -> dict[str, float | int]:
    """What trained rows (one device's, or one class's) did on average, and the bytes they uploaded: the fields
    :class:`DeviceSummary` and :class:`ClassSummary` share."""
    return {
        "speedup_mean": float(np.mean([r.speedup for r in rows])),
        "round_speedup_mean": float(np.mean([r.whole_round_speedup for r in rows])),
        "trained_fraction_mean": float(np.mean([r.trained_fraction for r in rows])),
        "bytes_uploaded": int(sum(r.bytes_uploaded or 0 for r in rows)),
    }


def class_summary(records: list[RoundRecord]) -> dict[str, ClassSummary]:
    """Per device class (devices.device_classes): what its devices' trained rounds did, and their
    personalized accuracy when last evaluated; empty without classes."""
    trained: dict[str, list[DeviceRow]] = {}
    last_eval: dict[str, DeviceRow] = {}
    for rec in records:
        for d in rec.devices:
            if d.device_class is None:
                continue
            if d.trained:
                trained.setdefault(d.device_class, []).append(d)
            if d.personal_accuracy is not None:
                last_eval[device_key(d)] = d
    out = {}
    for cls, rows in sorted(trained.items()):
        personal = [d.personal_accuracy for d in last_eval.values() if d.device_class == cls]
        out[cls] = ClassSummary(
            devices_trained=len({device_key(d) for d in rows}),
            device_rounds=len(rows),
            **trained_means(rows),
            round_time_s_mean=float(np.mean([d.predicted_time_s for d in rows])),
            personalized_accuracy_mean=float(np.mean(personal)) if personal else None,
        )
    return out


def progress_line(rec: RoundRecord, rounds: int) -> str:
    def pct(v):
        return f"{100 * v:5.1f}%" if isinstance(v, (int, float)) else "  n/a "

    speedups = [d.whole_round_speedup for d in rec.trained_rows()]  # whole rounds
    return (
        f"round {rec.round:>3}/{rounds}  sim {rec.sim_time_s:8.1f}s (+{rec.round_time_s:.1f}s)  "
        f"global {pct(rec.global_accuracy)}  personal {pct(rec.personal_accuracy)}  "
        + (f"finetuned {pct(rec.finetuned_accuracy)}  " if rec.finetuned_accuracy is not None else "")
        + (f"server {pct(rec.server_accuracy)}  " if rec.server_accuracy is not None else "")
        + f"speedup {min(speedups, default=0):.2f}-{max(speedups, default=0):.2f}x  "
        f"up {rec.bytes_uploaded / 1e6:6.2f} MB  devices {len(speedups)}  rejected {len(rec.rejections)}"
        + attendance_note(rec)
    )


def _names(names: list[str]) -> str:
    return ",".join(names) if len(names) <= 4 else f"{len(names)} devices"


def attendance_note(rec: RoundRecord) -> str:
    """Who missed, joined or was refused this round: said on the progress line only when it happened."""
    parts = [f"{label} {_names(names)}" for label, names in (("missed", rec.missed), ("joined", rec.joined)) if names]
    parts += [f"{label} {len(got)}" for label, got in (("refused", rec.refused), ("offline", rec.offline)) if got]
    return ("  " + "  ".join(parts)) if parts else ""


MAX_LEGEND_DEVICES = 16  # a larger fleet's device plot has no legend


def plot_run(out: Path, records: list[RoundRecord], title: str) -> list[Path]:
    """Accuracy against simulated time and rounds; per-device speedup, trained fraction; bytes per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records:
        return []
    rounds = [r.round for r in records]
    evaluated = [r for r in records if r.evaluated]  # evaluation.every skips rounds
    sim = [r.sim_time_s for r in evaluated]
    g = [r.global_accuracy for r in evaluated]
    p = [r.personal_accuracy for r in evaluated]
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, x, label in ((axes[0], sim, "simulated time (s)"), (axes[1], [r.round for r in evaluated], "round")):
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
    for name, pairs in sorted(by_device.items()):
        xs, rows = [n for n, _ in pairs], [d for _, d in pairs]
        axes[0].plot(xs, [r.speedup for r in rows], marker=".", label=f"{name} ({rows[-1].tier:g}x)")
        axes[1].plot(xs, [r.trained_fraction for r in rows], marker=".", label=name)
    axes[0].set_title("speedup vs full training")
    axes[1].set_title("trained fraction of weights")
    axes[2].bar(rounds, [r.bytes_uploaded / 1e6 for r in records])
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


def plot_classes(path: Path, classes: dict[str, ClassSummary], title: str) -> Path:
    """Per device class: mean speedup, trained fraction and personalized accuracy, side by side."""
    import matplotlib.pyplot as plt

    names = list(classes)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, label in (
        (axes[0], "round_speedup_mean", "round speedup vs training fully"),
        (axes[1], "trained_fraction_mean", "trained fraction of weights"),
        (axes[2], "personalized_accuracy_mean", "personalized accuracy (last evaluation)"),
    ):
        ax.bar(names, [getattr(classes[n], key) or 0.0 for n in names])
        ax.set_title(label)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{title}: per device class")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

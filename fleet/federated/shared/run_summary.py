"""A run's summary, typed: ``summary.json``, written once when a run ends, and read back by the CLI and the benches.

The tracker makes a :class:`RunSummary` from the run's :class:`~fleet.federated.shared.round_record.RoundRecord`\\ s
and writes it; ``fleet simulate``, ``fleet testbed`` and the benches read it through :meth:`RunSummary.read`, so
each summary.json key is a field's name, spelled once (the device class is written ``class``, as in metrics.jsonl).
Design notes:

* **Figures made once.** Every mean and p10 is computed when the summary is made
  (:func:`fleet.federated.on_server.tracking.summarize`); readers take them from the summary.
* **History.** Each round's clock, accuracies and bytes (:data:`HISTORY_KEYS`), kept as
  :class:`RoundRecord`\\ s with the other fields at their defaults, so a bench reads a history and a
  metrics.jsonl through one type and one ``time_to_target``.
* **Old files.** As with metrics.jsonl, an unknown key is dropped and a missing one defaults.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.base.atomic import write_json
from fleet.base.errors import FleetError
from fleet.federated.shared.round_record import RoundRecord, fields_json, from_json_fields, optional_field

SUMMARY_FILE = "summary.json"
# what a round keeps in the summary's history: the clock, the accuracies and the bytes; the optional accuracies
# (a server test set, fine-tuning) only when the run makes them
HISTORY_KEYS = (
    "round",
    "sim_time_s",
    "global_accuracy",
    "personal_accuracy",
    "personal_accuracy_p10",
    "bytes_uploaded",
    "server_accuracy",
    "finetuned_accuracy",
    "finetuned_accuracy_p10",
)


@dataclass
class DeviceSummary:
    """A device that trained, over the run: its class and tier as last seen, and what its rounds did on average."""

    device_class: str | None = optional_field("class")  # simulated or testbed device classes only
    tier: float | None = None
    rounds_trained: int = 0
    speedup_mean: float = 0.0  # its compute's speedup over training fully
    round_speedup_mean: float = 0.0  # its whole round's, upload included
    trained_fraction_mean: float = 0.0
    bytes_uploaded: int = 0
    rho_mean: float = 0.0


@dataclass
class ClassSummary:
    """A device class, over the run: what its devices' trained rounds did, and their last personalized accuracy."""

    devices_trained: int = 0
    device_rounds: int = 0
    speedup_mean: float = 0.0
    round_speedup_mean: float = 0.0
    trained_fraction_mean: float = 0.0
    bytes_uploaded: int = 0
    round_time_s_mean: float = 0.0  # on the simulated clock
    personalized_accuracy_mean: float | None = None


@dataclass
class RunSummary:
    """A finished run: its last round's accuracies, its totals, per class, per device, and its history."""

    name: str = ""
    strategy: str = ""
    run_dir: str = ""
    rounds: int = 0
    sim_time_s: float = 0.0
    final_accuracy: float | None = None  # the last round's global accuracy
    final_server_accuracy: float | None = None  # evaluation.server_test only
    personalized_accuracy_mean: float | None = None  # over the devices scored in the last round
    personalized_accuracy_p10: float | None = None
    finetuned_accuracy_mean: float | None = None  # personalization.finetune_steps only
    finetuned_accuracy_p10: float | None = None
    bytes_uploaded: int = 0
    rejections: int = 0
    rounds_without_training: list[int] = field(default_factory=list)  # a run that taught nothing says so
    first_rejection: str | None = None  # the reason of the first, to say what to fix
    classes: dict[str, ClassSummary] = field(default_factory=dict)
    devices: dict[str, DeviceSummary] = field(default_factory=dict)
    history: list[RoundRecord] = field(default_factory=list)  # each round's HISTORY_KEYS alone (history_of)

    def to_json(self) -> dict[str, Any]:
        out = fields_json(self)
        out["classes"] = {name: fields_json(c) for name, c in self.classes.items()}
        out["devices"] = {name: fields_json(d) for name, d in self.devices.items()}
        out["history"] = [history_json(r) for r in self.history]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunSummary:
        return from_json_fields(
            cls,
            data,
            classes={n: from_json_fields(ClassSummary, c) for n, c in (data.get("classes") or {}).items()},
            devices={n: from_json_fields(DeviceSummary, d) for n, d in (data.get("devices") or {}).items()},
            history=[RoundRecord.from_json(r) for r in data.get("history") or []],
        )

    def write(self, run: Path) -> None:
        write_json(run / SUMMARY_FILE, self.to_json())

    @classmethod
    def read(cls, run: Path) -> RunSummary:
        """The summary a finished run in ``run`` wrote; a one-line error where it wrote none."""
        path = Path(run) / SUMMARY_FILE
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, AttributeError) as why:
            raise FleetError(f"{path}: no readable run summary ({why}); the run did not finish, see its log") from None


def history_json(r: RoundRecord) -> dict[str, Any]:
    """A round as the summary's history keeps it: :data:`HISTORY_KEYS` of its metrics.jsonl line."""
    line = r.to_json()
    return {k: line[k] for k in HISTORY_KEYS if k in line}


def history_of(r: RoundRecord) -> RoundRecord:
    """The round as the summary's history holds it, in memory as read back from the file."""
    return RoundRecord.from_json(history_json(r))

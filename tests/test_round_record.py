"""The round's record, typed: every figure a reply gives its row has a field, and a line reads back as written."""

from __future__ import annotations

import dataclasses
import json

from fleet.federated.shared.records import EvaluateReply, TrainReply, wire_fields
from fleet.federated.shared.round_record import DeviceRow, RejectionRow, RoundRecord, key_of

TRAIN = TrainReply(
    node_id=7,
    device="pi-a",
    num_examples=40.0,
    tier=2.0,
    selected=3,
    num_tensors=62,
    trained_fraction=0.1,
    rho=0.4,
    predicted_time_s=2.0,
    measured_time_s=2.5,
    full_time_s=5.0,
    bytes_uploaded=1000,
    steps=4,
    **{f.name: 1 for f, _ in wire_fields(TrainReply) if f.default is None},  # every optional figure set
    wall_s=9.0,
)
EVALUATION = EvaluateReply(
    node_id=7,
    device="pi-a",
    num_examples=10.0,
    global_accuracy=0.5,
    personal_accuracy=0.6,
    **{f.name: 1 for f, _ in wire_fields(EvaluateReply) if f.default is None},
)


def test_every_figure_of_a_reply_row_is_a_field_of_the_device_row():
    """``DeviceRow.from_json`` drops a key it does not know (an old line's), so a reply figure without a field
    would vanish from metrics.jsonl without a word."""
    known = {key_of(f) for f in dataclasses.fields(DeviceRow)}
    for row in (TRAIN.row(), EVALUATION.row()):
        assert set(row) <= known, set(row) - known
        assert DeviceRow.from_json(row).to_json() == {k: v for k, v in row.items() if v is not None}


def test_a_record_reads_back_as_it_was_written():
    row = DeviceRow.from_json({**TRAIN.row(), **EVALUATION.row()})
    row.device_class, row.round_speedup = "pi4", 1.5
    record = RoundRecord(
        round=3,
        strategy="fleet",
        global_accuracy=0.5,
        rejections=[RejectionRow(round=3, node_id=8, device="pi-b", reason="late")],
        devices=[row, DeviceRow(device="pi-b", global_accuracy=0.4, test_examples=5.0)],
        missed=["pi-c"],
        miss_reasons={"pi-c": "no reply within its bound of 9.0s"},
        server_accuracy=0.7,
    )
    line = json.loads(json.dumps(record.to_json()))
    assert RoundRecord.from_json(line) == record
    assert line["devices"][0]["class"] == "pi4" and "device_class" not in line["devices"][0]
    assert "speedup" not in line["devices"][1]  # a row holds only what happened: pi-b only evaluated
    assert line["global_accuracy"] == 0.5 and line["personal_accuracy"] is None  # a round's own figures always
    assert "finetuned_accuracy" not in line and "evaluated_in_round" not in line  # ... but not what no run made
    assert line["rejections"] == [{"round": 3, "node_id": 8, "device": "pi-b", "reason": "late"}]


def test_a_line_from_another_version_still_loads():
    old = {"round": 2, "sim_time_s": 4.0, "retired_figure": 1, "devices": [{"device": "d0", "speedup": 2.0, "x": 0}]}
    record = RoundRecord.from_json(old)
    assert record.round == 2 and record.sim_time_s == 4.0 and record.global_accuracy is None
    assert record.trained_rows() == [DeviceRow(device="d0", speedup=2.0)] and record.rejections == []


def test_a_run_summary_reads_back_as_it_was_written(tmp_path):
    """summary.json through its type: the means made once from the rounds, the keys as the file's readers know
    them (``class``, the history's clock, accuracies and bytes), and every field back as written."""
    from fleet.federated.on_server.tracking import summarize
    from fleet.federated.shared.run_summary import HISTORY_KEYS, RunSummary

    row = DeviceRow.from_json({**TRAIN.row(), **EVALUATION.row()})
    row.device_class, row.speedup = "pi4", 2.0
    rounds = [
        RoundRecord(round=r, strategy="fleet", sim_time_s=10.0 * r, global_accuracy=0.5, devices=[row]) for r in (1, 2)
    ]
    summary = summarize(rounds, name="x", strategy="fleet", run_dir=str(tmp_path))
    summary.write(tmp_path)
    assert RunSummary.read(tmp_path) == summary
    line = json.loads((tmp_path / "summary.json").read_text())
    assert line["rounds"] == 2 and line["sim_time_s"] == 20.0 and line["final_accuracy"] == 0.5
    assert line["devices"]["pi-a"]["class"] == "pi4" and line["devices"]["pi-a"]["rounds_trained"] == 2
    assert line["devices"]["pi-a"]["speedup_mean"] == 2.0 and line["classes"]["pi4"]["device_rounds"] == 2
    assert line["personalized_accuracy_mean"] == 0.6  # the last round's devices' own scores
    assert set(line["history"][0]) <= set(HISTORY_KEYS) and line["history"][1]["sim_time_s"] == 20.0
    assert "server_accuracy" not in line["history"][0]  # an optional accuracy only where the run made it


def test_a_summary_from_before_its_type_still_loads_and_a_missing_one_says_so(tmp_path):
    import pytest

    from fleet.base.errors import FleetError
    from fleet.federated.shared.run_summary import RunSummary

    old = {
        "name": "fleet",
        "strategy": "fedavg",
        "run_dir": "runs/fleet",
        "rounds": 1,
        "retired": True,
        "devices": {"d0": {"tier": 1.0, "rounds_trained": 1, "speedup_mean": 1.0, "rho_mean": 1.0, "x": 0}},
        "history": [{"round": 1, "sim_time_s": 3.0, "global_accuracy": 0.4}],
    }
    summary = RunSummary.from_json(old)
    assert summary.devices["d0"].device_class is None and summary.devices["d0"].tier == 1.0
    assert summary.history[0].sim_time_s == 3.0 and summary.classes == {} and summary.final_accuracy is None
    with pytest.raises(FleetError, match="no readable run summary") as got:
        RunSummary.read(tmp_path)
    assert "\n" not in str(got.value)

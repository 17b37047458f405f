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

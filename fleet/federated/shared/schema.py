"""What a device may say: every metric the server reads, with its type and range.

A reply crosses a trust boundary: a device can be faulty, out of date or hostile, and a
metric the server uses without a check can crash the ServerApp (a missing key, a string),
or move the fleet (a NaN loss, a negative byte count, a sample count of 1e308). Each
message type has a schema here; a reply that fails it is rejected with one reason, and
only its typed record is kept (fleet/federated/shared/records.py reads the schema's fields alone), so nothing
unknown reaches metrics.jsonl.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from fleet.base.numbers import is_real
from fleet.federated.shared import keys


@dataclass(frozen=True)
class Field:
    """One metric: whether it must be there, whether it is a whole number, and its range."""

    required: bool
    integer: bool = False
    lo: float = 0.0
    hi: float = math.inf
    lo_open: bool = False  # lo itself is not allowed (a time or a count of samples > 0)

    def problem(self, value: object) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number, got {value!r}"
        if not is_real(value):
            return f"must be finite, got {value!r}"
        if self.integer and value != int(value):
            return f"must be a whole number, got {value!r}"
        if value < self.lo or (self.lo_open and value == self.lo) or value > self.hi:
            low = "(" if self.lo_open else "["
            return f"must be in {low}{self.lo:g}, {self.hi:g}], got {value!r}"
        return None


COUNT = Field(True, integer=True)
FRACTION = Field(True, hi=1.0)
SECONDS = Field(True)
PARTITION = Field(False, integer=True)

QUERY = {
    keys.PARTITION_ID: PARTITION,
    keys.TIER: Field(True, lo=0.0, lo_open=True, hi=1e4),
    keys.FULL_TIME_S: Field(True, lo=0.0, lo_open=True, hi=1e6),
    keys.MIN_RHO: Field(True, lo=0.0, lo_open=True, hi=1.0),
    keys.NUM_EXAMPLES: Field(True, integer=True, lo=0.0, lo_open=True),
}
TRAIN = {
    keys.PARTITION_ID: PARTITION,
    keys.NUM_EXAMPLES: Field(True, lo=0.0, lo_open=True),
    keys.TIER: QUERY[keys.TIER],
    keys.SELECTED: COUNT,
    keys.PERSONAL_SELECTED: Field(False, integer=True),
    keys.NUM_TENSORS: COUNT,
    keys.TRAINED_FRACTION: FRACTION,
    keys.RHO: FRACTION,
    keys.PREDICTED_TIME_S: SECONDS,
    keys.MEASURED_TIME_S: SECONDS,
    keys.FULL_TIME_S: QUERY[keys.FULL_TIME_S],
    keys.SPEEDUP: Field(True, hi=1e6),
    keys.BYTES_UPLOADED: COUNT,
    keys.LOSS: Field(False),  # absent when the device's budget left no step to train
    keys.STEPS: COUNT,
    keys.ROUNDS_TRAINED: Field(False, integer=True, lo=1.0),
    keys.MEMORY_BUDGET_BYTES: Field(False),
    keys.MEMORY_PEAK_BYTES: Field(False),
    keys.MEMORY_ADDED_S: Field(False),
    keys.CUDA: Field(False, integer=True, lo=1.0, hi=1.0),
    keys.READY_S: Field(False, hi=1e6),
    keys.SCORE_TIME_S: Field(False, hi=1e6),
    # its score of the model it received, before training (evaluation.pipelined): the last round's evaluation
    keys.GLOBAL_ACCURACY: Field(False, hi=1.0),
    keys.PERSONAL_ACCURACY: Field(False, hi=1.0),
    keys.TEST_EXAMPLES: Field(False, lo=0.0, lo_open=True),
    keys.EVAL_TIME_S: Field(False, hi=1e6),
}
EVALUATE = {
    keys.PARTITION_ID: PARTITION,
    keys.NUM_EXAMPLES: Field(True, lo=0.0, lo_open=True),
    keys.GLOBAL_ACCURACY: FRACTION,
    keys.PERSONAL_ACCURACY: FRACTION,
    keys.FINETUNED_ACCURACY: Field(False, hi=1.0),
    keys.FINETUNE_TIME_S: Field(False, hi=1e6),
    keys.EVAL_TIME_S: Field(False, hi=1e6),
    keys.READY_S: Field(False, hi=1e6),
}


def metric_problem(metrics: Mapping[str, object], schema: Mapping[str, Field]) -> str | None:
    """Why ``metrics`` do not fit ``schema`` (the first problem, in one line), or None."""
    for key, spec in schema.items():
        if key not in metrics:
            if spec.required:
                return f"metric '{key}' is missing"
            continue
        problem = spec.problem(metrics[key])
        if problem is not None:
            return f"metric '{key}' {problem}"
    return None

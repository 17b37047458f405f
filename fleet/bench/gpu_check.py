"""The verdicts of ``scripts/gpu-check.sh``: its bench results read against the GPU targets.

The script writes each bench's JSON under its output folder; ``python -m fleet.bench.gpu_check DIR``
reads them and prints one line per target, so a short GPU window ends with the answer, not with JSON
to read by hand. The targets (docs/gpu.md): the timing model's median error at most 10% on every
profiled model, the elastic step's measured time fraction within 0.08 of the predicted one at rho 0.5,
and every planned step's measured peak within its memory budget.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

MAX_TIMING_ERROR = 0.10  # median |predicted - measured| / measured over full training and random selections
MAX_FRACTION_GAP = 0.08  # |measured - predicted| elastic/full step-time fraction at rho 0.5
TIMING_GLOB = "timing-*.json"  # one per profiled model
SPEEDUP_FILE = "speedup.json"
MEMORY_FILE = "memory.json"


@dataclass(frozen=True)
class Verdict:
    """One target: what was measured, against what, and whether it holds."""

    target: str
    figure: str
    met: bool

    def line(self) -> str:
        return f"{'met   ' if self.met else 'MISSED'} {self.target}: {self.figure}"


def timing_verdict(result: dict) -> Verdict:
    """The timing model's median error on one model's random selections and full step."""
    err = result["median_abs_relative_error"]
    figure = (
        f"median error {100 * err:.1f}% (at most {100 * MAX_TIMING_ERROR:.0f}%; "
        f"{100 * result['median_abs_relative_error_drift_corrected']:.1f}% after drift {result['machine_drift']:.2f}x)"
    )
    return Verdict(f"timing {result['model']} on {result['device']}", figure, err <= MAX_TIMING_ERROR)


def speedup_verdict(result: dict) -> Verdict:
    """The elastic step's measured time fraction against the profile's prediction."""
    gap = abs(result["measured_time_fraction"] - result["predicted_time_fraction"])
    figure = (
        f"measured {result['measured_time_fraction']:.3f}, predicted {result['predicted_time_fraction']:.3f}, "
        f"gap {gap:.3f} (at most {MAX_FRACTION_GAP}); {result['selected']}/{result['tensors']} tensors"
    )
    return Verdict(f"elastic fraction {result['model']} at rho {result['rho']}", figure, gap <= MAX_FRACTION_GAP)


def memory_verdict(result: dict) -> Verdict:
    """The planned step's measured peak against its budget."""
    mib = 2**20
    figure = (
        f"activation peak {result['measured_peak_bytes'] / mib:.1f} MiB, budget {result['budget_bytes'] / mib:.1f} MiB "
        f"(predicted {result['predicted_peak_bytes'] / mib:.1f}, "
        f"unplanned {result['unconstrained_peak_bytes'] / mib:.1f}; "
        f"plan {result['plan']})"
    )
    if "measured_allocator_peak_bytes" in result:
        figure += f"; whole step by the allocator {result['measured_allocator_peak_bytes'] / mib:.1f} MiB"
    return Verdict(f"memory peak {result['model']} at {result['budget_fraction']:.0%}", figure, result["within_budget"])


def verdicts(out_dir: Path) -> list[Verdict]:
    """Every target's verdict from the JSON files in ``out_dir``; a missing file is a missed target."""
    found: list[Verdict] = [timing_verdict(_load(p)) for p in sorted(out_dir.glob(TIMING_GLOB))]
    if not found:
        found.append(Verdict("timing", f"no {TIMING_GLOB} in {out_dir}", False))
    for name, judge in ((SPEEDUP_FILE, speedup_verdict), (MEMORY_FILE, memory_verdict)):
        path = out_dir / name
        found.append(judge(_load(path)) if path.exists() else Verdict(name, f"missing in {out_dir}", False))
    return found


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    """Print each verdict; exit 1 when any target is missed."""
    args = sys.argv[1:] if argv is None else argv
    found = verdicts(Path(args[0] if args else "runs/gpu-check"))
    for v in found:
        print(v.line())
    return 0 if all(v.met for v in found) else 1


if __name__ == "__main__":
    sys.exit(main())

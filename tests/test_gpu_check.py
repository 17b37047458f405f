"""The GPU check's verdicts: each target read from the benches' JSON, a missing file a missed target."""

import json

from fleet.bench import gpu_check


def timing(model: str, error: float) -> dict:
    return {
        "model": model,
        "device": "cuda (NVIDIA H200)",
        "median_abs_relative_error": error,
        "median_abs_relative_error_drift_corrected": error,
        "machine_drift": 1.0,
    }


SPEEDUP = {"model": "resnet18", "rho": 0.5, "selected": 4, "tensors": 62}
MEMORY = {
    "model": "resnet18",
    "budget_fraction": 0.5,
    "budget_bytes": 7097728,
    "predicted_peak_bytes": 6855424,
    "unconstrained_peak_bytes": 14195456,
    "plan": {"keep": 10, "page": 4},
}


def write(tmp_path, name: str, data: dict) -> None:
    (tmp_path / name).write_text(json.dumps(data))


def test_every_target_met_exits_zero(tmp_path, capsys):
    write(tmp_path, "timing-resnet18.json", timing("resnet18", 0.034))
    write(tmp_path, "timing-mobilenet_v2.json", timing("mobilenet_v2", 0.082))
    write(tmp_path, "speedup.json", SPEEDUP | {"measured_time_fraction": 0.573, "predicted_time_fraction": 0.497})
    write(tmp_path, "memory.json", MEMORY | {"measured_peak_bytes": 6855424, "within_budget": True})
    assert gpu_check.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and all(line.startswith("met") for line in out)
    assert "gap 0.076" in out[2] and "6.5 MiB" in out[3]


def test_each_miss_is_named_with_its_figure(tmp_path, capsys):
    write(tmp_path, "timing-resnet18.json", timing("resnet18", 0.278))
    write(tmp_path, "speedup.json", SPEEDUP | {"measured_time_fraction": 0.580, "predicted_time_fraction": 0.499})
    assert gpu_check.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "MISSED timing resnet18 on cuda (NVIDIA H200): median error 27.8%" in out
    assert "MISSED elastic fraction resnet18 at rho 0.5: measured 0.580, predicted 0.499, gap 0.081" in out
    assert "MISSED memory.json: missing in" in out  # the memory step never wrote its result


def test_a_peak_over_budget_is_missed(tmp_path):
    write(tmp_path, "memory.json", MEMORY | {"measured_peak_bytes": 8 << 20, "within_budget": False})
    found = {v.target: v for v in gpu_check.verdicts(tmp_path)}
    assert not found["memory peak resnet18 at 50%"].met
    assert not found["timing"].met  # no timing result at all

"""The benchmark and personalization commands, end to end on tiny real runs."""

import json

import pytest

from fleet.cli import main
from fleet.engine.models import load_checkpoint_meta, model_meta
from tests.conftest import BATCH, INPUT


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_speedup_prints_fractions(capsys, tmp_path, small_profile):
    path = small_profile.save(tmp_path / "p.yaml")
    r = run_json(capsys, ["bench", "speedup", "--profile", str(path), "--rho", "0.5", "--repeats", "3", "--json"])
    assert r["rho"] == 0.5
    assert r["predicted_time_fraction"] <= 0.5 + 1e-9
    assert 0 < r["measured_time_fraction"] < 1.5
    assert 0 < r["selected"] < r["tensors"] == 62


def test_bench_timing_reports_errors(capsys, tmp_path, small_profile):
    path = small_profile.save(tmp_path / "p.yaml")
    r = run_json(capsys, ["bench", "timing", "--profile", str(path), "--selections", "3", "--repeats", "2", "--json"])
    assert len(r["selections"]) == 3 and r["full"]["selected"] == 62
    assert r["median_abs_relative_error"] >= 0
    for row in r["selections"]:
        assert row["predicted_s"] < r["full"]["predicted_s"]


def test_profile_command_writes_loadable_profile(tmp_path, capsys):
    out = tmp_path / "dev.yaml"
    assert (
        main(
            [
                "profile",
                "--model",
                "mobilenet_v3_small",
                "--in-channels",
                "1",
                "--batch-size",
                "4",
                "--input-size",
                "16",
                "--repeats",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "profiled mobilenet_v3_small" in capsys.readouterr().out
    from fleet.engine.device_profile import DeviceProfile

    assert DeviceProfile.load(out).model["name"] == "mobilenet_v3_small"
    assert main(["profile", "--model", "lenet", "--out", str(out)]) == 2
    assert "model.name: unknown model 'lenet'" in capsys.readouterr().err
    assert main(["profile", "--out", str(out)]) == 2
    assert "give --model NAME or --config" in capsys.readouterr().err


def test_profile_from_a_fleet_config_records_the_memory_budget(tmp_path, capsys):
    """What a deployed device runs once: the fleet config says which model, batch and input size."""
    from fleet.base.errors import ProfileMismatchError
    from fleet.engine.device_profile import DeviceProfile

    out = tmp_path / "dev.yaml"
    assert (
        main(
            [
                "profile",
                "--config",
                "simulations/fleet-tiny.yaml",
                "--batch-size",
                "4",
                "--repeats",
                "2",
                "--memory-budget-mb",
                "30",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "profiled resnet18 at batch 4, input 16" in capsys.readouterr().out
    p = DeviceProfile.load(out)
    assert (p.model["name"], p.model["in_channels"], p.batch_size, p.input_size) == ("resnet18", 1, 4, 16)
    assert p.memory_budget_mb == 30.0
    out.write_text(out.read_text().replace("memory_budget_mb: 30.0", "memory_budget_mb: -1"))
    with pytest.raises(ProfileMismatchError, match="memory_budget_mb -1 is not allowed"):
        DeviceProfile.load(out)


def test_personalize_from_pretrained(tmp_path, capsys):
    cfg = tmp_path / "p.yaml"
    cfg.write_text(
        f"name: p\noutput_dir: {tmp_path}\n"
        "model: {name: resnet18, num_classes: 5, in_channels: 1}\n"
        f"data: {{dataset: synthetic, input_size: {INPUT}, classes: [5, 6, 7, 8, 9], "
        "train_per_class: 16, test_per_class: 10}\n"
        f"train: {{epochs: 1, batch_size: {BATCH}, rho: 0.6, lr: 0.05}}\n"
        "pretrain: {classes: [0, 1, 2, 3, 4], train_per_class: 16, epochs: 1}\n"
    )
    r = run_json(capsys, ["bench", "personalize", "-c", str(cfg), "--methods", "full,tl,elastic", "--json"])
    assert set(r["methods"]) == {"full", "tl", "elastic"}
    assert r["methods"]["elastic"]["rho"] == 0.6
    assert all(0 <= m["final_accuracy"] <= 1 for m in r["methods"].values())
    assert r["methods"]["full"]["time_vs_full"] == 1.0
    run = tmp_path / "p"
    record = json.loads((run / "personalize.json").read_text())
    assert record["methods"]["elastic"]["selections"]
    assert (run / "personalize.png").stat().st_size > 10_000 and (run / "personalize.csv").is_file()
    assert (tmp_path / "pretrained").is_dir()  # the checkpoint was made and cached
    (checkpoint,) = (tmp_path / "pretrained").glob("*.pt")
    meta = load_checkpoint_meta(checkpoint)
    assert {k: meta[k] for k in ("name", "num_classes", "in_channels", "small_input")} == model_meta(
        "resnet18", 5, 1, False
    )

"""Bad input found by an adversarial user: each is one ``error: <field>: ...; <fix>`` line, exit status 2,
no traceback, and nothing already saved is removed or moved aside."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.base.errors import ConfigError, DataError
from fleet.cli import main
from fleet.engine.config import load_config, parse_override
from tests.conftest import proportional_profile

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "simulations" / "fleet-tiny.yaml"
LATIN1 = "name: caf\xe9\ntrain:\n  rho: 0.5\n".encode("latin-1")  # valid YAML, but not UTF-8


def one_error_line(capsys, argv: list[str], field: str, *fixes: str) -> str:
    """Run the CLI and return its single stderr line, after checking status 2, the field and the fix."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: {field}"), lines[0]
    assert "; " in lines[0] and "Traceback" not in err
    for fix in fixes:
        assert fix in lines[0], lines[0]
    return lines[0]


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its content: what must survive a refused command."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def synthetic_config(tmp_path) -> Path:
    """A single-device experiment on the synthetic set: loads in a fraction of a second."""
    path = tmp_path / "c.yaml"
    path.write_text(
        f"name: c\noutput_dir: {tmp_path / 'runs'}\n"
        "model: {name: resnet18, num_classes: 5, in_channels: 1}\n"
        "data: {dataset: synthetic, input_size: 16, classes: [5, 6, 7, 8, 9], train_per_class: 4, "
        "test_per_class: 4}\n"
        "train: {epochs: 1, batch_size: 8}\n"
        "pretrain: {classes: [0, 1, 2, 3, 4], train_per_class: 4, epochs: 1}\n"
    )
    return path


@pytest.fixture
def previous_fleet_run(tmp_path) -> Path:
    """A finished fleet-tiny run in ``tmp/runs/fleet-tiny``: a fresh start would move it aside."""
    run = tmp_path / "runs" / "fleet-tiny"
    run.mkdir(parents=True)
    (run / "checkpoint.pt").write_bytes(b"saved state")
    (run / "summary.json").write_text("{}")
    return run


def no_work(monkeypatch) -> None:
    """Fail the test if any model is built, profiled, pretrained or trained: the checks come first."""

    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the input was checked")

    monkeypatch.setattr("fleet.engine.train_run.make_model", forbidden)
    monkeypatch.setattr("fleet.bench.personalize.ensure_pretrained", forbidden)
    monkeypatch.setattr("fleet.federated.launch.prepare.obtain_profile", forbidden)
    monkeypatch.setattr("fleet.federated.launch.prepare.keep_previous_run", forbidden)


# ---------------------------------------------------------------- 1. files that are not UTF-8


def test_non_utf8_config_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(LATIN1)
    one_error_line(capsys, ["train", "--config", str(bad)], f"config file {bad}", "not UTF-8", "save it as UTF-8")
    one_error_line(capsys, ["simulate", str(bad)], f"config file {bad}", "not UTF-8")
    assert bad.read_bytes() == LATIN1


def test_non_utf8_config_from_the_console_has_no_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(LATIN1)
    r = subprocess.run(
        [sys.executable, "-m", "fleet.cli", "train", "-c", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "not UTF-8" in r.stderr and "Traceback" not in r.stderr


def test_non_utf8_profile_for_train_is_one_line(tmp_path, capsys, synthetic_config):
    bad = tmp_path / "device.yaml"
    bad.write_bytes(LATIN1)
    argv = ["train", "--config", str(synthetic_config), "--profile", str(bad)]
    one_error_line(
        capsys, argv, f"hardware.profile: profile file {bad}", "not UTF-8", "re-create it with `fleet profile`"
    )
    assert bad.read_bytes() == LATIN1


def test_non_utf8_profile_for_simulate_keeps_the_previous_run(tmp_path, capsys, previous_fleet_run):
    bad = tmp_path / "device.yaml"
    bad.write_bytes(LATIN1)
    before = tree(tmp_path / "runs")
    argv = ["simulate", str(TINY), "--output-dir", str(tmp_path / "runs"), "--set", f"hardware.profile={bad}"]
    one_error_line(capsys, argv, "hardware.profile: profile file", "not UTF-8", "fleet profile")
    assert tree(tmp_path / "runs") == before


# ---------------------------------------------------------------- 2. a model that does not fit the data


@pytest.mark.parametrize(
    "setting, field, fix",
    [
        ("model.num_classes=2", "model.num_classes: 2 is fewer than the 5 labels", "set model.num_classes to 5"),
        ("model.in_channels=3", "model.in_channels: 3 does not match", "set model.in_channels to 1"),
    ],
)
@pytest.mark.parametrize("command", ["train", "personalize"])
def test_model_that_does_not_fit_the_data_stops_before_any_work(
    capsys, monkeypatch, synthetic_config, command, setting, field, fix
):
    no_work(monkeypatch)
    one_error_line(capsys, [command, "--config", str(synthetic_config), "--set", setting], field, fix)
    assert not (synthetic_config.parent / "runs").exists()


def test_pretraining_labels_beyond_the_model_stop_personalize(capsys, monkeypatch, synthetic_config):
    """Without pretrain.classes the start model is pretrained on all 10 labels, with a 5-class head."""
    no_work(monkeypatch)
    argv = ["personalize", "--config", str(synthetic_config), "--set", "pretrain.classes=null"]
    one_error_line(capsys, argv, "model.num_classes: 5 is fewer than the 10 labels", "pretrain.classes")


def test_model_that_does_not_fit_the_fleet_data_keeps_the_previous_run(
    tmp_path, capsys, monkeypatch, previous_fleet_run
):
    no_work(monkeypatch)
    before = tree(tmp_path / "runs")
    for setting, field in (("model.num_classes=4", "model.num_classes: 4"), ("model.in_channels=3", "model.in_")):
        argv = ["simulate", str(TINY), "--output-dir", str(tmp_path / "runs"), "--set", setting]
        one_error_line(capsys, argv, field, "set model.")
    assert tree(tmp_path / "runs") == before


def test_a_model_that_fits_passes_the_check(synthetic_config):
    from fleet.engine.experiment import check_model_fits_data, load_data

    cfg = load_config(synthetic_config, {"data.input_size": 32})  # resized batches are fine
    check_model_fits_data(cfg, *load_data(cfg.data))
    wider = load_config(synthetic_config, {"model.num_classes": 8})  # a head with spare classes too
    check_model_fits_data(wider, *load_data(wider.data))


# ---------------------------------------------------------------- 3 and 4. fleet profile's own flags


@pytest.mark.parametrize(
    "flag, value, fix", [("--repeats", "0", "integer >= 1"), ("--repeats", "-3", ">= 1"), ("--threads", "0", ">= 1")]
)
def test_profile_non_positive_counts(tmp_path, capsys, flag, value, fix):
    out = tmp_path / "new" / "device.yaml"
    argv = ["profile", "--model", "resnet18", flag, value, "--out", str(out)]
    one_error_line(capsys, argv, f"{flag}: {value} is not allowed", fix)
    assert not out.parent.exists()


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["bench", "speedup", "--repeats", "0"], "--repeats: 0"),
        (["bench", "timing", "--selections", "0"], "--selections: 0"),
        (
            ["bench", "memory", "--model", "resnet18", "--budget-fraction", "0.5", "--profile-repeats", "0"],
            "--profile-repeats: 0",
        ),
        (["plan-memory", "--model", "resnet18", "--budget-fraction", "0.5", "--repeats", "-1"], "--repeats: -1"),
    ],
)
def test_benchmark_counts_below_one_are_one_line(capsys, argv, flag):
    one_error_line(capsys, argv, f"{flag} is not allowed", "integer >= 1")


def test_pretraining_labels_beyond_the_model_stop_pretrain(capsys, monkeypatch, synthetic_config):
    no_work(monkeypatch)
    argv = ["pretrain", "--config", str(synthetic_config), "--set", "pretrain.classes=null"]
    one_error_line(capsys, argv, "model.num_classes: 5 is fewer than the 10 labels", "pretrain.classes")


def test_profile_out_is_a_directory(tmp_path, capsys):
    (tmp_path / "kept.yaml").write_text("saved")
    before = tree(tmp_path)
    argv = ["profile", "--model", "resnet18", "--repeats", "1", "--out", str(tmp_path)]
    one_error_line(capsys, argv, f"--out: {tmp_path} is a directory", "give a file path")
    assert tree(tmp_path) == before
    blocked = tmp_path / "kept.yaml" / "device.yaml"
    argv = ["profile", "--model", "resnet18", "--repeats", "1", "--out", str(blocked)]
    one_error_line(capsys, argv, f"--out: {tmp_path / 'kept.yaml'} is a file, not a folder")
    assert tree(tmp_path) == before


def test_profile_out_in_a_missing_folder_is_created(tmp_path, capsys, monkeypatch):
    """Profiling itself is replaced by a computed profile: what is tested is where it is written."""
    monkeypatch.setattr(
        "fleet.engine.profiler.profile_device",
        lambda model, meta, *, batch_size, input_size, **kw: proportional_profile(
            model, batch_size, input_size, meta=meta
        ),
    )
    out = tmp_path / "a" / "b" / "device.yaml"
    argv = ["profile", "--model", "resnet18", "--in-channels", "1", "--batch-size", "4", "--input-size", "16"]
    assert main([*argv, "--out", str(out)]) == 0
    from fleet.engine.device_profile import DeviceProfile

    plain = DeviceProfile.load(out)
    assert plain.batch_size == 4
    # --scale records a slower device of the same shape, --note what it stands for
    scaled_out = tmp_path / "pi.yaml"
    assert main([*argv, "--scale", "7.1", "--note", "a Pi 4 class", "--out", str(scaled_out)]) == 0
    scaled = DeviceProfile.load(scaled_out)
    assert scaled.speed_factor == pytest.approx(7.1) and scaled.host["note"] == "a Pi 4 class"
    assert scaled.full_step_time == pytest.approx(7.1 * plain.full_step_time)
    one_error_line(capsys, [*argv, "--scale", "0.5", "--out", str(scaled_out)], "--scale: 0.5 is not allowed", ">= 1")


# ---------------------------------------------------------------- 5. --set with an empty value or null


def test_set_empty_value_is_refused(synthetic_config, capsys):
    for text in ("train.rho=", "train.rho=  "):
        argv = ["train", "--config", str(synthetic_config), "--set", text]
        one_error_line(capsys, argv, f"--set {text}: empty value", "give a value", "null")
    one_error_line(capsys, ["simulate", str(TINY), "--set", "federation.rounds="], "--set federation.rounds=: empty")


def test_set_null_clears_an_optional_field_and_is_refused_elsewhere(synthetic_config, capsys):
    text = synthetic_config.read_text().replace("in_channels: 1}", "in_channels: 1, weights: w.pt}")
    synthetic_config.write_text(text.replace("batch_size: 8}", "batch_size: 8}\nhardware: {threads: 2}"))
    cfg = load_config(synthetic_config)
    assert (cfg.hardware.threads, cfg.model.weights) == (2, "w.pt")
    for null in ("null", "~", "Null"):
        overrides = dict([parse_override(f"hardware.threads={null}"), parse_override(f"model.weights={null}")])
        cleared = load_config(synthetic_config, overrides)
        assert (cleared.hardware.threads, cleared.model.weights) == (None, None)
    assert load_config(synthetic_config, dict([parse_override("pretrain.classes=null")])).pretrain.classes is None
    argv = ["train", "--config", str(synthetic_config), "--set", "train.rho=null"]
    one_error_line(capsys, argv, "train.rho: null is not allowed", "use a number in (0, 1]")
    one_error_line(capsys, ["train", "--set", "name=null"], "name: null is not allowed", "plain folder name")


def test_null_in_the_yaml_file_clears_an_optional_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("hardware:\n  threads: 2\n")
    assert load_config(path, dict([parse_override("hardware.threads=null")])).hardware.threads is None
    path.write_text("train:\n")  # an empty section still takes overrides
    assert load_config(path, dict([parse_override("train.rho=0.3")])).train.rho == 0.3


def test_flower_run_config_still_skips_empty_values():
    """pyproject's [tool.flwr.app.config] defaults are "": they mean "keep the YAML's value"."""
    from fleet.federated.shared.config import config_from_run_config

    cfg = config_from_run_config({"config": str(TINY), "train.rho": "", "federation.rounds": 3})
    assert (cfg.train.rho, cfg.federation.rounds) == (0.5, 3)


def test_set_without_a_field_path(capsys):
    one_error_line(capsys, ["train", "--set", "=1"], "--set =1: '' is not a field path")
    one_error_line(capsys, ["train", "--set", "rho"], "--set rho: expected FIELD=VALUE")
    with pytest.raises(ConfigError, match=r"train.rho is a field, not a section"):
        load_config(None, {"train.rho": 0.5, "train.rho.x": 1})


# ---------------------------------------------------------------- 6. name is one plain folder name


@pytest.mark.parametrize("name", ["..", ".", ".hidden", "a\\b", "a/b", " ", "a b", "", "x" * 101, "-x", "../up"])
def test_bad_run_names_are_refused(name):
    with pytest.raises(ConfigError) as info:
        load_config(None, {"name": name})
    assert str(info.value).startswith("name: ") and "plain folder name" in str(info.value)


@pytest.mark.parametrize("name", ["personalize", "fleet-tiny", "run_2.v3", "A1", "x" * 100])
def test_plain_run_names_are_accepted(name):
    assert load_config(None, {"name": name}).name == name


def test_name_dot_does_not_move_output_dir_aside(tmp_path, capsys, monkeypatch):
    no_work(monkeypatch)
    out = tmp_path / "runs"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"saved state")  # output_dir itself holds a run
    before = tree(tmp_path)
    for name in (".", ".."):
        argv = ["simulate", str(TINY), "--output-dir", str(out), "--name", name]
        one_error_line(capsys, argv, f"name: '{name}' is not allowed", "plain folder name")
        one_error_line(capsys, ["train", "--output-dir", str(out), "--set", f"name={name}"], f"name: '{name}'")
    assert tree(tmp_path) == before and [p.name for p in tmp_path.iterdir()] == ["runs"]


# ---------------------------------------------------------------- 7. nothing installs at run time


def _calls_that_run_programs(tree_: ast.AST) -> list[ast.Call]:
    runners = {"run", "call", "check_call", "check_output", "Popen", "system", "popen", "execv", "execvp"}
    return [
        node
        for node in ast.walk(tree_)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in runners
    ]


def test_no_module_runs_an_installer():
    """scripts/install.sh is the only installer; the code may name the fix in a message, never run it."""
    for folder in ("fleet", "client", "server"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree_ = ast.parse(path.read_text(), filename=str(path))
            for call in _calls_that_run_programs(tree_):
                strings = [n.value for n in ast.walk(call) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
                assert not any(w in s for s in strings for w in ("apt", "pip", "install")), (path, call.lineno)


def test_data_module_does_not_start_programs():
    tree_ = ast.parse((ROOT / "fleet" / "data" / "datasets.py").read_text())
    imported = {a.name for n in ast.walk(tree_) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree_) if isinstance(n, ast.ImportFrom)}
    assert "subprocess" not in imported


def test_missing_fashion_mnist_names_the_install_command(tmp_path):
    from fleet.data.datasets import check_fashion_mnist

    with pytest.raises(DataError) as info:
        check_fashion_mnist(tmp_path / "missing")
    message = str(info.value)
    assert message.startswith("data.root: ") and "apt-get install dataset-fashion-mnist" in message
    assert not (tmp_path / "missing").exists()

"""Config loading: every bad field gets one line naming it, its value and the fix."""

import subprocess
import sys

import pytest

from fleet.base.errors import ConfigError
from fleet.cli import main
from fleet.engine.config import ExperimentConfig, load_config


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_and_yaml_values(tmp_path):
    cfg = load_config(write(tmp_path, "name: a\ntrain:\n  rho: 0.4\n  epochs: 3\nmodel:\n  name: mobilenet_v2\n"))
    assert isinstance(cfg, ExperimentConfig)
    assert (cfg.train.rho, cfg.train.epochs, cfg.model.name, cfg.train.lr) == (0.4, 3, "mobilenet_v2", 0.01)


@pytest.mark.parametrize(
    "text, field, hint",
    [
        ("train:\n  rho: 1.5\n", "train.rho", "(0, 1]"),
        ("train:\n  rho: fast\n", "train.rho", "finite number"),
        ("train:\n  method: magic\n", "train.method", "elastic"),
        ("train:\n  probe: cheap\n", "train.probe", "'restore' or 'train'"),
        ("train:\n  epochs: 2.5\n", "train.epochs", "integer"),
        ("train:\n  lrr: 0.1\n", "train.lrr", "allowed here"),
        ("model:\n  small_input: maybe\n", "model.small_input", "true or false"),
        ("data:\n  classes: [1, 1]\n", "data.classes", "distinct"),
        ("bogus: 1\n", "bogus", "allowed here"),
        ("train: 5\n", "train", "mapping"),
        ("methods: [full, fancy]\n", "methods", "list drawn from"),
    ],
)
def test_bad_fields_name_field_and_fix(tmp_path, text, field, hint):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    message = str(info.value)
    assert message.startswith(field + ":") or message.startswith(f"{field}:")
    assert hint in message
    assert "\n" not in message


def test_invalid_yaml_names_line(tmp_path):
    with pytest.raises(ConfigError, match=r"not valid YAML at line 3, column 2"):
        load_config(write(tmp_path, "train:\n  rho: 0.5\n bad: 1\n"))


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/x.yaml")


def test_overrides_are_validated(tmp_path):
    path = write(tmp_path, "train:\n  rho: 0.5\n")
    assert load_config(path, {"train.rho": 0.3}).train.rho == 0.3
    with pytest.raises(ConfigError, match="train.rho"):
        load_config(path, {"train.rho": -1.0})


def test_cli_prints_one_line_error(tmp_path, capsys):
    path = write(tmp_path, "train:\n  rho: 0.5\n")
    assert main(["train", "--config", str(path), "--rho", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: train.rho: 3.0 is not allowed; use a number in (0, 1]"
    assert main(["train", "--config", str(path), "--model", "resnet19"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model.name: unknown model 'resnet19'; choose one of resnet18")
    assert main(["train", "--config", str(path), "--set", "train.epochs=zero"]) == 2
    assert "train.epochs" in capsys.readouterr().err


def test_console_script_exit_code(tmp_path):
    bad = write(tmp_path, "train: [\n")
    r = subprocess.run([sys.executable, "-m", "fleet.cli", "train", "-c", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "not valid YAML" in r.stderr and "Traceback" not in r.stderr


def test_the_trainer_takes_the_train_section_itself(tmp_path):
    """No mirror of the train section is copied by hand: the Trainer reads the config it is given, and a
    caller that trains otherwise gives it a changed copy."""
    import dataclasses

    from fleet.engine.trainer import Trainer
    from tests.conftest import small_model

    cfg = load_config(write(tmp_path, "train:\n  method: prunetrain\n  lr: 0.02\n  seed: 3\n  batch_size: 4\n"))
    trainer = Trainer(small_model(), cfg.train, input_size=24)
    assert trainer.config is cfg.train and trainer.input_size == 24 and all(trainer.mask)
    group = trainer.optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.02, cfg.train.momentum, cfg.train.weight_decay)
    head_only = Trainer(small_model(), dataclasses.replace(cfg.train, method="tl", seed=9), input_size=24)
    assert (head_only.config.method, head_only.config.lr, cfg.train.method) == ("tl", 0.02, "prunetrain")
    assert not all(head_only.mask)  # tl: the head only

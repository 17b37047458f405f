"""Files a user or a device hands fleet: duplicate YAML keys, aliases that expand to billions of values, deep
nesting and profile fields of the wrong type or sign are each a one-line error naming the file and the field."""

from __future__ import annotations

import re
import time

import pytest

from fleet.base.errors import ConfigError
from fleet.cli import main
from fleet.engine.device_profile import DeviceProfile, ProfileMismatchError
from fleet.engine.yaml_text import MAX_NODES, load_yaml
from fleet.federated.shared.config import load_fleet_config

LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)
)  # 10^9 values once expanded, in about 400 bytes
DEEP = "[" * 5000 + "]" * 5000


def test_honest_yaml_loads_as_plain_data_aliases_included():
    assert load_yaml("a: &x {b: 1}\nc: *x\n") == {"a": {"b": 1}, "c": {"b": 1}}
    assert load_yaml("") is None and load_yaml("- 1\n- 2\n") == [1, 2]


def test_a_second_key_of_the_same_name_is_refused_with_its_line(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text("data:\n  dataset: fashion-mnist\ntrain:\n  lr: 0.1\ndata:\n  input_size: 16\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line 5, column 1: duplicate key 'data'") as err:
        load_fleet_config(str(path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text", [LAUGHS, f"model: {DEEP}\n"], ids=["billion-laughs", "5000-brackets"])
def test_a_config_too_large_or_deep_is_refused_at_once(tmp_path, text, capsys):
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    started = time.monotonic()
    assert main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - started < 10 and len(err) < 400 and err.count("\n") == 1
    assert f"{MAX_NODES:,} values" in err or "nested more than 64 levels" in err


@pytest.mark.parametrize("text", [LAUGHS, DEEP, "t_fw: 1\nt_fw: 2\n"], ids=["laughs", "deep", "duplicate"])
def test_a_profile_too_large_deep_or_doubled_is_one_line(tmp_path, text):
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    with pytest.raises(ProfileMismatchError, match=r"profile file .* is not valid YAML.*re-create it") as err:
        DeviceProfile.load(path, field="hardware.profile")
    assert "hardware.profile" in str(err.value) and "\n" not in str(err.value)


def test_a_trace_of_nested_brackets_is_one_line(tmp_path, capsys):
    trace = tmp_path / "trace.yaml"
    trace.write_text(DEEP)
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(f"devices:\n  device_classes:\n    - name: a\n      trace: {trace}\n")
    assert main(["simulate", str(cfg)]) == 2
    assert "nested more than 64 levels" in capsys.readouterr().err


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda d: d["tensors"][0].update(t_dw="fast"), "t_dw 'fast'"),
        (lambda d: d.update(t_fw=None), "t_fw None"),
        (lambda d: d.update(speed_factor=-2), "speed_factor -2"),
        (lambda d: d.update(batch_size="32"), "batch_size '32'"),
        (lambda d: d.update(model="resnet18"), "model 'resnet18'"),
        (lambda d: d["tensors"][0].update(shape="big"), "shape"),
    ],
    ids=["string-time", "null-forward", "negative-speed", "string-batch", "model-string", "shape-string"],
)
def test_a_profile_field_of_the_wrong_type_or_sign_is_named_in_one_line(tmp_path, change, named):
    import yaml

    from fleet.federated.shared.paths import resolve_path

    data = yaml.safe_load(resolve_path("profiles/resnet18-16px-host.yaml").read_text())
    change(data)
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileMismatchError, match="re-create it with `fleet profile`") as err:
        DeviceProfile.load(path, field="hardware.profile")
    assert named in str(err.value) and "\n" not in str(err.value)


def _must_not_run(what: str):
    """A stand-in for expensive work that fails the test if a refusal comes only after it."""

    def called(*args, **kwargs):
        raise AssertionError(f"{what} ran before the bad input was refused")

    return called


@pytest.mark.parametrize("text", ["just: garbage\n", "fleet_profile: 1\nt_fw: 1\n"], ids=["garbage", "malformed"])
def test_personalize_refuses_a_bad_profile_before_it_pretrains(tmp_path, capsys, monkeypatch, text):
    import fleet.bench.personalize

    monkeypatch.setattr(fleet.bench.personalize, "ensure_pretrained", _must_not_run("pretraining"))  # ~110 s
    profile = tmp_path / "profile.yaml"
    profile.write_text(text)
    argv = ["personalize", "--profile", str(profile), "--set", f"output_dir={tmp_path / 'runs'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "hardware.profile" in err and err.count("\n") == 1 and not list(tmp_path.rglob("*.pt"))


@pytest.mark.parametrize(
    "profile, extra, message",
    [
        ("garbage", [], "is not a fleet device profile"),
        ("profiles/resnet18-32px-5cls-host.yaml", [], "does not match the model"),
        ("profiles/resnet18-16px-host.yaml", ["--set", "train.batch_size=16"], "measured at batch size 32"),
    ],
    ids=["garbage", "other-model", "other-batch"],
)
def test_a_testbed_class_profile_is_checked_before_anything_starts(
    tmp_path, capsys, monkeypatch, profile, extra, message
):
    import fleet.federated.launch.pretrain
    from fleet.federated.shared.paths import resolve_path
    from fleet.testbed.run import Testbed

    monkeypatch.setattr(Testbed, "_start_link", _must_not_run("the SuperLink"))
    monkeypatch.setattr(fleet.federated.launch.pretrain, "pretrain_fleet_model", _must_not_run("pretraining"))

    if profile == "garbage":
        (tmp_path / "garbage.yaml").write_text("just: garbage\n")
        path = tmp_path / "garbage.yaml"
    else:
        path = resolve_path(profile)
    previous = tmp_path / "runs" / "tb-testbed" / "logs" / "superlink.log"  # the last testbed run's logs
    previous.parent.mkdir(parents=True)
    previous.write_text("kept\n")
    cfg = tmp_path / "tb.yaml"
    cfg.write_text(
        "name: tb\nmodel: {name: resnet18, num_classes: 10, in_channels: 1}\n"
        "data: {dataset: fashion-mnist, input_size: 16}\n"
        f"testbed:\n  classes:\n    - {{name: pi, count: 1, profile: {path}}}\n"
    )
    assert main(["testbed", str(cfg), "--set", f"output_dir={tmp_path / 'runs'}", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "testbed.classes (pi).profile" in err and err.count("\n") == 1
    assert not list(tmp_path.rglob("*.pt"))  # nothing pretrained
    assert [p.name for p in tmp_path.rglob("logs/*")] == ["superlink.log"]  # no SuperLink or SuperNode started
    assert previous.read_text() == "kept\n"  # and the previous run's work folder was not removed first


def test_a_profile_path_that_is_a_directory_is_named_as_one(tmp_path):
    with pytest.raises(ProfileMismatchError, match=r"profile file .* is a directory; give the") as err:
        DeviceProfile.load(tmp_path, field="hardware.profile")
    assert "--out " + str(tmp_path) not in str(err.value)  # `fleet profile` refuses a directory as --out


def test_a_huge_value_of_the_wrong_type_is_quoted_short(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text("train:\n  lr: [" + ", ".join(["1"] * 100_000) + "]\n")
    with pytest.raises(ConfigError, match=r"^train.lr: \[1, 1, 1, 1, 1, 1, \.\.\.\] is not a finite number") as err:
        load_fleet_config(str(path))
    assert len(str(err.value)) < 200


def test_a_400_digit_number_for_a_float_field_is_one_line(tmp_path):
    """math.isfinite raises OverflowError on an int no float holds; the config reader names the field instead."""
    path = tmp_path / "fleet.yaml"
    path.write_text("train:\n  lr: 1" + "0" * 400 + "\n")
    with pytest.raises(ConfigError, match=r"^train.lr: .* is not a finite number"):
        load_fleet_config(str(path))


def _profile_text(**replace: str) -> str:
    """The reference profile's YAML with the anchors ``row`` (300 items) and ``big`` (300 rows, 90,000 values,
    within the loader's bound) in its ``host`` mapping, and each field in ``replace`` set to the given text."""
    import yaml

    from fleet.federated.shared.paths import resolve_path

    data = yaml.safe_load(resolve_path("profiles/resnet18-16px-host.yaml").read_text())
    data.pop("host")
    lines = ["host: {row: &row [" + ", ".join(["x"] * 300) + "], big: &big [" + ", ".join(["*row"] * 300) + "]}"]
    for line in yaml.safe_dump(data, sort_keys=False).splitlines():
        key = line.split(":", 1)[0]
        lines.append(f"{key}: {replace[key]}" if key in replace else line)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("t_fw", "*big", "t_fw [['x', 'x'"),
        ("batch_size", "*big", "batch_size [['x'"),
        ("memory_budget_mb", "1" + "0" * 400, "memory_budget_mb 1000"),
    ],
    ids=["alias-time", "alias-batch", "400-digit-budget"],
)
def test_a_huge_profile_value_is_quoted_short_in_one_line(tmp_path, capsys, field, value, named):
    """A profile field set to a 90,000-value alias was quoted whole (a 450 KB error line); a 400-digit
    memory budget ended in math.isfinite's OverflowError."""
    path = tmp_path / "profile.yaml"
    path.write_text(_profile_text(**{field: value}))
    assert (
        main(["train", "-c", "simulations/quick.yaml", "--profile", str(path), "--set", f"output_dir={tmp_path}"]) == 2
    )
    err = capsys.readouterr().err
    assert named in err and ("re-create it with `fleet profile`" in err or "remove it" in err)
    assert err.count("\n") == 1 and len(err) < 400 and "Traceback" not in err


def test_a_trace_with_a_400_digit_time_or_deep_nesting_names_the_class_trace(tmp_path, capsys):
    """float() of a 400-digit interval end raised OverflowError; a malformed trace was called a "config file"."""
    cfg = tmp_path / "fleet.yaml"
    for text, message in [
        ("period_s: 100\ndevices:\n  - [[0, 1" + "0" * 400 + "]]\n", r"devices\[0\] must be a list of \[start, end\]"),
        (DEEP, "is not valid YAML at line 1, column 1001: nested more than 64 levels deep; mend that line"),
    ]:
        trace = tmp_path / "trace.yaml"
        trace.write_text(text)
        cfg.write_text(f"devices:\n  device_classes:\n    - name: a\n      trace: {trace}\n")
        assert main(["simulate", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: device_classes trace {trace}") and err.count("\n") == 1
        assert re.search(message, err) and "config file" not in err


def test_the_testbed_class_profiles_are_checked_by_one_function_callable_before_launch(tmp_path):
    """class_profiles is what check_requirements (the first step of run_testbed) reads each class's profile
    with: it starts nothing, so the refusal is known before a SuperLink or a pretraining could start."""
    from fleet.federated.shared.paths import resolve_path
    from fleet.testbed.calibrate import class_profiles
    from fleet.testbed.config import parse_testbed_config

    def classes(profile: str, batch: int = 32) -> dict:
        return {
            "model": {"name": "resnet18", "num_classes": 10, "in_channels": 1},
            "data": {"dataset": "fashion-mnist", "input_size": 16},
            "train": {"batch_size": batch},
            "testbed": {"classes": [{"name": "pi", "count": 1, "profile": profile}]},
        }

    host = str(resolve_path("profiles/resnet18-16px-host.yaml"))
    assert list(class_profiles(parse_testbed_config(classes(host)))) == ["pi"]
    (tmp_path / "garbage.yaml").write_text("just: garbage\n")
    for cfg, message in [
        (classes(str(tmp_path / "garbage.yaml")), "is not a fleet device profile"),
        (classes(str(resolve_path("profiles/resnet18-32px-5cls-host.yaml"))), "does not match the model"),
        (classes(host, batch=16), "measured at batch size 32"),
    ]:
        with pytest.raises(ProfileMismatchError, match=message) as err:
            class_profiles(parse_testbed_config(cfg))
        assert "testbed.classes (pi).profile" in str(err.value) and "\n" not in str(err.value)


def test_a_simulated_class_profile_is_checked_before_the_simulation_starts(tmp_path, capsys, monkeypatch):
    """A garbage devices.device_classes profile was refused by each ClientApp inside Flower: ten lines and a
    round's wait; now one line before the previous run is moved aside or the start model pretrained."""
    import fleet.federated.launch.pretrain

    monkeypatch.setattr(fleet.federated.launch.pretrain, "pretrain_fleet_model", _must_not_run("pretraining"))
    (tmp_path / "garbage.yaml").write_text("just: garbage\n")
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text(f"devices:\n  device_classes:\n    - name: a\n      profile: {tmp_path / 'garbage.yaml'}\n")
    assert main(["simulate", str(cfg), "--set", f"output_dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: devices.device_classes (a).profile: profile ") and err.count("\n") == 1
    assert "is not a fleet device profile" in err and not (tmp_path / "runs").exists()

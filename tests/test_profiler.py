"""The timing profiler's output, the profile file and its refusal of other models."""

import math

import pytest
import torch

from fleet.base.errors import ProfileMismatchError
from fleet.engine.device_profile import DeviceProfile
from fleet.engine.experiment import check_profile
from fleet.engine.models import build_model
from fleet.engine.profiler import tensor_order
from tests.conftest import BATCH, INPUT, small_model


def test_profile_covers_every_tensor_in_forward_order(small_profile):
    model = small_model()
    names = [n for n, _, _ in tensor_order(model, torch.zeros(1, 1, INPUT, INPUT))]
    assert [t.name for t in small_profile.tensors] == names
    assert names[0] == "conv1.weight" and names[-1] == "fc.bias"
    assert len(names) == len(list(model.parameters()))
    # t_dy sits on each layer's first tensor only.
    for prev, t in zip(small_profile.tensors, small_profile.tensors[1:]):
        if t.layer == prev.layer:
            assert t.t_dy == 0.0
    assert all(t.t_dw >= 0 and t.t_opt >= 0 and math.isfinite(t.t_dw) for t in small_profile.tensors)
    assert sum(t.t_dw for t in small_profile.tensors) > 0
    assert 0 < small_profile.min_rho < 1
    assert small_profile.threads >= 1 and small_profile.host["machine"]


def test_timing_model_orders_selections(small_profile):
    n = len(small_profile.tensors)
    full = small_profile.step_time([True] * n)
    head = small_profile.step_time([False] * (n - 2) + [True, True])
    nothing = small_profile.step_time([False] * n)
    assert nothing == pytest.approx(small_profile.forward_time)
    assert nothing <= head < full  # the head may cost less than the timer resolves
    # Training the input-most tensor alone still pays every layer's t_dy after it.
    first_only = small_profile.step_time([True] + [False] * (n - 1))
    assert first_only == pytest.approx(small_profile.forward_time + sum(small_profile.t_dy[1:]) + small_profile.t_dw[0])
    assert small_profile.scaled(3.0).full_step_time == pytest.approx(3 * full)


def test_save_load_round_trip(tmp_path, small_profile):
    path = small_profile.save(tmp_path / "dev.yaml")
    loaded = DeviceProfile.load(path)
    assert loaded.tensors == small_profile.tensors
    assert loaded.full_step_time == pytest.approx(small_profile.full_step_time)
    check_profile(loaded, small_model(), BATCH, INPUT, "p")


def test_profile_of_another_model_is_refused(small_profile):
    other = build_model("mobilenet_v3_small", 10, in_channels=1)
    with pytest.raises(
        ProfileMismatchError, match=r"does not match the model: \d+ tensors in the model, 62 in the profile"
    ):
        check_profile(small_profile, other, BATCH, INPUT, "p")


def test_profile_with_other_shapes_or_batch_is_refused(small_profile):
    wider = build_model("resnet18", 7, in_channels=1)
    with pytest.raises(ProfileMismatchError, match=r"fc.weight has shape \[7, 512\] in the model, \[10, 512\]"):
        check_profile(small_profile, wider, BATCH, INPUT, "p")
    with pytest.raises(ProfileMismatchError, match="batch size 8, training uses 64"):
        check_profile(small_profile, small_model(), 64, INPUT, "p")


def test_bad_profile_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tensors: [\n")
    with pytest.raises(ProfileMismatchError, match="not valid YAML"):
        DeviceProfile.load(bad)
    bad.write_text("a: 1\n")
    with pytest.raises(ProfileMismatchError, match="not a fleet device profile"):
        DeviceProfile.load(bad)
    with pytest.raises(ProfileMismatchError, match="not found"):
        DeviceProfile.load(tmp_path / "missing.yaml")


def test_negative_time_in_file_is_refused(tmp_path, small_profile):
    d = small_profile.to_dict()
    d["tensors"][3]["t_dw"] = -1.0
    import yaml

    p = tmp_path / "neg.yaml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(ProfileMismatchError, match=r"tensor .*: t_dw -1.0 is not a number of seconds >= 0"):
        DeviceProfile.load(p)

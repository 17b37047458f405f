"""Reference profiles and regimes: which device a bench's simulated seconds are of."""

from __future__ import annotations

import pytest

from fleet.base.errors import ConfigError
from fleet.bench.regimes import REGIMES, profile_overrides
from fleet.engine.config import NULL
from fleet.engine.device_profile import DeviceProfile
from fleet.federated.shared.config import load_fleet_config
from fleet.federated.shared.paths import APP_ROOT

UPLOAD_S = 11_200_000 * 4 / 12.5e6  # a ResNet-18's float32 weights over the benches' 100 Mbit/s uplink


def test_each_regime_is_what_it_says_against_the_upload():
    """upload: a round's 10 full steps take less than the model's upload on every tier; compute: more, from tier 1."""
    host = DeviceProfile.load(APP_ROOT / REGIMES["upload"])
    pi4 = DeviceProfile.load(APP_ROOT / REGIMES["compute"])
    assert 4 * 10 * host.full_step_time < UPLOAD_S  # the slowest tier (4x) included
    assert 10 * pi4.full_step_time > UPLOAD_S
    assert pi4.speed_factor == pytest.approx(7.1) and pi4.host["cpu"] == host.host["cpu"]
    for profile in (host, pi4):
        assert profile.created.startswith("20") and "note" in profile.host  # where and when, and what it stands for


def test_the_benches_read_the_reference_profile_by_default():
    for name in ("pfl", "fleet-bench", "robustness", "scale"):
        cfg = load_fleet_config(f"simulations/{name}.yaml")
        assert cfg.hardware.profile == REGIMES["upload"]


@pytest.mark.parametrize(
    "profile, regime, expected",
    [
        (None, None, {}),
        ("reference", None, {}),
        ("measured", None, {"hardware.profile": NULL}),
        (None, "compute", {"hardware.profile": str(APP_ROOT / REGIMES["compute"])}),
        ("reference", "upload", {"hardware.profile": str(APP_ROOT / REGIMES["upload"])}),
    ],
)
def test_profile_and_regime_flags_become_overrides(profile, regime, expected):
    assert profile_overrides(profile, regime) == expected


@pytest.mark.parametrize(
    "profile, regime, message",
    [
        (None, "gpu", "--regime: 'gpu' is not a regime; use one of upload, compute"),
        ("measured", "compute", "--regime: compute names its own reference profile; drop --profile measured"),
        ("/nope.yaml", None, "--profile: /nope.yaml is not a file; give a profile YAML, reference or measured"),
    ],
)
def test_bad_profile_flags_are_one_line(profile, regime, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        profile_overrides(profile, regime)

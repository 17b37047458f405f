"""Which device a bench's simulated time follows: a stored reference profile (the default), one measured now.

Light on imports: the CLI adds these flags to its parsers before any bench runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The reference profiles the benches use by default (profiles/README.md): simulated time then follows a stored
# device, not the host a bench happens to run on. A regime names the kind of device a bench's fleet stands for.
REGIMES = {
    "upload": "profiles/resnet18-16px-host.yaml",  # one core of the CI host: a ResNet-18 upload outlasts 10 steps
    "compute": "profiles/resnet18-16px-pi4.yaml",  # a Raspberry Pi 4 class: 10 steps outlast the upload
}
MEASURED = "measured"  # --profile measured: measure the host's profile on the spot, as the benches once did


def profile_overrides(profile: str | None, regime: str | None) -> dict[str, Any]:
    """The config overrides for a bench's ``--profile`` (reference: the config's own; measured; or a file) and
    ``--regime`` (one of :data:`REGIMES`' reference profiles); a one-line error for a bad value."""
    from fleet.base.errors import ConfigError
    from fleet.engine.config import NULL
    from fleet.federated.shared.paths import resolve_path

    if regime is not None and regime not in REGIMES:
        raise ConfigError(f"--regime: {regime!r} is not a regime; use one of {', '.join(REGIMES)}")
    if regime is not None and profile not in (None, "reference"):
        raise ConfigError(f"--regime: {regime} names its own reference profile; drop --profile {profile}")
    if regime is not None:
        return {"hardware.profile": str(resolve_path(REGIMES[regime]).resolve())}
    if profile in (None, "reference"):
        return {}
    if profile == MEASURED:
        return {"hardware.profile": NULL}
    if not resolve_path(profile).is_file():
        raise ConfigError(f"--profile: {profile} is not a file; give a profile YAML, reference or measured")
    return {"hardware.profile": str(resolve_path(profile).resolve())}


def add_profile_flags(p: Any) -> None:
    """``--profile`` and ``--regime`` on a fleet bench's parser."""
    p.add_argument(
        "--profile",
        metavar="reference|measured|FILE",
        help="the devices' timing profile: the config's reference profile from profiles/ (default), one measured "
        "on this host now, or a profile YAML",
    )
    p.add_argument(
        "--regime",
        metavar="|".join(REGIMES),
        help="upload: one core of the CI host, uploads dominate a round (the default profile); compute: a "
        "Raspberry Pi 4 class, training dominates",
    )


def run_profile(run: str | Path) -> dict[str, Any]:
    """Which profile a finished run's simulated clock followed (its effective config's), with the machine and
    date it was measured on: a bench's JSON says which device its seconds are of."""
    from fleet.engine.device_profile import DeviceProfile
    from fleet.federated.launch.prepare import EFFECTIVE_CONFIG
    from fleet.federated.shared.config import load_fleet_config

    path = load_fleet_config(Path(run) / EFFECTIVE_CONFIG).hardware.profile
    profile = DeviceProfile.load(path)
    return {
        "file": str(path),
        "created": profile.created,
        "host": profile.host,
        "speed_factor": profile.speed_factor,
        "full_step_s": profile.full_step_time,
    }

"""Before a fleet run starts: the shared device profile, the pretrained start and the effective config.

Done once by the launcher (``fleet simulate``, the benchmark), not by every device, so
that all simulated devices share one measured profile and one starting checkpoint, and
the run directory holds the exact config the devices ran with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

from fleet.base.errors import ConfigError
from fleet.engine.config import config_to_dict
from fleet.engine.device_profile import DeviceProfile
from fleet.engine.experiment import check_model_fits_data, check_profile, load_data, make_model, obtain_profile
from fleet.federated.on_server.state import keep_previous_run
from fleet.federated.shared.config import FleetConfig, run_dir
from fleet.federated.shared.names import check_device_name
from fleet.federated.shared.owned import device_roots
from fleet.federated.shared.paths import resolve_path

EFFECTIVE_CONFIG = "fleet-config.yaml"


def simulated_fleet(cfg: FleetConfig, log: Callable[[str], None]) -> FleetConfig:
    """The simulated fleet's size: one device per folder of ``data.device_roots`` when set; sampling
    and the start threshold checked against it (in deployment devices come and go, so they are not)."""
    if cfg.data.device_roots:
        roots = device_roots(cfg)
        for root in roots:
            check_device_name(root.name, f"data.device_roots: sub-folder {root}")
        if cfg.devices.num_devices != len(roots):
            log(f"data.device_roots holds {len(roots)} devices: devices.num_devices = {len(roots)}")
        data = dataclasses.replace(cfg.data, device_roots=str(roots[0].parent.resolve()))
        cfg = dataclasses.replace(cfg, data=data, devices=dataclasses.replace(cfg.devices, num_devices=len(roots)))
    taking_part = cfg.devices.taking_part
    for path, value in (
        ("federation.devices_per_round", cfg.federation.devices_per_round),
        ("membership.min_devices", cfg.membership.min_devices),
    ):
        if value is not None and value > taking_part:
            raise ConfigError(
                f"{path}: {value} is more than the {taking_part} simulated devices that take part "
                f"(devices.num_devices less devices.newcomers); use at most {taking_part}, or null"
            )
    return cfg


def check_class_profiles(cfg: FleetConfig, model: torch.nn.Module) -> None:
    """Each device class's ``profile`` read and checked against the model, batch and input size as its
    devices' ClientApps will: a garbage file was refused by every device inside Flower, ten lines later."""
    for c in cfg.devices.device_classes:
        if c.profile:
            what = f"devices.device_classes ({c.name}).profile"
            profile = DeviceProfile.load(resolve_path(c.profile), field=what)
            size, source = cfg.data.input_size, f"profile {c.profile} ({what})"
            check_profile(profile, model, cfg.train.batch_size, size, source, cfg.train)


def prepare(cfg: FleetConfig, *, resume: bool, log: Callable[[str], None] = print) -> tuple[FleetConfig, Path]:
    """Profile, pretrain and write the effective config; returns it and its path."""
    cfg = simulated_fleet(cfg, log)
    if cfg.hardware.profile is not None:  # a reference profile in profiles/ is found from any working directory
        profile = str(resolve_path(cfg.hardware.profile).resolve())
        cfg = dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, profile=profile))
    if not cfg.data.device_roots:  # the shared dataset; devices' own trees are checked as they are read
        check_model_fits_data(cfg, *load_data(cfg.data, cfg.train.seed))
    if cfg.hardware.profile is not None or any(c.profile for c in cfg.devices.device_classes):
        # Every ClientApp checks them too, but there a mismatch fails each device inside Flower;
        # here it stops the launch in one line, before the previous run is moved aside.
        model = make_model(cfg.model, cfg.train.seed)
        if cfg.hardware.profile is not None:
            obtain_profile(cfg, model, log=log)
        check_class_profiles(cfg, model)
    out = run_dir(cfg)
    if not resume:
        keep_previous_run(out, cfg.name, log)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(cfg, output_dir=str(out.parent))
    if cfg.start.samples > 0 and cfg.model.weights is None:
        ckpt = out / "pretrained.pt"
        if not ckpt.exists():
            from fleet.federated.launch.pretrain import pretrain_fleet_model  # only when pretraining

            pretrain_fleet_model(cfg, ckpt, log)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, weights=str(ckpt)))
    if cfg.hardware.profile is None:
        threads = torch.get_num_threads()
        torch.set_num_threads(cfg.simulation.client_threads)  # profile as the ClientApps will run
        try:
            profile_path = out / "device-profile.yaml"
            obtain_profile(cfg, make_model(cfg.model, cfg.train.seed), profile_path, log=log)
        finally:
            torch.set_num_threads(threads)
        cfg = dataclasses.replace(cfg, hardware=dataclasses.replace(cfg.hardware, profile=str(profile_path)))
    path = out / EFFECTIVE_CONFIG
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return cfg, path

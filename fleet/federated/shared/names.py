"""Who the devices are, as both sides name them: the pattern a device name must fit, and how a device names
itself (node config, its folder, its partition, its host).

The server never takes a name from a reply on trust: it checks a claimed name against the same pattern, and a
simulation's server works out every simulated device's name the way the devices do (:func:`simulated_names`),
so both sides of a round live with one definition.
"""

from __future__ import annotations

import re
import socket
from typing import Any

from fleet.base.errors import ConfigError
from fleet.federated.shared import keys
from fleet.federated.shared.config import FleetConfig
from fleet.federated.shared.owned import device_roots

DEVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # safe as a file name and a plot label
DEVICES_DIR = "devices"  # a simulated run's folder of device state, one sub-folder per device


def check_device_name(name: str, where: str) -> str:
    """``name`` if it can name a device everywhere it is used (metrics, plots, a state directory)."""
    if not DEVICE_NAME.fullmatch(name):
        raise ConfigError(
            f"{where}: {name!r} cannot name a device; use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def device_name_of(cfg: FleetConfig, node_config: dict[str, Any], partition_id: int | None) -> str:
    """node config ``device-name``; else the device's folder under ``data.device_roots``; else
    ``device-<partition-id>``; else the host name."""
    if node_config.get(keys.NODE_DEVICE_NAME):
        return check_device_name(str(node_config[keys.NODE_DEVICE_NAME]), "node config device-name")
    if partition_id is not None and cfg.data.device_roots and not node_config.get(keys.NODE_DATA_ROOT):
        return check_device_name(device_roots(cfg)[partition_id].name, "data.device_roots sub-folder")
    if partition_id is not None:
        return f"device-{partition_id}"
    return check_device_name(socket.gethostname(), "the host name (node config device-name unset)")


def simulated_names(cfg: FleetConfig) -> dict[str, int]:
    """Every simulated device's name and partition, as the devices name themselves."""
    return {device_name_of(cfg, {}, pid): pid for pid in range(cfg.devices.num_devices)}

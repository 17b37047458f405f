"""One edge device of the fleet: its identity, tier, timing profile, memory budget and saved state.

Everything here is read from the fleet config and the device's node config (both untrusted), so
each lookup validates what it reads and names the field in its error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from fleet.atomic import load_torch, save_torch
from fleet.device_profile import DeviceProfile
from fleet.errors import ConfigError
from fleet.experiment import check_profile, make_model, obtain_profile
from fleet.federated import keys
from fleet.federated.config import FleetConfig, resolve_path, run_dir
from fleet.memory.budgeted import MemoryBudget


def tier_of(cfg: FleetConfig, partition_id: int, node_config: dict[str, Any]) -> float:
    """The device's speed tier: ``tier`` in the node config, else the config's tiers in turn."""
    if keys.NODE_TIER in node_config:
        tier = float(node_config[keys.NODE_TIER])
        if not tier > 0:
            raise ConfigError(
                f"node config tier: {tier!r} is not allowed; use a slow-down factor > 0 (1 = as profiled)"
            )
        return tier
    tiers = cfg.federation.tiers
    return float(tiers[partition_id % len(tiers)])


def partition_of(cfg: FleetConfig, node_config: dict[str, Any]) -> int:
    if keys.NODE_PARTITION_ID not in node_config:
        raise ConfigError('node config: partition-id missing; start the SuperNode with --node-config "partition-id=0"')
    pid = int(node_config[keys.NODE_PARTITION_ID])
    if not 0 <= pid < cfg.federation.num_devices:
        raise ConfigError(
            f"node config partition-id: {pid} is outside 0..{cfg.federation.num_devices - 1} "
            "(federation.num_devices); pick a partition the fleet has"
        )
    return pid


def device_profile(
    cfg: FleetConfig, model: nn.Module | None, node_config: dict[str, Any], state_dir: Path
) -> DeviceProfile:
    """This device's measured profile (node config ``profile`` or the config's), before its tier.

    A device with neither measures itself once and keeps the result in its state directory.
    """
    path = node_config.get(keys.NODE_PROFILE) or cfg.train.profile
    if path:
        base = DeviceProfile.load(resolve_path(str(path)))
        if model is not None:
            where = "node config profile" if node_config.get(keys.NODE_PROFILE) else "train.profile"
            check_profile(base, model, cfg.train.batch_size, cfg.data.input_size, f"profile {path} ({where})")
    else:
        if model is None:
            model = make_model(cfg.model, cfg.train.seed)
        base = obtain_profile(cfg, model, state_dir / "device-profile.yaml", repeats=5, log=lambda s: None)
    return base


def memory_budget_of(
    cfg: FleetConfig, partition_id: int, node_config: dict[str, Any], profile: DeviceProfile
) -> float | None:
    """The device's activation memory budget in MB (None: unlimited), from the first that sets one:
    node config ``memory-budget-mb``, the device profile's ``memory_budget_mb``,
    ``federation.memory_budgets_mb`` (device i takes entry i % len; 0 = unlimited), ``train.memory_budget_mb``."""
    if keys.NODE_MEMORY_BUDGET_MB in node_config:
        try:
            mb = float(node_config[keys.NODE_MEMORY_BUDGET_MB])
        except (TypeError, ValueError):
            mb = float("nan")
        if not mb > 0:
            raise ConfigError(
                f"node config memory-budget-mb: {node_config[keys.NODE_MEMORY_BUDGET_MB]!r} is not allowed; "
                "use a positive number of MB"
            )
        return mb
    if profile.memory_budget_mb is not None:
        return float(profile.memory_budget_mb)
    budgets = cfg.federation.memory_budgets_mb
    if budgets:
        mb = float(budgets[partition_id % len(budgets)])
        return mb if mb > 0 else None
    return cfg.train.memory_budget_mb


def device_memory(
    cfg: FleetConfig, model: nn.Module, budget_mb: float, state_dir: Path, node_config: dict[str, Any]
) -> MemoryBudget:
    """Plans for this device's budget; its memory profile is measured once and kept in its state directory."""
    shape = (cfg.train.batch_size, cfg.model.in_channels, cfg.data.input_size, cfg.data.input_size)
    spill = node_config.get(keys.NODE_SPILL_DIR) or cfg.train.spill_dir or str(state_dir / "spill")
    return MemoryBudget.measure(
        model,
        shape,
        budget_mb,
        str(spill),
        model_name=cfg.model.name,
        cache=state_dir / "memory-profile.json",
        flag="memory-budget-mb",
    )


def state_dir_of(cfg: FleetConfig, partition_id: int, node_config: dict[str, Any]) -> Path:
    """Where device state outlives a round: node config ``state-dir`` or runs/<name>/devices/<id>."""
    if node_config.get(keys.NODE_STATE_DIR):
        return Path(str(node_config[keys.NODE_STATE_DIR])).expanduser() / cfg.name
    return run_dir(cfg) / "devices" / f"device-{partition_id}"


# --- device state that must outlive a round --------------------------------


def save_state(path: Path, state: dict) -> None:
    """Atomic: a device killed mid-write keeps its previous state."""
    save_torch(path, state)


def load_state(path: Path, run_tag: str | None = None) -> dict | None:
    """The device's state from earlier rounds of this run (another run's state is ignored)."""
    state = load_torch(path)
    if state is not None and run_tag is not None and state.get("run_tag") != run_tag:
        return None
    return state

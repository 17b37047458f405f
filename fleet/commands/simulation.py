"""``fleet simulate``: the whole fleet on one machine with Flower's simulation engine.

Each device is a virtual SuperNode running the real ClientApp (one CPU each via
Ray); its clock is simulated from the shared measured profile times its tier.
The launcher measures the profile and pretrains the starting model once,
writes the effective config next to the run, then hands over to Flower.

The terminal shows fleet's own lines; Flower's and Ray's INFO chatter goes to
``<run>/flower.log`` (:mod:`fleet.commands.flower_log`).

Why flwr's internals, not its public API. ``flwr.simulation.run_simulation(server_app,
client_app, num_supernodes, backend_name, backend_config, enable_tf_gpu_growth,
verbose_logging)`` (flwr 1.42, deprecated there in favour of ``flwr run``) carries the Ray
init args (``backend_config["init_args"]``, the cluster's address included) but not the rest:

* no run config: it hands the ServerApp ``Context(run_config={})`` and builds its own empty
  ``Run`` (no FAB id, no ``override_config``), so every ClientApp's context gets an empty run
  config too (``DeprecatedRunInfoStore.register_context`` -> ``get_fused_config(run)`` -> ``{}``).
  fleet's apps read the fleet YAML's path (``config``), ``resume`` and ``simulation`` from the
  run config, on the server and on every device (a Ray cluster's remote nodes included, where
  no environment variable of this process would reach);
* no app directory: it calls ``_run_simulation`` with ``app_dir=""`` and ``is_app=False``, so
  the apps cannot be loaded by their component names (``server.server_app:app``, or a test's
  or bench's ClientApp named on the command line) with pyproject.toml's defaults fused in.

So the launch calls ``flwr.simulation.run_simulation._run_simulation`` with its own ``Run``
(``flwr.supercore.run.Run``, ``generate_rand_int_from_bytes``, ``NOOP_FEDERATION_ID``,
``TaskIdentity``), the run config fused by ``flwr.common.config.get_fused_config_from_dir`` and
``EventType.PYTHON_API_RUN_SIMULATION_LEAVE``, as ``flwr-simulation`` does for ``flwr run``. A
flwr without them stops with one line (:func:`_require_flwr_internals`); pyproject.toml pins
1.42.x.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from typing import Any

from fleet.base.errors import ConfigError, FleetError
from fleet.commands import flower_dispatch
from fleet.commands.flower_log import FLOWER_LOG, flower_output
from fleet.federated.launch.prepare import prepare
from fleet.federated.on_server.state import check_resumable
from fleet.federated.shared.config import FleetConfig, load_fleet_config, run_dir
from fleet.federated.shared.paths import APP_ROOT
from fleet.federated.shared.run_summary import SUMMARY_FILE, RunSummary

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no internet on devices; read when flwr is imported

CLIENT_APP = "client.client_app:app"
SERVER_APP = "server.server_app:app"


def _require_flwr_internals() -> None:
    """A one-line error when this flwr lacks the 1.42 internals the launch uses (the public
    run_simulation takes no run config, so this leans on them)."""
    try:
        from flwr.common.config import get_fused_config_from_dir  # noqa: F401
        from flwr.server.superlink.linkstate.utils import generate_rand_int_from_bytes  # noqa: F401
        from flwr.simulation.run_simulation import _run_simulation  # noqa: F401
        from flwr.supercore.constant import NOOP_FEDERATION_ID  # noqa: F401
        from flwr.supercore.run import Run  # noqa: F401
        from flwr.supercore.task_identity import TaskIdentity  # noqa: F401
        from flwr.supercore.telemetry import EventType  # noqa: F401
    except ImportError as exc:
        import flwr

        raise FleetError(
            f"fleet simulate needs flwr 1.42.x, found {flwr.__version__} ({exc}); "
            "pip install 'flwr[simulation]>=1.42,<1.43'"
        ) from None


def _flower_run(config_path: Path, resume: bool) -> tuple[Any, dict]:
    """The Run and fused run config `flwr-simulation` builds for `flwr run` (apps loaded by their
    component names from the app directory, the run config fused with pyproject's), without a
    detached local SuperLink left running on a shared machine."""
    from flwr.common.config import get_fused_config_from_dir
    from flwr.common.constant import RUN_ID_NUM_BYTES, SUPERLINK_NODE_ID, TASK_ID_NUM_BYTES
    from flwr.server.superlink.linkstate.utils import generate_rand_int_from_bytes
    from flwr.supercore.constant import NOOP_FEDERATION_ID
    from flwr.supercore.run import Run
    from flwr.supercore.task_identity import TaskIdentity

    overrides: dict[str, Any] = {"config": str(config_path), "resume": resume, "simulation": True}
    fused = get_fused_config_from_dir(APP_ROOT, overrides)
    run = dataclasses.replace(
        Run.create_empty(run_id=generate_rand_int_from_bytes(RUN_ID_NUM_BYTES)),
        override_config=overrides,
        federation_id=NOOP_FEDERATION_ID,
        primary_task_id=generate_rand_int_from_bytes(TASK_ID_NUM_BYTES),
    )
    TaskIdentity.task_id = 1
    TaskIdentity.run_id = run.run_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    return run, fused


def ray_init_args(address: str | None) -> dict[str, Any]:
    """What Flower's Ray backend passes to ``ray.init``: the cluster at ``address``, else a new local Ray.

    "local" is explicit because ``ray.init()`` without an address joins any cluster that
    ``ray start`` left running on this machine. Ray's driver logs at INFO into flower.log
    (flower_output keeps its terminal handler at WARNING); the actors' own stdout/stderr still
    reach the terminal, as Flower sets it up."""
    return {"address": address or "local", "logging_level": "INFO", "log_to_driver": True}


def check_ray_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A one-line error, before anything is launched, when no Ray head answers at ``address``."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise FleetError(
            f"simulation.ray_address: no Ray cluster answers at {address} ({exc.strerror or exc}); start one with "
            f"`ray start --head --port {port}` on that machine and `ray start --address {address}` on the others "
            "(docs/guide.md, 'A Ray cluster'), or drop --ray-address to simulate on this machine alone"
        ) from None


def run_simulation(
    cfg: FleetConfig,
    config_path: Path,
    *,
    resume: bool,
    verbose: bool = False,
    client_app: str = CLIENT_APP,
    server_app: str = SERVER_APP,
) -> RunSummary:
    """Run the ServerApp and N ClientApps in Flower's simulation engine; returns summary.json.

    ``client_app`` names another ClientApp (``module:attribute``), e.g. a test's faulty device;
    ``server_app`` another ServerApp (the scale bench's Flower floor)."""
    _require_flwr_internals()
    from flwr.app import Context, RecordDict
    from flwr.simulation.run_simulation import _run_simulation
    from flwr.supercore.telemetry import EventType

    run, fused = _flower_run(config_path, resume)
    if cfg.train.device == "cuda" and cfg.simulation.client_gpus == 0:
        raise ConfigError(
            "simulation.client_gpus: 0, but train.device is cuda and Ray hides the GPU from a ClientApp that "
            "reserves none; set simulation.client_gpus to a share of one GPU (e.g. 0.25 for four devices)"
        )
    backend = {
        "client_resources": {"num_cpus": cfg.simulation.client_cpus, "num_gpus": cfg.simulation.client_gpus},
        "init_args": ray_init_args(cfg.simulation.ray_address),
    }
    flower_dispatch.install()  # Flower's dispatch, asking only the nodes with a message waiting
    log_path = run_dir(cfg) / FLOWER_LOG
    context = Context(run_id=run.run_id, node_id=0, node_config={}, state=RecordDict(), run_config=fused)
    with flower_output(log_path, verbose=verbose):
        _run_simulation(
            server_app_attr=server_app,
            client_app_attr=client_app,
            num_supernodes=cfg.devices.taking_part,  # newcomers (the last partitions) never take part
            backend_name="ray",
            backend_config=backend,
            app_dir=str(APP_ROOT),
            run=run,
            server_app_context=context,
            is_app=True,
            verbose_logging=verbose,
            exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE,
        )
    summary_path = run_dir(cfg) / SUMMARY_FILE
    if not summary_path.is_file():
        raise FleetError(f"the simulation of {cfg.name} ended without {summary_path}; see the log above and {log_path}")
    return RunSummary.read(run_dir(cfg))


def simulate(
    path: str | None,
    overrides: dict[str, Any] | None = None,
    *,
    resume: bool = False,
    verbose: bool = False,
    log=print,
    client_app: str = CLIENT_APP,
    server_app: str = SERVER_APP,
) -> RunSummary:
    cfg = load_fleet_config(path, overrides)
    if cfg.simulation.ray_address is not None:
        check_ray_reachable(cfg.simulation.ray_address)  # before anything is measured
    if resume:
        check_resumable(run_dir(cfg))  # before anything is measured, moved or launched
    cfg, config_path = prepare(cfg, resume=resume, log=log)
    return run_simulation(
        cfg, config_path, resume=resume, verbose=verbose, client_app=client_app, server_app=server_app
    )

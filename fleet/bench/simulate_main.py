"""One simulation, as ``fleet simulate`` runs it, with the ClientApp named on the command line.

    python -m fleet.bench.simulate_main CONFIG CLIENT_APP [SERVER_APP]

Benchmarks run this in a subprocess of its own session (fleet/bench/launch.py), so that a hung or
crashed simulation is killed whole, Ray's workers included. It is a module rather than a program in
a string so that its imports are seen by the import checks (tests/test_architecture.py).
"""

from __future__ import annotations

import sys

from fleet.base.errors import FleetError
from fleet.commands.simulation import SERVER_APP, simulate


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    config, client_app, server_app = (*args, SERVER_APP)[:3]
    try:
        simulate(config, None, client_app=client_app, server_app=server_app)
    except FleetError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

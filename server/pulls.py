"""Flower's object pulls, looking again for an object still on its way every ``POLL_S`` instead of backing off.

Flower pulls a message's objects (its arrays travel as 5 MB chunks) in threads, and looks for one that is not
there yet again after 1, 2, 4, 8 and then every 10 s (``pull_objects``). Two pulls of a deployment start while
the objects are still arriving:

* the ServerApp sees a device's reply as soon as the device's SuperNode has announced it, and pulls it then,
  while its arrays are still crossing the device's uplink (a pi4's 22 MB take 9 s at 20 Mbit/s). On the testbed
  the reply was taken 0.5-1.8 s after its upload had ended, and every reply pulled in the same call waited as
  long (a pi5's reply, 12.6 s): the ServerApp pulls one message at a time;
* a SuperNode pulls a message the ServerApp is still pushing in the same way.

Design notes:

* **Only the wait between looks changes.** The pull, its threads, its checks and its overall limit stay
  Flower's; an object that is there is taken at the first look, as before.
* **One message's looks at a time.** Each pull is of one message (the ServerApp's pulls its replies in turn, a
  SuperNode its one message), so the looks cost a few small requests a second to the SuperLink, whatever the
  fleet's size.
* **Here, with the ServerApp.** The ServerApp may import only fleet's core and Flower, so its Flower glue is
  in ``server/``; ``fleet device supernode`` (fleet's top layer, which may import anything) takes it from here.
* **Flower internals.** It replaces the ``pull_objects`` that ``flwr.superlink.grid.http_grid`` and
  ``flwr.supernode.start_client_internal`` imported (flwr pinned: pyproject.toml);
  ``tests/test_pulls.py`` names the missing one if they change.
"""

from __future__ import annotations

import functools
from types import ModuleType

POLL_S = 0.1  # the longest an object that arrived waits to be looked for again (Flower: up to 10 s)


def quick_pulls(module: ModuleType, poll_s: float = POLL_S, **fixed: int) -> None:
    """``module``'s ``pull_objects`` (Flower's, as that module imported it) with every wait ``poll_s``, and
    ``fixed`` of its other arguments."""
    from flwr.supercore.inflatable.inflatable_utils import pull_objects

    module.pull_objects = functools.partial(pull_objects, initial_backoff=poll_s, backoff_cap=poll_s, **fixed)


def quick_server_pulls() -> None:
    """The ServerApp's pulls of its replies (its Grid over the SuperLink's runtime API)."""
    from flwr.superlink.grid import http_grid

    quick_pulls(http_grid)

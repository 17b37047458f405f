"""Flower's object pulls look again soon for an object still on its way (server.pulls)."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from types import SimpleNamespace

from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError, pull_objects

from server.pulls import POLL_S, quick_pulls


def arriving_after(seconds: float) -> tuple[Callable[[str], bytes], list[float]]:
    """A pull function whose one object is there only ``seconds`` from now, and the times it was asked."""
    ready_at, asked = time.monotonic() + seconds, []

    def pull(object_id: str) -> bytes:
        asked.append(time.monotonic())
        if asked[-1] < ready_at:
            raise ObjectUnavailableError(object_id)
        return b"content"

    return pull, asked


def test_an_object_still_arriving_is_looked_for_every_poll_not_after_flowers_backoff():
    """Flower looks again after 1 s, then 2 s: an object that lands 0.3 s in is found at 1 s, on the second look.
    The quick pull keeps looking every ``POLL_S`` and takes it at the first look after it landed."""
    module = SimpleNamespace(pull_objects=pull_objects)
    quick_pulls(module)
    pull, asked = arriving_after(0.3)
    assert module.pull_objects(["a"], pull) == {"a": b"content"}
    assert len(asked) >= 0.3 / (1.2 * POLL_S)  # looked again every POLL_S (+20% jitter), not once
    flowers, flowers_asked = arriving_after(0.3)
    assert pull_objects(["a"], flowers) == {"a": b"content"}
    assert len(flowers_asked) == 2  # Flower's own: the first look, then one after its 1 s backoff


def test_flowers_pulls_are_where_quick_pulls_replaces_them():
    """quick_pulls replaces the ``pull_objects`` two Flower modules imported, with its backoff arguments: a
    Flower upgrade that moves or renames them fails here, in one line."""
    from flwr.superlink.grid import http_grid
    from flwr.supernode import start_client_internal

    for module in (http_grid, start_client_internal):
        assert getattr(module, "pull_objects", None) is not None, f"{module.__name__}.pull_objects is gone"
    arguments = inspect.signature(pull_objects).parameters
    assert {"initial_backoff", "backoff_cap"} <= set(arguments), "pull_objects lost initial_backoff/backoff_cap"

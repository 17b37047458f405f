"""Flower's simulation dispatch, asked only about the nodes that have a message waiting.

Design note: why. Flower 1.42's simulation engine moves messages from its in-memory LinkState to the
ClientApp workers on one thread (``flwr.server.superlink.fleet.vce.vce_api.add_messages_to_queue``).
Every 0.1 s it calls ``state.get_message_ins(node_id, limit=1)`` for *every* node, and each call
walks every stored message, re-checking its expiry and federation under the state's lock. With N
nodes and M stored messages that is N x M checks a tick: at 1,000 nodes and a round's 16-32
messages, the thread kept most of a core busy (py-spy: 52% of the simulation driver's samples), on
a machine whose every core runs a device's training. The fleet's 1,000-device rounds grew longer
because the devices' own work did: they shared their cores with that loop.

Design note: what changes. The same loop, except that each tick first reads, in one pass over the
store, which nodes have an undelivered message, and asks Flower only about those, in Flower's node
order and still one message per node a tick. Flower's own ``get_message_ins`` still picks, checks
and marks each message; its expiry and federation checks still run over every stored message each
tick (once, not once per node). A node with nothing waiting got ``[]`` from Flower and gets no call
here. A message stored during a tick waits for the next, as one for a node Flower's loop had already
passed does; otherwise the same messages reach the workers in the same order.

Design note: scope. Installed by fleet's simulation launcher (:mod:`fleet.commands.simulation`) for
the simulations it runs, Flower's floor in ``fleet bench scale`` included. It needs flwr 1.42's
in-memory LinkState (``message_ins_store``, ``lock``, ``_check_stored_messages``); a state without
them is served by Flower's own loop, unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from queue import Queue
from typing import Any

TICK_S = 0.1  # Flower's own polling interval (vce_api.add_messages_to_queue)


def indexable(state: Any) -> bool:
    """Whether ``state`` is flwr 1.42's in-memory LinkState, whose store this dispatch reads."""
    return all(hasattr(state, a) for a in ("message_ins_store", "lock", "_check_stored_messages", "get_message_ins"))


def waiting_nodes(state: Any) -> set[int]:
    """The nodes with at least one message not yet delivered, in one pass over the store."""
    with state.lock:
        return {m.metadata.dst_node_id for m in state.message_ins_store.values() if m.metadata.delivered_at == ""}


def dispatch_once(state: Any, queue: Queue, nodes: Mapping[int, Any]) -> int:
    """One tick of Flower's loop, asking only the nodes with a message waiting; returns how many it queued."""
    with state.lock:
        state._check_stored_messages(set(state.message_ins_store))  # Flower's expiry and federation checks
    waiting = waiting_nodes(state)
    queued = 0
    for node_id in nodes:
        if node_id in waiting:
            for msg in state.get_message_ins(node_id=node_id, limit=1):
                queue.put(msg)
                queued += 1
    return queued


def add_messages_to_queue(state: Any, queue: Queue, nodes_mapping: Mapping[int, Any], f_stop: threading.Event) -> None:
    """Drop-in for Flower's ``add_messages_to_queue`` (same arguments, same stop event and tick)."""
    if not indexable(state):
        return _FLOWER_LOOP[0](state, queue, nodes_mapping, f_stop)
    while not f_stop.is_set():
        dispatch_once(state, queue, nodes_mapping)
        f_stop.wait(TICK_S)
    return None


_FLOWER_LOOP: list[Any] = []  # Flower's own loop, kept for a state this dispatch cannot read


def install() -> None:
    """Make Flower's simulation engine dispatch through :func:`add_messages_to_queue` (idempotent)."""
    from flwr.server.superlink.fleet.vce import vce_api

    if vce_api.add_messages_to_queue is not add_messages_to_queue:
        _FLOWER_LOOP[:] = [vce_api.add_messages_to_queue]
        vce_api.add_messages_to_queue = add_messages_to_queue

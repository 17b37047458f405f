"""Flower ServerApp of the fleet (Message API): unpack, call the core, pack.

The round is the Flower-free core's (:func:`fleet.federated.on_server.server_loop.run_fleet`, and every decision
in it the :class:`~fleet.federated.on_server.coordinator.Coordinator`'s). This module is only its
:class:`~fleet.federated.on_server.mailbox.Link` over Flower's Grid: a
:class:`~fleet.federated.shared.records.TrainOrder` and the global arrays into Messages, replies back into
:class:`~fleet.federated.shared.records.Reply` records. ``resume = true`` in the run config continues from the
last checkpoint (fleet.federated.on_server.server_run).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common.constant import SType
from flwr.serverapp import Grid, ServerApp

from fleet.federated.on_server.mailbox import Sent
from fleet.federated.on_server.server_loop import run_fleet
from fleet.federated.shared import keys
from fleet.federated.shared.config import config_from_run_config
from fleet.federated.shared.npy import npy_view
from fleet.federated.shared.packing import pack
from fleet.federated.shared.packing import unpack as unpack_arrays
from fleet.federated.shared.records import EVALUATE, QUERY, TRAIN, Reply, TrainOrder
from server.inflate import lean_inflate
from server.pulls import quick_server_pulls

app = ServerApp()
MESSAGE_TYPES = {QUERY: MessageType.QUERY, TRAIN: MessageType.TRAIN, EVALUATE: MessageType.EVALUATE}


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_config = dict(context.run_config)
    cfg = config_from_run_config(run_config)
    simulated = bool(run_config.get("simulation", False))
    lean_inflate()  # each reply's arrays rebuilt from their chunks with one copy, not three
    if not simulated:
        quick_server_pulls()  # a reply still being uploaded is taken as its last chunk lands, not seconds after
    run_fleet(GridLink(grid), cfg, resume=bool(run_config.get("resume", False)), simulated=simulated)


class GridLink:
    """The round's :class:`~fleet.federated.on_server.mailbox.Link` over Flower's Grid."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def nodes(self) -> set[str]:
        return {str(n) for n in self.grid.get_node_ids()}

    def send(
        self, nodes: list[str], kind: str, arrays: dict[str, np.ndarray] | None, order: TrainOrder | None
    ) -> list[str]:
        return [str(i) for i in self.grid.push_messages(messages(nodes, kind, arrays, order))]

    def receive(self, sent: Mapping[str, Sent]) -> list[tuple[str, Reply]]:
        out = []
        for msg in self.grid.pull_messages(list(sent)):
            msg_id = msg.metadata.reply_to_message_id
            if msg_id in sent:
                out.append((msg_id, unpack(sent[msg_id], msg)))
        return out


# --- records <-> Messages ----------------------------------------------------------------------
def messages(
    nodes: list[str], kind: str, arrays: dict[str, np.ndarray] | None = None, order: TrainOrder | None = None
) -> list[Message]:
    """One message of ``kind`` per node, all carrying the same content: the arrays and the order, if any."""
    content = RecordDict({keys.CONFIG: ConfigRecord({} if order is None else order.to_config())})
    if arrays is not None:
        packed = pack(arrays)
        content[keys.ARRAYS] = ArrayRecord({k: Array(v) for k, v in packed.buffers.items()})
        content[keys.PACKING] = ConfigRecord(packed.index)
    return [Message(content, dst_node_id=int(n), message_type=MESSAGE_TYPES[kind]) for n in nodes]


def unpack(sent: Sent, msg: Message) -> Reply:
    """What a reply says, unchecked: its claimed name, metrics and (to a train message) tensors, or why
    there are none."""
    reply = Reply(sent.node, sent.kind, sent.server_round, by_device=from_device(sent, msg))
    if msg.has_error():
        reply.error = msg.error.reason
        return reply
    content = msg.content
    if keys.DEVICE in content.config_records:
        name = content.config_records[keys.DEVICE].get(keys.DEVICE_NAME)
        reply.name = name if isinstance(name, str) else None
    reply.metrics = dict(content.metric_records.get(keys.METRICS, {}))
    if keys.METRICS not in content.metric_records:
        reply.problem = f"no '{keys.METRICS}' MetricRecord"
    if sent.kind != TRAIN:
        return reply
    if len(content.array_records) != 1 or keys.PACKING not in content.config_records:
        reply.problem = f"expected one ArrayRecord and its '{keys.PACKING}', got {len(content.array_records)}"
        return reply
    buffers = {}
    for name, arr in next(iter(content.array_records.values())).items():
        try:
            buffers[name] = array_view(arr)
        except Exception as exc:  # a corrupt payload is the device's fault, not the round's
            reply.problem = reply.problem or f"buffer {name!r} cannot be decoded ({type(exc).__name__})"
            return reply
    try:
        reply.arrays = unpack_arrays(buffers, dict(content.config_records[keys.PACKING]))
    except ValueError as exc:
        reply.problem = reply.problem or f"its tensors cannot be unpacked: {exc}"
    return reply


def from_device(sent: Sent, msg: Message) -> bool:
    """False for a reply the SuperLink wrote in the device's stead ("Node Unavailable" once its
    heartbeat stopped): the device itself did not answer."""
    return msg.metadata.src_node_id == sent.node


def array_view(arr: Array) -> np.ndarray:
    """The tensor a reply carries, read in place from the message's bytes (read-only): ``Array.numpy()`` copies
    every reply's model, 45 MB a ResNet-18, while the server waits to aggregate. Anything but a plain numeric
    ``.npy`` raises, as ``Array.numpy()`` would."""
    if arr.stype != SType.NUMPY:
        raise TypeError(f"serialization type {arr.stype!r} is not {SType.NUMPY!r}")
    return npy_view(arr.data)

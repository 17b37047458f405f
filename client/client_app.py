"""Flower ClientApp of one edge device (Message API): a thin adapter.

Each handler unpacks the Message, calls the device's Flower-free task in
:mod:`fleet.federated.on_device.tasks`, and packs the result into its reply:

train:    the global tensors and the round's config in; only the trained tensors out.
evaluate: accuracy of the global model and of this device's personalized model.
query:    who the device is, and its full-training time for a round (the server's default deadline).
prepare:  not a message: what the next one needs besides its weights, made while its bytes download.

Every reply carries the device's name in a ConfigRecord (MetricRecords hold numbers only).
"""

from __future__ import annotations

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SType

from fleet.federated.on_device import tasks
from fleet.federated.shared import keys
from fleet.federated.shared.config import config_from_run_config
from fleet.federated.shared.npy import npy_view
from fleet.federated.shared.packing import pack, read_only_tensors, unpack

app = ClientApp()


def device_of(context: Context) -> tasks.Device:
    run_config = dict(context.run_config)
    simulated = bool(run_config.get("simulation", False))  # a simulation worker serves many messages
    return tasks.Device.from_configs(config_from_run_config(run_config), context.node_config, long_lived=simulated)


def _reply(msg: Message, device: tasks.Device, metrics: dict, arrays: dict | None = None) -> Message:
    content = RecordDict(
        {keys.METRICS: MetricRecord(metrics), keys.DEVICE: ConfigRecord({keys.DEVICE_NAME: device.name})}
    )
    if arrays is not None:
        put_arrays(content, arrays)
    return Message(content, reply_to=msg)


def put_arrays(content: RecordDict, arrays: dict) -> None:
    """``arrays`` (name -> tensor) into ``content`` as the wire carries them: packed, a few buffers and their
    index (fleet.federated.shared.packing)."""
    packed = pack(arrays)
    content[keys.ARRAYS] = ArrayRecord({k: Array(v) for k, v in packed.buffers.items()})
    content[keys.PACKING] = ConfigRecord(packed.index)


def prepare(context: Context) -> None:
    """What this device's next message needs besides its weights, made before its bytes are in: ``fleet device
    runtime`` calls this while they download (fleet.federated.on_device.tasks.prepare)."""
    tasks.prepare(device_of(context))


@app.query()
def query(msg: Message, context: Context) -> Message:
    device = device_of(context)
    return _reply(msg, device, tasks.query(device))


@app.train()
def train(msg: Message, context: Context) -> Message:
    return train_device(msg, device_of(context))


def train_device(msg: Message, device: tasks.Device) -> Message:
    """The train reply of ``device`` (the robustness bench hands in one that trains on altered data)."""
    weights = global_weights(msg)
    result = tasks.train(device, weights, msg.content[keys.CONFIG])
    return _reply(msg, device, result.metrics, result.arrays)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    has_config = keys.CONFIG in msg.content.config_records
    config = dict(msg.content[keys.CONFIG]) if has_config else None
    device = device_of(context)
    weights = global_weights(msg)
    return _reply(msg, device, tasks.evaluate(device, weights, config))


def global_weights(msg: Message) -> dict:
    """The global model a message carries, name -> torch tensor over the message's bytes (read-only): the
    device's model casts them into its own storage (``to_torch_state_dict`` copies each twice: 45 MB a message)."""
    return read_only_tensors(arrays_of(msg.content))


def arrays_of(content: RecordDict) -> dict:
    """The tensors ``content`` carries (packed), name -> read-only view of its bytes."""
    buffers = {}
    for name, arr in content[keys.ARRAYS].items():
        if arr.stype != SType.NUMPY:
            raise TypeError(f"buffer {name!r}: serialization type {arr.stype!r} is not {SType.NUMPY!r}")
        buffers[name] = npy_view(arr.data)
    return unpack(buffers, dict(content[keys.PACKING]))

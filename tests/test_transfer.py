"""Compact transfers (``federation.transfer``): a model's float tensors cross the network in float16 by
default (down, the values; up, each tensor's change from the model sent), are checked in that dtype and
counted as they came, and are decoded to the model's values once, at the boundary, before anything averages
them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fleet.federated.on_server.coordinator import Coordinator
from fleet.federated.on_server.server_run import initial_arrays
from fleet.federated.on_server.state import ServerState
from fleet.federated.shared.records import QUERY, TRAIN
from fleet.federated.shared.transfer import decode, encode, encode_upload, upload_values, wire_bytes, wire_dtype
from tests.test_coordinator import FULL_TIMES, NODES, TRAINED, config, query, train_reply


def test_floats_cross_in_the_transfer_dtype_and_integers_as_they_are():
    model = {"w": np.linspace(-1, 1, 1000, dtype=np.float32), "n": np.array(7, dtype=np.int64)}
    sent = encode(model, "float16")
    assert sent["w"].dtype == np.float16 and sent["n"].dtype == np.int64 and sent["n"] == 7
    assert wire_bytes(sent["w"], "float16") == wire_bytes(model["w"], "float16") == 2000
    assert wire_bytes(model["n"], "float16") == 8 and wire_bytes(model["w"], "float32") == 4000
    assert np.abs(sent["w"].astype(np.float32) - model["w"]).max() <= 2**-11  # float16's rounding below 1
    assert encode(model, "float32")["w"] is model["w"]  # float32 is sent as it is: no copy
    assert wire_bytes(torch.ones(3), "float16") == 6 and wire_dtype(np.dtype("int64"), "float16") == np.int64


def test_an_upload_is_its_change_in_float16_added_back_to_the_servers_float32_copy():
    server = {"w": np.linspace(-1, 1, 1000, dtype=np.float32) + np.float32(1e-4), "n": np.array(7, dtype=np.int64)}
    received = {n: torch.from_numpy(a.copy()) for n, a in encode(server, "float16").items()}  # what the device got
    trained = {"w": received["w"].float() + 1e-3 * torch.arange(1000) / 1000, "n": torch.tensor(8)}
    upload = encode_upload(trained, received, "float16")
    assert upload["w"].dtype == torch.float16 and upload["n"].dtype == torch.int64
    assert float(upload["w"].abs().max()) <= 1e-3  # the change, not the weight
    values = upload_values(upload, received, "float16")  # what the device meant, as its own side reads it
    assert float((values["w"] - trained["w"]).abs().max()) <= 1e-3 * 2**-10
    back = decode({n: t.numpy() for n, t in upload.items()}, server, "float16")
    change = back["w"] - server["w"]  # added to the server's own copy: float16's rounding of the weight is gone
    assert back["w"].dtype == np.float32 and back["n"] == 8
    np.testing.assert_allclose(change, (trained["w"] - received["w"].float()).numpy(), atol=1e-3 * 2**-10)
    plain = {n: t.numpy() for n, t in encode_upload(trained, received, "float32").items()}
    assert decode(plain, server, "float32")["w"] is plain["w"]  # float32 carries values, as they are


def float16_fleet() -> tuple[Coordinator, set[str]]:
    cfg = config()
    cfg = dataclasses.replace(cfg, federation=dataclasses.replace(cfg.federation, transfer="float16"))
    coord, connected = Coordinator(cfg, ServerState(run_tag="f16"), initial_arrays(cfg)), set(NODES)
    coord.open_round(connected)
    coord.take(1, QUERY, [query(n, f"device-{i}", t) for i, (n, t) in enumerate(zip(NODES, FULL_TIMES))], connected)
    return coord, connected


def test_a_float16_upload_is_counted_as_it_came_and_averaged_in_the_models_dtype():
    coord, connected = float16_fleet()
    plan = coord.plan_round(1, coord.eligible(connected), connected)
    sent = coord.arrays
    assert all(a.dtype == np.float16 for a in coord.outgoing().values() if a.dtype.kind == "f")
    assert coord.full_bytes == sum(a.size * 2 for a in sent.values() if a.dtype.kind == "f")  # the deadline's price
    replies = [train_reply(n, 1, sent, 0.1) for n in NODES[:2]]
    for r in replies:  # as a device sends them: each tensor's change from the model it was sent, in float16
        r.arrays = {n: (a - sent[n]).astype(np.float16) for n, a in r.arrays.items()}
    coord.close_train(plan, coord.take(1, TRAIN, replies, connected))
    assert not coord.state.replies.rejections, coord.state.replies.rejections
    counted = [r.bytes_uploaded for r in coord.state.replies.train]
    assert counted == [sum(sent[n].size * 2 for n in TRAINED)] * 2, counted
    for name in TRAINED:
        assert coord.arrays[name].dtype == np.float32
        np.testing.assert_allclose(coord.arrays[name], sent[name] + 0.1, atol=0.1 * 2**-10)  # float16's, of the step


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_upload_wider_than_the_transfer_dtype_is_rejected_naming_it(dtype):
    coord, connected = float16_fleet()
    plan = coord.plan_round(1, coord.eligible(connected), connected)
    honest = train_reply(NODES[0], 1, coord.arrays, 0.1)
    honest.arrays = {n: (a - coord.arrays[n]).astype(np.float16) for n, a in honest.arrays.items()}
    wide = train_reply(NODES[1], 1, coord.arrays, 0.1)  # twice (or four times) the bytes the round priced
    wide.arrays = {n: a.astype(dtype) for n, a in wide.arrays.items()}
    coord.close_train(plan, coord.take(1, TRAIN, [honest, wide], connected))
    (rejection,) = coord.state.replies.rejections
    assert rejection.device == "device-1", rejection
    assert f"has dtype {np.dtype(dtype)}, the fleet sends float16" in rejection.reason, rejection


def test_statistics_are_judged_as_the_values_their_changes_make():
    """A variance's change is negative whenever it shrinks: the check reads the value it stands for."""
    coord, connected = float16_fleet()
    plan = coord.plan_round(1, coord.eligible(connected), connected)
    sent, var = coord.arrays, "bn1.running_var"

    def upload(node: str, shrink: float):
        reply = train_reply(node, 1, sent, 0.1)
        reply.arrays = {n: (a - sent[n]).astype(np.float16) for n, a in reply.arrays.items()}
        reply.arrays[var] = (-shrink * sent[var]).astype(np.float16)
        return reply

    coord.close_train(plan, coord.take(1, TRAIN, [upload(NODES[0], 0.5), upload(NODES[1], 2.0)], connected))
    (rejection,) = coord.state.replies.rejections
    assert rejection.device == "device-1" and "negative variance" in rejection.reason, rejection
    assert [r.device for r in coord.state.replies.train] == ["device-0"]

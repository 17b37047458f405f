"""The server's aggregation: masked averaging and rejection of malformed replies, through the coordinator,
and the ServerApp's translation of real Flower messages into the records it takes."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import pytest

from fleet.federated.on_server.accept import ModelNames, last_step
from fleet.federated.on_server.aggregate import error_summary, global_importance, masked_average
from fleet.federated.on_server.coordinator import Coordinator, PlannedRound
from fleet.federated.on_server.membership import member
from fleet.federated.on_server.state import RoundReplies, ServerState
from fleet.federated.shared.config import fleet_config_from_dict
from fleet.federated.shared.records import EVALUATE, TRAIN, Accuracy, Reply, TrainOrder


def reply(
    node: int,
    arrays: dict[str, np.ndarray] | None,
    samples: float = 10,
    partition: int | None = None,
    error: str | None = None,
) -> Reply:
    """A train reply as the ServerApp hands it to the coordinator (unpacked, unchecked)."""
    if error is not None:
        return Reply(node, TRAIN, 1, error=error)
    metrics = device_metrics(samples, selected=len(arrays or {}))
    metrics["partition-id"] = node if partition is None else partition
    return Reply(node, TRAIN, 1, metrics=metrics, arrays=dict(arrays or {}))


def device_metrics(samples: float, selected: int) -> dict:
    """Every metric an honest device reports with its trained tensors (fleet.federated.shared.schema.TRAIN)."""
    return {
        "num-examples": samples,
        "tier": 1.0,
        "selected": selected,
        "num-tensors": 3,
        "trained-fraction": 0.5,
        "rho": 0.5,
        "predicted-time-s": 1.0,
        "measured-time-s": 0.8,
        "full-time-s": 2.0,
        "speedup": 2.0,
        "bytes-uploaded": 4,
        "loss": 0.5,
        "steps": 10,
    }


def coordinator(
    global_arrays: dict[str, np.ndarray],
    params: list[str] | None = None,
    robust: dict[str, Any] | None = None,
    **sections: dict[str, Any],
) -> Coordinator:
    """Plain masked mean and no norm bound unless told otherwise: these tests are about masking, not the defense;
    uploads in float32, so the averages are exact (float16's are tests/test_transfer.py's)."""
    robust = {"aggregation": "mean", "norm_bound": None, **(robust or {})}
    federation = {"transfer": "float32", **sections.pop("federation", {})}
    cfg = fleet_config_from_dict({"robust": robust, "federation": federation, **sections})
    arrays = {k: v.copy() for k, v in global_arrays.items()}
    c = Coordinator(cfg, ServerState(), arrays, names=ModelNames(params or list(global_arrays)))
    c.state.roster = {"12": member("pi-12", 1.0)}
    return c


def train(c: Coordinator, server_round: int, replies: list[Reply]) -> dict[str, np.ndarray]:
    """One round's train replies into the coordinator, as the ServerApp hands them over; the new global arrays."""
    c.state.replies = RoundReplies(sent=c.arrays)  # what open_round and plan_round leave
    order = TrainOrder(server_round, c.cfg.federation.strategy, 0.0, "t")
    c.close_train(PlannedRound(server_round, [], order, 60.0, 30.0), replies)
    return c.arrays


GLOBAL = {
    "a": np.zeros((2, 2), np.float32),
    "b": np.ones(3, np.float32),
    "c": np.full(2, 7.0, np.float32),  # trained by nobody below
}


def test_masked_average_weights_by_samples_over_senders_only():
    s = coordinator(GLOBAL)
    r1 = reply(11, {"a": np.full((2, 2), 1.0, np.float32), "b": np.full(3, 3.0, np.float32)}, samples=10)
    r2 = reply(12, {"a": np.full((2, 2), 4.0, np.float32)}, samples=30)
    out = train(s, 1, [r1, r2])
    assert set(out) == set(GLOBAL)  # never truncated to a subset
    np.testing.assert_allclose(out["a"], (10 * 1.0 + 30 * 4.0) / 40)  # both trained a
    np.testing.assert_allclose(out["b"], 3.0)  # only device 11 trained b: its value, not diluted by 12
    np.testing.assert_array_equal(out["c"], GLOBAL["c"])  # trained by nobody: keeps its value
    assert out["a"].dtype == np.float32
    assert s.state.replies.senders == {"a": 2, "b": 1}
    assert len(s.state.replies.train) == 2
    assert s.state.global_importance["c"] == 0.0
    assert s.state.global_importance["a"] == pytest.approx(4 * 3.25**2 / s.cfg.train.lr)


def test_masked_average_function_matches_formula():
    rng = np.random.default_rng(0)
    g = {"w": rng.normal(size=5).astype(np.float32)}
    ups = [({"w": rng.normal(size=5).astype(np.float32)}, float(m)) for m in (3, 5, 9)]
    out, counts = masked_average(g, ups)
    expected = sum(m * u["w"].astype(np.float64) for u, m in ups) / 17
    np.testing.assert_allclose(out["w"], expected, rtol=1e-6)
    assert counts == {"w": 3}


@pytest.mark.parametrize(
    "arrays, reason",
    [
        ({"zzz": np.zeros(3, np.float32)}, "unknown tensor 'zzz'"),
        ({"b": np.zeros(4, np.float32)}, "shape (4,)"),
        ({"b": np.zeros(3, np.float64)}, "dtype float64"),
        ({"b": np.array([1.0, np.nan, 2.0], np.float32)}, "non-finite"),
        ({"b": np.array([1.0, np.inf, 2.0], np.float32)}, "non-finite"),
    ],
)
def test_malformed_reply_is_rejected_and_round_goes_on(arrays, reason, caplog):
    s = coordinator(GLOBAL)
    good = reply(11, {"b": np.full(3, 5.0, np.float32)}, samples=10)
    bad = reply(12, arrays, samples=1000, partition=3)
    with caplog.at_level(logging.WARNING, logger="fleet.server"):
        out = train(s, 4, [good, bad])
    np.testing.assert_allclose(out["b"], 5.0)  # the bad device's 1000 samples did not count
    assert len(s.state.replies.rejections) == 1
    rej = s.state.replies.rejections[0]
    assert (rej.server_round, rej.node_id, rej.device) == (4, 12, "pi-12")  # the roster's name for node 12
    assert reason in rej.reason
    assert "device pi-12 (node 12)" in caplog.text and reason in caplog.text


def test_failed_device_and_bad_weight_are_rejected():
    s = coordinator(GLOBAL)
    failed = reply(13, None, error="device 2 failed on purpose")
    zero = reply(14, {"b": np.zeros(3, np.float32)}, samples=0)
    good = reply(11, {"a": np.ones((2, 2), np.float32)}, samples=5)
    out = train(s, 2, [failed, zero, good])
    assert [r.node_id for r in s.state.replies.rejections] == [13, 14]
    assert "failed on purpose" in s.state.replies.rejections[0].reason
    assert "num-examples" in s.state.replies.rejections[1].reason
    np.testing.assert_allclose(out["a"], 1.0)
    np.testing.assert_array_equal(out["b"], GLOBAL["b"])


def test_no_usable_reply_keeps_global_model():
    s = coordinator(GLOBAL)
    before = s.arrays
    out = train(s, 1, [reply(12, {"q": np.zeros(1, np.float32)})])
    assert out is before and s.state.replies.train == [] and s.state.replies.senders == {}
    train(s, 2, [reply(1, {"a": np.zeros((2, 2), np.float32)})])
    assert s.state.replies.rejections == [] and len(s.state.replies.train) == 1  # a sound reply passes every check


def deadline(nodes: list[str], roster: dict, **federation: Any) -> float:
    """The deadline a coordinator sets for ``nodes`` (the deadline bounds compute only unless told)."""
    c = coordinator(GLOBAL, federation={"deadline_includes_upload": False, **federation})
    c.state.roster = roster
    return c.deadline(nodes)


def test_deadline_is_fastest_full_time_and_zero_for_fedavg():
    roster = {"1": member("a", 4.0), "2": member("b", 1.5), "3": member("c", 6.0)}
    assert deadline([], roster) == 0.0  # nothing known yet: devices train fully
    assert deadline(["1", "2", "3"], roster) == 1.5
    assert deadline(["1", "3"], roster) == 4.0  # the fastest of the devices eligible now
    assert deadline(["1", "2"], roster, deadline_factor=2.0) == 3.0
    assert deadline(["1", "2"], roster, deadline_factor=2.0, deadline_s=0.7) == 0.7
    assert deadline(["1", "2"], roster, deadline_factor=2.0, deadline_s=0.7, strategy="fedavg") == 0.0


def test_deadline_adds_the_full_upload_when_it_covers_uploads():
    full_bytes = sum(a.nbytes for a in GLOBAL.values())  # every float tensor: nothing is personal here
    c = coordinator(GLOBAL, ["a"], devices={"bandwidth_bytes_per_s": full_bytes / 2.5})  # a full upload: 2.5 s
    c.state.roster = {"1": member("a", 4.0), "2": member("b", 1.5)}
    assert c.deadline(["1", "2"]) == 4.0  # the fastest device's round: full training plus full upload


RELAYED = (
    "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:"
    "<'\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=1)\n"
    '  File "/x/torch/serialization.py", line 1312, in _save\n    zip_file.write_record(name, storage, num_bytes)\n'
    "OSError: [Errno 28] No space left on device\n\nDuring handling of the above exception, another "
    "exception occurred:\n\n"
    "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 61144000 vs 61143896\n"
    "flwr.clientapp.client_app.ClientAppException: \nException ClientAppException occurred.'>"
)


def test_a_device_failure_is_logged_in_one_line():
    """A simulated ClientApp's error reaches the server wrapped in Ray's and Flower's tracebacks,
    with terminal colours; the rejection names the root cause alone."""
    s = coordinator(GLOBAL)
    train(s, 1, [reply(13, None, error=RELAYED), reply(11, {"a": np.ones((2, 2), np.float32)})])
    assert s.state.replies.rejections[0].reason == "device failed: OSError: [Errno 28] No space left on device"
    assert error_summary("x" * 500).endswith("...") and len(error_summary("x" * 500)) == 300
    assert error_summary("") == "no reason given"
    deployed = "<class 'fleet.base.errors.DataError'>:<'node config data-root: class folder 'unicorn' is unknown'>"
    assert error_summary(deployed) == "DataError: node config data-root: class folder 'unicorn' is unknown"


def eval_reply(node: int, metrics: dict) -> Reply:
    return Reply(node, EVALUATE, 3, metrics=metrics)


def test_bad_evaluation_replies_are_left_out_not_crashing_the_server(caplog):
    """A reply without accuracies (e.g. a train reply arriving while the round evaluates) or with an
    impossible one is left out of the round's accuracy, with a line naming the device."""
    s = coordinator(GLOBAL)
    good = eval_reply(11, {"num-examples": 10, "global-accuracy": 0.5, "personal-accuracy": 0.75})
    train_like = eval_reply(12, {"num-examples": 10, "loss": 0.3})
    huge = eval_reply(13, {"num-examples": 10, "global-accuracy": 1e6, "personal-accuracy": 0.5})
    with caplog.at_level(logging.WARNING, logger="fleet.server"):
        s.close_evaluate(3, [good, train_like, huge])
    assert s.state.replies.accuracy == Accuracy(global_accuracy=0.5, personal_accuracy=0.75)  # nothing fine-tuned
    assert [r.node_id for r in s.state.replies.evaluation] == [11]
    assert "evaluation from device pi-12 (node 12) failed: metric 'global-accuracy' is missing" in caplog.text
    assert "(node 13) failed: metric 'global-accuracy' must be in [0, 1], got 1000000.0" in caplog.text


def test_server_momentum_moves_only_the_tensors_someone_trained():
    from fleet.federated.on_server.aggregate import momentum_step

    cur = {"w": np.zeros(2, np.float32), "v": np.ones(2, np.float32), "bn.running_mean": np.zeros(2, np.float32)}
    new = {"w": np.full(2, 1.0, np.float32), "v": cur["v"], "bn.running_mean": np.full(2, 0.5, np.float32)}
    out, mom = momentum_step(cur, new, {"w": 3, "bn.running_mean": 3}, {}, ["w", "v"], beta=0.9)
    np.testing.assert_allclose(out["w"], 1.0)  # the first round: the update itself
    out2, mom2 = momentum_step(out, {**out, "w": out["w"] + 1.0}, {"w": 2}, mom, ["w", "v"], beta=0.9)
    np.testing.assert_allclose(out2["w"], 1.0 + 0.9 * 1.0 + 1.0)  # the second: the update plus 0.9 of the first
    np.testing.assert_allclose(mom2["w"], 1.9)
    assert "v" not in mom2 and np.array_equal(out2["v"], cur["v"])  # trained by nobody: never moved
    np.testing.assert_allclose(out["bn.running_mean"], 0.5)  # statistics are taken as averaged, not stepped
    out3, mom3 = momentum_step(out2, out2, {}, mom2, ["w", "v"], beta=0.9)  # a round nobody trained w
    assert np.array_equal(out3["w"], out2["w"]) and np.array_equal(mom3["w"], mom2["w"])


def test_the_server_momentum_survives_a_checkpoint(tmp_path):
    from fleet.federated.on_server.state import load_checkpoint, save_checkpoint

    state = ServerState(run_tag="r", round=3, momentum={"w": np.full(4, 0.25, np.float32)})
    save_checkpoint(tmp_path, {"w": np.zeros(4, np.float32)}, state)
    _, loaded = load_checkpoint(tmp_path)
    assert loaded.round == 3 and np.array_equal(loaded.momentum["w"], state.momentum["w"])


def test_a_coordinator_with_server_momentum_steps_further_along_a_repeated_update():
    s = coordinator(GLOBAL, federation={"server_momentum": 0.5, "server_lr": 1.0})
    after_one = train(s, 1, [reply(12, {"a": GLOBAL["a"] + 1.0})])["a"]
    np.testing.assert_allclose(after_one, 1.0)
    second = train(s, 2, [reply(12, {"a": after_one + 1.0})])
    np.testing.assert_allclose(second["a"], 1.0 + 1.0 + 0.5)  # without momentum: 2.0
    np.testing.assert_allclose(second["c"], 7.0)  # trained by nobody


# --- the ServerApp's translation: real Flower Messages into records -------------------------------
def flower_reply(node: int, content=None, error: str | None = None, kind: str = TRAIN):
    """A reply as the SuperLink hands it to the ServerApp, with the mailbox's note of what it answers."""
    from flwr.app import Error, Message, Metadata

    from fleet.federated.on_server.mailbox import Sent

    meta = Metadata(
        run_id=1,
        message_id=f"m{node}",
        src_node_id=node,
        dst_node_id=1,
        reply_to_message_id="i",
        group_id="1",
        created_at=time.time(),
        ttl=60.0,
        message_type=kind,
    )
    msg = Message(error=Error(code=0, reason=error), metadata=meta) if error else Message(content, metadata=meta)
    return Sent(kind, node, 1), msg


def test_the_server_app_unpacks_flower_replies_into_records_and_keeps_the_checks():
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    from client.client_app import put_arrays
    from server.server_app import unpack

    arrays = {"a": np.full((2, 2), 2.0, np.float32)}
    name = ConfigRecord({"device-name": "pi-11"})
    good = RecordDict({"metrics": MetricRecord(device_metrics(10, 1)), "device": name})
    put_arrays(good, arrays)
    r = unpack(*flower_reply(11, good))
    assert (r.node_id, r.kind, r.server_round, r.name, r.error, r.problem) == (11, TRAIN, 1, "pi-11", None, None)
    np.testing.assert_array_equal(r.arrays["a"], arrays["a"])
    assert r.metrics == device_metrics(10, 1) and r.by_device
    failed = unpack(*flower_reply(13, error=RELAYED))
    two = RecordDict({"x": ArrayRecord({}), "y": ArrayRecord({}), "metrics": MetricRecord({})})
    no_metrics = RecordDict({})
    put_arrays(no_metrics, arrays)
    s = coordinator(GLOBAL)
    out = train(s, 1, [r, failed, unpack(*flower_reply(14, two)), unpack(*flower_reply(15, no_metrics))])
    reasons = [j.reason for j in s.state.replies.rejections]
    assert reasons == [
        "device failed: OSError: [Errno 28] No space left on device",
        "expected one ArrayRecord and its 'packing', got 2",
        "no 'metrics' MetricRecord",
    ]
    np.testing.assert_allclose(out["a"], 2.0)


def packed_reply(buffer, index: dict | None = None):
    """A train reply whose one float32 buffer holds tensor ``a`` of shape (2, 3) (or as ``index`` says)."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    from server.server_app import unpack

    index = index or {"names": ["a"], "dtypes": ["float32"], "ndims": [2], "shapes": [2, 3]}
    content = {"arrays": ArrayRecord({"float32": buffer}), "packing": ConfigRecord(index)}
    return unpack(*flower_reply(11, RecordDict({**content, "metrics": MetricRecord(device_metrics(10, 1))})))


def test_reply_tensors_are_read_in_place_and_a_payload_that_is_not_a_plain_npy_is_refused():
    """The server reads a reply's tensors from the message's bytes, without a copy; a truncated payload, an
    object array (np.load would need pickle), junk or a layout that does not fit is the device's fault: its
    reply is refused, named."""
    import io

    from flwr.app import Array

    sent = Array(np.arange(6, dtype=np.float32))
    got = packed_reply(sent).arrays["a"]
    np.testing.assert_array_equal(got, np.arange(6, dtype=np.float32).reshape(2, 3))
    assert np.shares_memory(got, np.frombuffer(sent.data, np.uint8))  # a view of the message's bytes, no copy
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    bad = {
        "truncated": sent.data[:-4],
        "an object array": pickled.getvalue(),
        "junk": b"not a tensor at all",
    }
    for what, data in bad.items():
        reply = packed_reply(Array(dtype="float32", shape=(6,), stype="numpy.ndarray", data=data))
        assert reply.problem is not None and reply.problem.startswith("buffer 'float32' cannot be decoded"), what
    wide = {"names": ["a"], "dtypes": ["float32"], "ndims": [2], "shapes": [2, 4]}
    assert packed_reply(sent, wide).problem == (
        "its tensors cannot be unpacked: tensor 'a': its buffer 'float32' ends before it does"
    )


def test_a_device_reads_the_global_model_from_the_message_and_its_model_holds_its_own_copy():
    """The ClientApp's tensors equal the arrays the server packed, Fortran order included, and are views of the
    message's bytes (nothing copied to read them); the model a device fills from them owns its values, so its
    training leaves the message alone; a foreign serialization is refused."""
    import torch
    from flwr.app import Array, ConfigRecord, RecordDict

    from client.client_app import global_weights, put_arrays

    arrays = {"w": np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)), "n": np.array(7, np.int64)}
    content = RecordDict({"config": ConfigRecord({})})
    put_arrays(content, arrays)
    _, msg = flower_reply(1, content)
    got = global_weights(msg)
    assert list(got) == ["w", "n"] and len(content["arrays"]) == 2  # one buffer per dtype
    for name, tensor in got.items():
        assert torch.equal(tensor, torch.from_numpy(np.array(arrays[name], order="C")))
        assert tensor.dtype == torch.from_numpy(arrays[name]).dtype
        buffer = content["arrays"][arrays[name].dtype.name]
        assert np.shares_memory(tensor.numpy(), np.frombuffer(buffer.data, np.uint8))
    model = torch.nn.Linear(4, 3, bias=False)
    model.register_buffer("n", torch.tensor(0))
    model.load_state_dict({"weight": got["w"], "n": got["n"]}, strict=True)  # as tasks.Prepared.holding does
    with torch.no_grad():
        model.weight.add_(1.0)
        model.n.add_(1)
    assert torch.equal(global_weights(msg)["w"], torch.from_numpy(np.array(arrays["w"], order="C")))
    assert int(global_weights(msg)["n"]) == 7
    content["arrays"]["float32"] = Array(dtype="float32", shape=(1,), stype="torch.Tensor", data=b"1234")
    with pytest.raises(TypeError, match="buffer 'float32': serialization type"):
        global_weights(msg)


def test_global_importance_is_the_squared_step_over_lr_in_float64_and_zero_for_a_tensor_that_did_not_move():
    rng = np.random.default_rng(0)
    before = {"a": rng.normal(size=(300, 300)).astype(np.float32), "b": np.ones(4, np.float32)}
    after = {"a": before["a"] + np.float32(1e-3) * rng.normal(size=(300, 300)).astype(np.float32), "b": before["b"]}
    steps = last_step(before, after, ["a", "b"])
    assert list(steps) == ["a"]  # "b" did not move
    got = global_importance(steps, ["a", "b"], lr=0.01)
    exact = float(np.sum((after["a"].astype(np.float64) - before["a"]) ** 2)) / 0.01
    assert got["b"] == 0.0 and abs(got["a"] - exact) <= 1e-6 * exact

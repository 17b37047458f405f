"""ElasticFedAvg: masked aggregation and rejection of malformed replies, on real Flower messages."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Error, Message, MessageType, Metadata, MetricRecord, RecordDict

from fleet.federated.aggregate import error_summary, masked_average
from fleet.federated.membership import member
from fleet.federated.robust import Defense
from fleet.federated.state import ServerState
from server.strategy import ElasticFedAvg, check_reply


def reply(
    node: int,
    arrays: dict[str, np.ndarray] | None,
    samples: int = 10,
    partition: int | None = None,
    error: str | None = None,
) -> Message:
    """A train reply as the SuperLink hands it to the ServerApp."""
    meta = Metadata(
        run_id=1,
        message_id=f"m{node}",
        src_node_id=node,
        dst_node_id=1,
        reply_to_message_id="i",
        group_id="1",
        created_at=time.time(),
        ttl=60.0,
        message_type=MessageType.TRAIN,
    )
    if error is not None:
        return Message(error=Error(code=0, reason=error), metadata=meta)
    metrics = device_metrics(samples, selected=len(arrays or {}))
    metrics["partition-id"] = node if partition is None else partition
    content = RecordDict(
        {"arrays": ArrayRecord({k: Array(v) for k, v in (arrays or {}).items()}), "metrics": MetricRecord(metrics)}
    )
    return Message(content=content, metadata=meta)


def device_metrics(samples: float, selected: int) -> dict:
    """Every metric an honest device reports with its trained tensors (fleet.federated.schema.TRAIN)."""
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


def make_strategy(global_arrays: dict[str, np.ndarray], defense: Defense | None = None) -> ElasticFedAvg:
    """Plain masked mean unless told otherwise: these tests are about masking, not about the defense."""
    s = ElasticFedAvg(ServerState(), param_names=list(global_arrays), defense=defense or Defense(norm_bound=None))
    s.state.replies.sent = {k: v.copy() for k, v in global_arrays.items()}  # what train_messages keeps
    s.state.roster = {"12": member("pi-12", 1.0)}
    return s


GLOBAL = {
    "a": np.zeros((2, 2), np.float32),
    "b": np.ones(3, np.float32),
    "c": np.full(2, 7.0, np.float32),  # trained by nobody below
}


def test_masked_average_weights_by_samples_over_senders_only():
    s = make_strategy(GLOBAL)
    r1 = reply(11, {"a": np.full((2, 2), 1.0, np.float32), "b": np.full(3, 3.0, np.float32)}, samples=10)
    r2 = reply(12, {"a": np.full((2, 2), 4.0, np.float32)}, samples=30)
    record, metrics = s.aggregate_train(1, [r1, r2])
    out = {k: a.numpy() for k, a in record.items()}
    assert set(out) == set(GLOBAL)  # never truncated to a subset
    np.testing.assert_allclose(out["a"], (10 * 1.0 + 30 * 4.0) / 40)  # both trained a
    np.testing.assert_allclose(out["b"], 3.0)  # only device 11 trained b: its value, not diluted by 12
    np.testing.assert_array_equal(out["c"], GLOBAL["c"])  # trained by nobody: keeps its value
    assert out["a"].dtype == np.float32
    assert s.state.replies.senders == {"a": 2, "b": 1}
    assert metrics["devices"] == 2
    assert s.state.global_importance["c"] == 0.0
    assert s.state.global_importance["a"] == pytest.approx(4 * 3.25**2 / s.lr)


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
    s = make_strategy(GLOBAL)
    good = reply(11, {"b": np.full(3, 5.0, np.float32)}, samples=10)
    bad = reply(12, arrays, samples=1000, partition=3)
    with caplog.at_level(logging.WARNING, logger="fleet.server"):
        record, _ = s.aggregate_train(4, [good, bad])
    out = {k: a.numpy() for k, a in record.items()}
    np.testing.assert_allclose(out["b"], 5.0)  # the bad device's 1000 samples did not count
    assert len(s.state.replies.rejections) == 1
    rej = s.state.replies.rejections[0]
    assert (rej.server_round, rej.node_id, rej.device) == (4, 12, "pi-12")  # the roster's name for node 12
    assert reason in rej.reason
    assert "device pi-12 (node 12)" in caplog.text and reason in caplog.text


def test_failed_device_and_bad_weight_are_rejected():
    s = make_strategy(GLOBAL)
    failed = reply(13, None, error="device 2 failed on purpose")
    zero = reply(14, {"b": np.zeros(3, np.float32)}, samples=0)
    good = reply(11, {"a": np.ones((2, 2), np.float32)}, samples=5)
    record, _ = s.aggregate_train(2, [failed, zero, good])
    assert [r.node_id for r in s.state.replies.rejections] == [13, 14]
    assert "failed on purpose" in s.state.replies.rejections[0].reason
    assert "num-examples" in s.state.replies.rejections[1].reason
    np.testing.assert_allclose(record["a"].numpy(), 1.0)
    np.testing.assert_array_equal(record["b"].numpy(), GLOBAL["b"])


def test_no_usable_reply_keeps_global_model():
    s = make_strategy(GLOBAL)
    record, metrics = s.aggregate_train(1, [reply(12, {"q": np.zeros(1, np.float32)})])
    assert record is None and metrics is None
    assert check_reply(reply(1, {"a": np.zeros((2, 2), np.float32)}), GLOBAL) is None


def test_deadline_is_fastest_full_time_and_zero_for_fedavg():
    s = make_strategy(GLOBAL)
    assert s.round_deadline([]) == 0.0  # nothing known yet: devices train fully
    s.state.roster = {"1": member("a", 4.0), "2": member("b", 1.5), "3": member("c", 6.0)}
    assert s.round_deadline(["1", "2", "3"]) == 1.5
    assert s.round_deadline(["1", "3"]) == 4.0  # the fastest of the devices eligible now
    s.deadline_factor = 2.0
    assert s.round_deadline(["1", "2"]) == 3.0
    s.deadline_s = 0.7
    assert s.round_deadline(["1", "2"]) == 0.7
    s.method = "fedavg"
    assert s.round_deadline(["1", "2"]) == 0.0


def test_deadline_adds_the_full_upload_when_it_covers_uploads():
    s = ElasticFedAvg(ServerState(), param_names=["a"], full_upload_s=2.5)
    s.state.roster = {"1": member("a", 4.0), "2": member("b", 1.5)}
    assert s.round_deadline(["1", "2"]) == 4.0  # the fastest device's round: full training plus full upload


def test_a_device_failure_is_logged_in_one_line():
    """A simulated ClientApp's error reaches the server wrapped in Ray's and Flower's tracebacks,
    with terminal colours; the rejection names the root cause alone."""
    relayed = (
        "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:"
        "<'\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=1)\n"
        '  File "/x/torch/serialization.py", line 1312, in _save\n    zip_file.write_record(name, storage, num_bytes)\n'
        "OSError: [Errno 28] No space left on device\n\nDuring handling of the above exception, another "
        "exception occurred:\n\n"
        "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 61144000 vs 61143896\n"
        "flwr.clientapp.client_app.ClientAppException: \nException ClientAppException occurred.'>"
    )
    s = make_strategy(GLOBAL)
    s.aggregate_train(1, [reply(13, None, error=relayed), reply(11, {"a": np.ones((2, 2), np.float32)})])
    assert s.state.replies.rejections[0].reason == "device failed: OSError: [Errno 28] No space left on device"
    assert error_summary("x" * 500).endswith("...") and len(error_summary("x" * 500)) == 300
    assert error_summary("") == "no reason given"
    deployed = "<class 'fleet.base.errors.DataError'>:<'node config data-root: class folder 'unicorn' is unknown'>"
    assert error_summary(deployed) == "DataError: node config data-root: class folder 'unicorn' is unknown"


def eval_reply(node: int, metrics: dict) -> Message:
    msg = reply(node, None)
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), metadata=msg.metadata)


def test_bad_evaluation_replies_are_left_out_not_crashing_the_server(caplog):
    """A reply without accuracies (e.g. a train reply arriving while the round evaluates) or with an
    impossible one is left out of the round's accuracy, with a line naming the device."""
    s = make_strategy(GLOBAL)
    good = eval_reply(11, {"num-examples": 10, "global-accuracy": 0.5, "personal-accuracy": 0.75})
    train_like = eval_reply(12, {"num-examples": 10, "loss": 0.3})
    huge = eval_reply(13, {"num-examples": 10, "global-accuracy": 1e6, "personal-accuracy": 0.5})
    with caplog.at_level(logging.WARNING, logger="fleet.server"):
        acc = s.aggregate_evaluate(3, [good, train_like, huge])
    assert dict(acc) == {"global-accuracy": 0.5, "personal-accuracy": 0.75}
    assert [r["node_id"] for r in s.state.replies.evaluation] == [11]
    assert "evaluation from device pi-12 (node 12) failed: metric 'global-accuracy' is missing" in caplog.text
    assert "(node 13) failed: metric 'global-accuracy' must be in [0, 1], got 1000000.0" in caplog.text


def test_server_momentum_moves_only_the_tensors_someone_trained():
    from fleet.federated.aggregate import momentum_step

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
    from fleet.federated.state import load_checkpoint, save_checkpoint

    state = ServerState(run_tag="r", round=3, momentum={"w": np.full(4, 0.25, np.float32)})
    save_checkpoint(tmp_path, {"w": np.zeros(4, np.float32)}, state)
    _, loaded = load_checkpoint(tmp_path)
    assert loaded.round == 3 and np.array_equal(loaded.momentum["w"], state.momentum["w"])


def test_a_strategy_with_server_momentum_steps_further_along_a_repeated_update():
    s = make_strategy(GLOBAL)
    s.server_momentum, s.server_lr = 0.5, 1.0
    step = {"a": GLOBAL["a"] + 1.0}
    first, _ = s.aggregate_train(1, [reply(12, step)])
    after_one = first["a"].numpy()
    np.testing.assert_allclose(after_one, 1.0)
    s.state.replies.sent = {k: a.numpy() for k, a in first.items()}
    second, _ = s.aggregate_train(2, [reply(12, {"a": after_one + 1.0})])
    np.testing.assert_allclose(second["a"].numpy(), 1.0 + 1.0 + 0.5)  # without momentum: 2.0
    np.testing.assert_allclose(second["c"].numpy(), 7.0)  # trained by nobody

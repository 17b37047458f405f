"""One bad reply cannot break the round: schema, capped weights, bounded updates, robust means.

Replies go into the coordinator's close_train as the ServerApp hands them over (unpacked records).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from fleet.engine.models import MODEL_NAMES, build_model, head_parameter_names
from fleet.federated.on_server.coordinator import Coordinator
from fleet.federated.on_server.defense import sample_cap
from fleet.federated.on_server.membership import member
from fleet.federated.on_server.robust import (
    held_alone,
    leave_one_out_medians,
    plausible_times,
    robust_average,
    screen_devices,
    update_limits,
    update_norms,
)
from fleet.federated.shared.config import RobustConfig, fleet_config_from_dict
from fleet.federated.shared.records import Reply
from fleet.federated.shared.schema import TRAIN, metric_problem
from tests.test_fleet_strategy import coordinator, device_metrics, reply, train

GLOBAL = {
    "w": np.zeros(4, np.float32),
    "bn.running_var": np.ones(2, np.float32),
    "bn.running_mean": np.zeros(2, np.float32),
}
PARAMS = ["w"]


def strategy(sample_caps: dict[str, int] | None = None, global_arrays=GLOBAL, params=PARAMS, **robust) -> Coordinator:
    """The plain masked mean with the config's norm bound, pull and time band unless told otherwise."""
    s = coordinator(global_arrays, params, robust={"norm_bound": RobustConfig.norm_bound, **robust})
    s.accept.sample_caps = sample_caps or {}  # a simulation knows every device's data size
    s.state.roster = {str(n): member(f"pi-{n}", 2.0) for n in range(10, 20)}
    return s


def honest(node: int, step: float = 1.0, samples: float = 100, **metric_changes) -> Reply:
    arrays = {"w": np.full(4, step, np.float32), "bn.running_var": np.full(2, 1.1, np.float32)}
    msg = reply(node, arrays, samples=samples)
    for key, value in {**device_metrics(samples, selected=1), **metric_changes}.items():
        if value is None:
            del msg.metrics[key]
        else:
            msg.metrics[key] = value
    return msg


def aggregate(s: Coordinator, replies: list[Reply]) -> dict[str, np.ndarray]:
    """Round 1's replies, every call from the global model the coordinator started with."""
    s.arrays = s.state.replies.sent or s.arrays
    return train(s, 1, replies)


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"steps": None}, "metric 'steps' is missing"),
        ({"loss": float("nan")}, "metric 'loss' must be finite"),
        ({"partition-id": 1.5}, "metric 'partition-id' must be a whole number"),
        ({"bytes-uploaded": -1e12}, "metric 'bytes-uploaded' must be in [0, inf]"),
        ({"trained-fraction": 7}, "metric 'trained-fraction' must be in [0, 1]"),
        ({"tier": None}, "metric 'tier' is missing"),
        ({"full-time-s": 0}, "metric 'full-time-s' must be in (0, 1e+06]"),
        ({"num-examples": 1e308 * 10}, "'num-examples' must be a positive number, got inf"),
    ],
)
def test_a_reply_outside_the_schema_is_rejected_naming_the_device(change, reason, caplog):
    s = strategy()
    with caplog.at_level(logging.WARNING, logger="fleet.server"):
        out = aggregate(s, [honest(11), honest(12, **change)])
    np.testing.assert_allclose(out["w"], 1.0)  # only the sound reply counted
    assert len(s.state.replies.rejections) == 1 and s.state.replies.rejections[0].reason.startswith(reason)
    assert f"rejected reply from device pi-12 (node 12): {reason}" in caplog.text
    assert metric_problem(device_metrics(1, 1), TRAIN) is None


def test_huge_sample_counts_are_capped_at_what_the_device_holds():
    s = strategy(sample_caps={"pi-12": 100, "pi-13": 100})
    out = aggregate(s, [honest(11, 1.0), honest(12, 4.0, samples=1e12), honest(13, 4.0, samples=1e300)])
    assert np.isfinite(out["w"]).all()
    np.testing.assert_allclose(out["w"], 3.0)  # (100 x 1 + 100 x 4 + 100 x 4) / 300
    assert sorted(s.state.replies.defense.capped) == ["pi-12", "pi-13"]
    assert sample_cap(RobustConfig(max_samples_per_device=500), {}, "unknown") == 500  # deployment: the configured cap


def test_scaled_and_sign_flipped_updates_are_clipped_to_the_median_norm():
    s = strategy(norm_bound=3.0, max_samples_per_device=100)  # deployment: every weight capped at the config's
    # three senders: too few to screen a device against its peers, so the per-tensor bound acts alone
    out = aggregate(s, [honest(11, 1.0), honest(12, 1.0), honest(13, 1e3, samples=1e12)])
    np.testing.assert_allclose(out["w"], (1.0 + 1.0 + 3.0) / 3, rtol=1e-6)  # 1000 clipped to 3x the honest norm
    assert s.state.replies.defense.clipped == {"pi-13": 1}
    flipped = [honest(11, 1.0), honest(12, 1.0), honest(13, -10.0)]
    fresh = strategy(norm_bound=3.0, max_samples_per_device=100)  # no last step yet: only the bound acts
    np.testing.assert_allclose(aggregate(fresh, flipped)["w"], (1.0 + 1.0 - 3.0) / 3, rtol=1e-6)
    s.state.replies.sent = {}  # the round after: the flip points against the global model's last step
    aggregate(s, [honest(11, 2.0), honest(12, 2.0), honest(13, -10.0)])
    assert [r.device for r in s.state.replies.rejections] == ["pi-13"]
    s = strategy(norm_bound=3.0, norm_action="reject")
    out = aggregate(s, [honest(n, 1.0) for n in (11, 12)] + [honest(14, 1e3)])
    np.testing.assert_allclose(out["w"], 1.0)
    assert "above 3x the median norm" in s.state.replies.rejections[0].reason


def shared_and_own(node: int, shared: float, own: float | None = None) -> Reply:
    """A reply whose update is ``shared`` on the tensor every device trains and ``own`` on one only it trains."""
    msg = honest(node, shared)
    if own is not None:
        msg.arrays["v"] = np.full(3, own, np.float32)
        msg.metrics["selected"] = 2
    return msg


def test_a_device_is_judged_on_shared_tensors_and_the_verdict_covers_the_ones_it_alone_trained(caplog):
    start = {**GLOBAL, "v": np.zeros(3, np.float32)}
    s = strategy(global_arrays=start, params=["w", "v"], norm_bound=3.0, min_pull=-0.5)
    honest_ones = [shared_and_own(n, 1.0) for n in (11, 12, 13)]
    # pi-14 scales its whole update x1000, pi-15 flips its sign: each alone trained a tensor nobody can compare
    with caplog.at_level(logging.WARNING, logger="fleet.server"):
        out = aggregate(s, [*honest_ones, shared_and_own(14, 1e3, 1e3), shared_and_own(15, -10.0, -10.0)])
    rejected = s.state.replies.rejections
    assert [r.device for r in rejected] == ["pi-15"] and "pulls against the other devices'" in rejected[0].reason
    assert "(-3.00 typical updates over 1 tensors" in rejected[0].reason  # its size counts up to the bound
    # pi-14's whole update was scaled by 1/1000 (its ratio to the others on w), also on v that it alone sent
    assert s.state.replies.defense.scaled == {"pi-14": pytest.approx(1000.0)}
    np.testing.assert_allclose(out["v"], 1.0, rtol=1e-5)
    assert s.state.replies.defense.screen["pi-11"] == {"norm_ratio": 1.0, "pull": 1.0, "sign_skew": 0.0, "tensors": 1}


def test_two_attackers_cannot_lift_the_bound_with_the_lower_median():
    sent = [{"w": np.full(4, 1.0, np.float32)}, {"w": np.full(4, 1e3, np.float32)}]
    limits = update_limits(update_norms(GLOBAL, sent), 3.0)
    assert limits["w"] == pytest.approx(3 * 2.0)  # 3 x the smaller of the two norms (2 and 2000)


@pytest.mark.parametrize(
    "buffer, reason",
    [
        ({"bn.running_var": np.full(2, -1.0, np.float32)}, "negative variance"),
        ({"bn.running_mean": np.full(2, 1e6, np.float32)}, "implausible mean"),
    ],
)
def test_poisoned_normalization_statistics_are_rejected(buffer, reason):
    s = strategy()
    bad = honest(12)
    bad.arrays.update(buffer)
    out = aggregate(s, [honest(11), bad])
    assert reason in s.state.replies.rejections[0].reason
    np.testing.assert_allclose(out["bn.running_var"], 1.1)


def test_an_upload_of_more_tensors_than_claimed_is_rejected():
    s = strategy()
    liar = honest(12, selected=0)  # uploads the trainable "w" while claiming nothing was trained
    aggregate(s, [honest(11), liar])
    assert s.state.replies.rejections[0].reason == "uploads 1 trainable tensors but reports 'selected' 0"


def test_reported_times_are_held_to_a_band_and_bytes_are_counted_by_the_server():
    s = strategy(time_band=4.0)
    aggregate(s, [honest(11, **{"full-time-s": 1e-9, "predicted-time-s": 1e12, "bytes-uploaded": 1})])
    row = s.state.replies.train[0]
    assert row.full_time_s == pytest.approx(2.0 / 4)  # the device joined with 2.0 s
    assert row.predicted_time_s == pytest.approx(4 * 0.5)
    assert row.speedup == pytest.approx(0.5 / 2.0)  # the server's figure, from the clamped times
    assert row.bytes_uploaded == 4 * 4 + 2 * 4  # what it really sent
    assert s.state.roster["11"].full_time_s == pytest.approx(0.5)
    times = plausible_times({"a": 1e-9, "b": 2.0, "c": 3.0, "d": 4.0}, band=4.0)
    assert times["a"] == pytest.approx(2.5 / 4) and times["d"] == 4.0  # one liar cannot set the deadline


def test_trimmed_mean_and_median_ignore_an_outlier_over_the_devices_that_trained_a_tensor():
    cur = {"w": np.zeros(2, np.float32), "v": np.zeros(2, np.float32)}
    ups = [({"w": np.full(2, x, np.float32)}, 1.0) for x in (1.0, 1.1, 0.9, 1.0, 50.0)]
    ups.append(({"v": np.full(2, 2.0, np.float32)}, 1.0))  # only one device trained v
    mean, _ = robust_average(cur, ups, "mean")
    trimmed, senders = robust_average(cur, ups, "trimmed_mean", trim=0.2)
    median, _ = robust_average(cur, ups, "median")
    assert mean["w"][0] == pytest.approx(10.8, rel=1e-6)
    assert trimmed["w"][0] == pytest.approx(1.0333333, rel=1e-5)  # 0.9 and 50 dropped
    assert median["w"][0] == pytest.approx(1.0)
    assert senders == {"w": 5, "v": 1} and trimmed["v"][0] == median["v"][0] == 2.0  # one sender: its value


def test_centered_clipping_is_the_mean_of_an_honest_fleet_and_counts_an_outlier_as_one_typical_update():
    cur = {"w": np.zeros(2, np.float32), "v": np.zeros(2, np.float32)}
    honest = [({"w": np.full(2, x, np.float32)}, 1.0) for x in (1.0, 1.1, 0.9, 1.0)]
    clipped, _ = robust_average(cur, honest, "centered_clip")
    assert clipped["w"].dtype == np.float32 and clipped["w"][0] == pytest.approx(1.0, abs=0.03)  # the mean: 1.0
    attacked = honest + [({"w": np.full(2, 50.0, np.float32)}, 1.0), ({"v": np.full(2, 2.0, np.float32)}, 1.0)]
    clipped, senders = robust_average(cur, attacked, "centered_clip")
    assert clipped["w"][0] == pytest.approx(1.0, abs=0.05)  # the mean would be 10.8
    assert senders == {"w": 5, "v": 1} and clipped["v"][0] == 2.0  # one sender: its value


def test_centered_clipping_weighs_senders_by_their_samples():
    cur = {"w": np.zeros(1, np.float32)}
    ups = [({"w": np.array([x], np.float32)}, w) for x, w in ((1.0, 3.0), (1.2, 1.0), (0.8, 1.0), (1.1, 1.0))]
    clipped, _ = robust_average(cur, ups, "centered_clip")
    mean, _ = robust_average(cur, ups, "mean")
    assert clipped["w"][0] == pytest.approx(mean["w"][0], abs=0.02) and mean["w"][0] == pytest.approx(1.0167, abs=1e-3)
    assert fleet_config_from_dict({"robust": {"aggregation": "centered_clip"}}).robust.aggregation == "centered_clip"


def test_two_senders_take_the_smaller_step_per_coordinate():
    """Neither of two devices can be outvoted: a flipped, larger update does not undo the honest one."""
    cur = {"w": np.zeros(3, np.float32)}
    honest_up = np.array([1.0, -1.0, 0.5], np.float32)
    flipped = -3 * honest_up
    for method in ("trimmed_mean", "median"):
        out, _ = robust_average(cur, [({"w": honest_up}, 1.0), ({"w": flipped}, 1.0)], method)
        np.testing.assert_allclose(out["w"], honest_up)
    mean, _ = robust_average(cur, [({"w": honest_up}, 1.0), ({"w": flipped}, 1.0)], "mean")
    np.testing.assert_allclose(mean["w"], -honest_up)  # the plain mean is dragged backwards


def test_a_huge_update_a_few_degrees_off_the_others_is_scaled_not_rejected():
    """Late in training honest updates are nearly orthogonal; a x1000 update only slightly against the
    others' median would read as pulling back by dozens of typical lengths. Its size counts only up to
    the bound, so it is scaled down like any oversized update instead of rejected."""
    ref = {"w": np.zeros(4, np.float32)}
    honest_ones = [{"w": np.ones(4, np.float32)} for _ in range(3)]
    huge = {"w": 1000 * np.array([1.0, -1.0, -1.0, 0.9], np.float32)}  # cosine -0.03 with the others
    uncapped = screen_devices(ref, [*honest_ones, huge], ["w"])[3]
    capped = screen_devices(ref, [*honest_ones, huge], ["w"], size_cap=3.0)[3]
    assert uncapped.pull < -20 and -0.5 < capped.pull < 0 and capped.norm_ratio > 900


def test_a_device_caught_pulling_back_is_not_trusted_while_its_updates_stay_oversized():
    s = strategy(norm_bound=3.0, min_pull=-0.5)
    honest_ones = [honest(n, 1.0) for n in (11, 12, 13, 14)]
    train(s, 1, [*honest_ones, honest(15, -10.0)])  # caught: pulls back by 3 typical updates
    assert s.state.suspects == {"pi-15": 1}
    for r, step in ((2, 10.0), (3, 1.0)):
        s.arrays = {k: v.copy() for k, v in GLOBAL.items()}
        train(s, r, [*[honest(n, 1.0) for n in (11, 12, 13, 14)], honest(15, step)])
        rejected = [j.reason for j in s.state.replies.rejections]
        if r == 2:  # oversized, though in the others' direction: a suspect is not scaled down but rejected
            assert rejected == [
                "its update is 10.0x the other devices' (median over 1 tensors other devices "
                "trained too; bound 3), and it pulled back in round 1"
            ]
        else:  # an ordinary update again: accepted, and trusted from now on
            assert rejected == [] and s.state.suspects == {}


def test_each_replys_update_norms_are_taken_once_and_again_only_after_it_is_scaled(monkeypatch):
    """The screen and the bound read one set of norms per reply (each a pass over a model's floats); a reply
    the screen scales down is measured again, so the bound judges what will be averaged."""
    import fleet.federated.on_server.defense as defense

    calls = []
    monkeypatch.setattr(defense, "update_norms", lambda cur, arrays: calls.append(1) or update_norms(cur, arrays))
    s = strategy(norm_bound=3.0)
    new = train(s, 1, [*[honest(n, 1.0) for n in (11, 12, 13, 14)], honest(15, 10.0)])
    assert len(calls) == 5 + 1 and s.state.replies.defense.scaled == {"pi-15": 10.0}
    np.testing.assert_allclose(new["w"], 1.0, rtol=1e-6)  # scaled to the others' size: five equal steps
    rng = np.random.default_rng(3)
    ref = {"w": np.zeros(50, np.float32)}
    sent = [{"w": rng.normal(size=50).astype(np.float32)} for _ in range(5)]
    given = screen_devices(ref, sent, ["w"], norms=update_norms(ref, sent))
    assert given == screen_devices(ref, sent, ["w"])


@pytest.mark.parametrize("senders", [3, 5, 8, 11])
def test_trimmed_mean_is_the_mean_of_the_sorted_middle_over_many_tensors(senders):
    """Tensors are aggregated on several threads: every one must still come out as its own sorted middle."""
    rng = np.random.default_rng(senders)
    cur = {f"t{i}": np.zeros((4, 7), np.float32) for i in range(12)}
    ups = [({k: rng.normal(size=(4, 7)).astype(np.float32) for k in cur}, 1.0) for _ in range(senders)]
    ups[0][0]["t3"][0, 0] = 3e38  # an outlier sorts to the end and is cut (or, with cut 0, counted)
    out, senders_of = robust_average(cur, ups, "trimmed_mean", trim=0.25)
    cut = int(np.floor(0.25 * senders))
    for name in cur:
        stack = np.sort(np.stack([u[name] for u, _ in ups]), axis=0)
        np.testing.assert_allclose(out[name], stack[cut : senders - cut].mean(axis=0), rtol=1e-5, atol=1e-6)
        assert out[name].dtype == np.float32 and senders_of[name] == senders


def spread_update(node: int, seed: int, shift: float = 0.0, scale: float = 1.0) -> Reply:
    """An update on a 64-coordinate tensor "u": a common step plus noise of its own (honest non-IID
    devices agree a little and differ a lot), moved by ``shift`` and scaled by ``scale``."""
    rng = np.random.default_rng(seed)
    step = np.full(64, 0.3) + rng.normal(size=64)
    msg = honest(node, 1.0)
    msg.arrays["u"] = (scale * (step + shift)).astype(np.float32)
    msg.metrics["selected"] = 2
    return msg


def spread_strategy(**robust) -> Coordinator:
    start = {**GLOBAL, "u": np.zeros(64, np.float32)}
    return strategy(global_arrays=start, params=["w", "u"], norm_bound=3.0, min_pull=-0.5, **robust)


def test_updates_that_fall_on_nearly_every_coordinate_are_rejected_for_their_sign_skew():
    honest_ones = [spread_update(n, n) for n in (11, 12, 13, 14, 15)]
    # ALIE's shape: the mean minus one standard deviation falls on nearly every coordinate, at an ordinary size
    alie = spread_update(16, 0, shift=-3.0, scale=0.5)
    s = spread_strategy()
    aggregate(s, [*honest_ones, alie])
    assert [r.device for r in s.state.replies.rejections] == ["pi-16"]
    assert "rises on a share of coordinates" in s.state.replies.rejections[0].reason
    assert all(abs(s.state.replies.defense.screen[f"pi-{n}"]["sign_skew"]) < 0.2 for n in range(11, 16))


SMALL = ("s1", "s2", "s3")  # biases: too few values each for a tensor's own sign skew to mean anything


def layered_update(node: int, seed: int, big_shift: float = 0.0, head_shift: float = 0.0) -> Reply:
    """Honest noise around a common step on three small tensors and a large weight ("big", 32 x 32, held to
    the sign skew on its own) and a classifier ("head", 8 x 64, last), moved by ``big_shift`` and ``head_shift``."""
    rng = np.random.default_rng(seed)
    msg = spread_update(node, seed)
    for name in SMALL:
        msg.arrays[name] = (0.3 + rng.normal(size=16)).astype(np.float32)
    msg.arrays["big"] = (0.3 + big_shift + rng.normal(size=(32, 32))).astype(np.float32)
    msg.arrays["head"] = (0.3 + head_shift + rng.normal(size=(8, 64))).astype(np.float32)
    msg.metrics["selected"] = 7
    return msg


def layered_strategy() -> Coordinator:
    start = {**GLOBAL, "u": np.zeros(64, np.float32), "big": np.zeros((32, 32), np.float32)}
    start.update({name: np.zeros(16, np.float32) for name in SMALL}, head=np.zeros((8, 64), np.float32))
    return strategy(global_arrays=start, params=["w", "u", *SMALL, "big", "head"], norm_bound=3.0, min_pull=-0.5)


def test_only_large_weights_short_of_the_classifier_are_held_to_the_sign_skew_alone():
    shapes = {"conv": (8, 8, 3, 3), "bn.weight": (1024,), "small": (4, 4), "fc.weight": (10, 64), "fc.bias": (10,)}
    current = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
    assert held_alone(current, list(shapes)) == {"conv"}  # 576 values; the classifier (640) is last
    assert held_alone(current, ["fc.weight", "conv"]) == {"fc.weight"}  # the last matrix in order is the classifier


@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_the_weight_held_alone_takes_for_the_classifier_is_every_zoo_models_head(model_name):
    # held_alone finds the classifier as the last matrix in the model's order; a model whose head comes earlier
    # would have its classifier held alone, and honest non-IID devices' heads left out
    model = build_model(model_name, 10, in_channels=1, small_input=True)
    current = {name: p.detach().numpy() for name, p in model.named_parameters()}
    head = [name for name in head_parameter_names(model) if current[name].ndim >= 2]
    assert [name for name in current if current[name].ndim >= 2][-1:] == head
    assert head[0] not in held_alone(current, list(current))


def test_a_large_tensor_poisoned_behind_honest_small_ones_is_left_out():
    honest_ones = [layered_update(n, n) for n in (11, 12, 13, 14, 15)]
    # Min-Max on the large tensor alone: it falls on nearly every coordinate there, while the small tensors,
    # honest, carry the median over its tensors (its whole-reply skew stays honest)
    attacker = layered_update(16, 16, big_shift=-3.0)
    s = layered_strategy()
    out = aggregate(s, [*honest_ones, attacker])
    assert s.state.replies.rejections == [] and s.state.replies.defense.skewed == {"pi-16": 1}
    assert abs(s.state.replies.defense.screen["pi-16"]["sign_skew"]) < 0.2
    alone = aggregate(layered_strategy(), honest_ones)
    np.testing.assert_allclose(out["big"], alone["big"], rtol=1e-6)  # as if it had not sent it
    assert not np.allclose(out["s1"], alone["s1"])  # ... while its honest tensors still count
    assert s.state.replies.defense.as_dict()["skewed"] == {"pi-16": 1}
    s = layered_strategy()
    aggregate(s, honest_ones)
    assert s.state.replies.defense.skewed == {}  # no honest device's large tensor is skewed
    # a device that lacks most classes: its classifier falls on nearly every coordinate, and counts in full
    lacking = layered_update(16, 16, head_shift=-3.0)
    s = layered_strategy()
    aggregate(s, [*honest_ones, lacking])
    assert s.state.replies.rejections == [] and s.state.replies.defense.skewed == {}


def test_an_update_against_the_global_models_last_step_is_rejected_however_small():
    s = spread_strategy()
    aggregate(s, [spread_update(n, n, shift=1.0) for n in (11, 12, 13, 14, 15)])
    step = s.state.last_step["u"]
    assert step.mean() > 0.5 and set(s.state.last_step) == {"w", "u"}
    s.state.replies.sent = {}
    # IPM: minus a tenth of the honest mean it learned last round, which is about minus the last step
    ipm = honest(16, 1.0 - 0.1)
    ipm.arrays["u"] = (s.arrays["u"] - 0.1 * step).astype(np.float32)
    ipm.metrics["selected"] = 2
    fresh = [spread_update(n, 100 + n, shift=1.0) for n in (11, 12, 13, 14, 15)]
    for r in fresh:
        r.arrays = {k: (s.arrays[k] + v).astype(np.float32) if k in ("w", "u") else v for k, v in r.arrays.items()}
    aggregate(s, [*fresh, ipm])
    trend = s.state.replies.defense.trend
    assert trend["pi-16"] < -0.3 and all(trend[f"pi-{n}"] > 0.1 for n in range(11, 16)), trend
    assert [r.device for r in s.state.replies.rejections] == ["pi-16"]
    assert "points against the global model's last step" in s.state.replies.rejections[0].reason


def test_a_reply_that_cannot_be_judged_is_rejected_while_others_are():
    start = {**GLOBAL, "v": np.zeros(3, np.float32)}
    s = strategy(global_arrays=start, params=["w", "v"], norm_bound=3.0, min_pull=-0.5)
    rare = reply(15, {"v": np.full(3, -50.0, np.float32)})  # claims only a tensor nobody else trained
    rare.metrics.update({**device_metrics(100, selected=1)})
    out = aggregate(s, [*(shared_and_own(n, 1.0) for n in (11, 12, 13, 14)), rare])
    assert [r.device for r in s.state.replies.rejections] == ["pi-15"]
    assert "enough other devices trained too to be judged" in s.state.replies.rejections[0].reason
    np.testing.assert_allclose(out["v"], 0.0)
    alone = strategy(global_arrays=start, params=["w", "v"], norm_bound=3.0, min_pull=-0.5)
    aggregate(alone, [shared_and_own(11, 1.0), rare])  # nobody can be judged in a fleet this small: kept
    assert not alone.state.replies.rejections


def test_a_tensors_bound_grows_from_its_typical_norm_by_at_most_norm_growth_a_round():
    s = strategy(norm_bound=3.0, norm_growth=1.25)
    aggregate(s, [honest(11, 1.0), honest(12, 1.0)])
    assert s.state.typical_norms["w"] == pytest.approx(2.0)  # |(1, 1, 1, 1)|
    s.state.replies.sent = {}
    out = aggregate(s, [honest(13, 100.0)])  # alone on "w" the next round: its own norm cannot set its bound
    np.testing.assert_allclose(out["w"], 1.0 + 3.0 * 1.25 * 2.0 / 2.0, rtol=1e-5)  # clipped to 3 x 1.25 x typical
    assert s.state.typical_norms["w"] == pytest.approx(2.0 * 1.25)


def test_colluders_are_rejected_first_so_the_honest_device_they_dragged_is_not():
    s = strategy(norm_bound=3.0, min_pull=-0.5, max_sign_skew=None)
    steps = {11: 1.0, 12: 1.1, 13: 0.9, 14: -3.0, 15: -3.0}  # pi-14 and pi-15 collude: the same reversed update
    aggregate(s, [honest(n, v) for n, v in steps.items()])
    # judged once against everyone, an honest device's "others" hold two colluders of four: their median is
    # dragged to (1 - 3) / 2 and it reads as pulling back; screened again without the worst, it does not
    first = screen_devices(GLOBAL, [{"w": np.full(4, v, np.float32)} for v in steps.values()], ["w"], size_cap=3.0)
    assert first[0].pull < -0.5
    assert sorted(r.device for r in s.state.replies.rejections) == ["pi-14", "pi-15"]


def test_a_reply_raising_the_servers_loss_far_above_the_fleets_median_rise_is_rejected():
    from fleet.federated.on_server.defense import loss_problems

    robust = RobustConfig(max_loss_rise=0.5)
    problems = loss_problems([0.10, 0.12, -0.05, 0.08, 1.40], robust)
    assert list(problems) == [4] and "raises the loss on the server's own data by 1.40" in problems[4]
    assert loss_problems([0.1, 0.7], robust) == {}  # two replies: no fleet to judge against
    assert loss_problems([0.1, 0.2, 0.55], robust) == {}  # within the allowance of the median (0.2)


def test_the_servers_reference_data_is_its_own_held_out_start_and_none_without_one():
    from fleet.base.errors import ConfigError
    from fleet.federated.on_server.server_eval import REFERENCE_SAMPLES, reference_loss, reference_set
    from fleet.federated.on_server.server_run import initial_arrays
    from fleet.federated.shared.config import load_fleet_config
    from fleet.federated.shared.split import datasets, fleet_indices

    cfg = load_fleet_config("simulations/fleet-tiny.yaml", {"start.samples": 300})
    data = reference_set(cfg)
    pre, _ = fleet_indices(cfg, datasets(cfg)[0].labels.numpy())
    assert len(data) == min(REFERENCE_SAMPLES, len(pre))
    loss = reference_loss(cfg, initial_arrays(cfg), data)
    assert 0 < loss < 10  # an untrained 10-class model: about ln 10
    with pytest.raises(ConfigError, match="robust.validate: judging replies needs the server's own held-out data"):
        reference_set(load_fleet_config("simulations/fleet-tiny.yaml", {"start.samples": 0}))


def test_with_every_defense_off_the_round_is_the_plain_masked_mean():
    off = {"min_pull": None, "min_cos": None, "max_sign_skew": None, "norm_growth": None}
    start = {**GLOBAL, "u": np.zeros(64, np.float32)}
    s = strategy(global_arrays=start, params=["w", "u"], aggregation="mean", norm_bound=None, **off)
    replies = [spread_update(n, n) for n in (11, 12, 13, 14, 15)] + [spread_update(16, 0, shift=-3.0, scale=50.0)]
    out = aggregate(s, replies)
    expected = np.mean([r.arrays["u"] for r in replies], axis=0)
    np.testing.assert_allclose(out["u"], expected, rtol=1e-5)
    assert not s.state.replies.rejections and not s.state.replies.defense.scaled


@pytest.mark.parametrize("n", [2, 3, 4, 7, 16])
def test_leave_one_out_medians_are_the_medians_of_the_other_rows(n):
    rng = np.random.default_rng(n)
    rows = rng.integers(-2, 3, size=(n, 300)).astype(np.float64)  # many ties
    rows[:, :3] = rng.standard_normal((n, 3))
    expected = np.stack([np.median(np.delete(rows, j, axis=0), axis=0) for j in range(n)])
    assert np.array_equal(leave_one_out_medians(rows), expected)


def test_a_pull_against_the_others_is_a_strike_until_it_repeats_within_the_window():
    """Under non-IID data an honest device's update points away from the others' now and then: with ``strikes: 2``
    its first such round within ``strike_window`` keeps it at half its length; a second is a rejection that says so."""
    s = strategy(norm_bound=3.0, min_pull=-0.5, max_sign_skew=None, min_cos=None, strikes=2)

    def one_round(r: int, step: float) -> dict[str, np.ndarray]:
        s.arrays = {k: v.copy() for k, v in GLOBAL.items()}
        return train(s, r, [*[honest(n, 1.0) for n in (11, 12, 13, 14)], honest(15, step)])

    out = one_round(1, -0.7)
    assert s.state.replies.rejections == [] and s.state.replies.defense.strikes == {"pi-15": "pull -0.70"}
    np.testing.assert_allclose(out["w"], (4 * 1.0 - 0.7 * 0.5) / 5, rtol=1e-5)  # kept, at half its length
    one_round(2, 1.0)
    assert s.state.replies.defense.strikes == {} and s.state.strikes == {"pi-15": [1]}
    one_round(3, -0.7)
    (rejected,) = s.state.replies.rejections
    assert rejected.device == "pi-15" and "pulls against the other devices' (-0.70 typical" in rejected.reason
    assert rejected.reason.endswith(", and did in 1 of its last 4 rounds")
    one_round(8, -0.7)  # rounds 1 and 3 are past the window: a first strike again
    assert s.state.replies.rejections == [] and s.state.strikes == {"pi-15": [8]}
    one_round(9, -1.2)  # past twice min_pull: rejected at once, whatever came before
    assert [r.device for r in s.state.replies.rejections] == ["pi-15"]


def test_a_step_against_the_global_models_last_one_is_rejected_on_its_third_round_in_four():
    s = strategy(norm_bound=3.0, min_pull=None, max_sign_skew=None)  # the default strikes: 3 within 4 rounds
    s.state.last_step = {"w": np.ones(4, np.float32)}
    against = np.array([-1.0, -1.0, 0.5, 0.2], np.float32)  # cosine -0.43 with the last step: below -0.3, above -0.6

    def one_round(r: int) -> list[str]:
        s.arrays = {k: v.copy() for k, v in GLOBAL.items()}
        odd = honest(15)
        odd.arrays["w"] = against.copy()
        train(s, r, [*[honest(n, 1.0) for n in (11, 12, 13, 14)], odd])
        s.state.last_step = {"w": np.ones(4, np.float32)}
        return [r.reason for r in s.state.replies.rejections]

    assert one_round(1) == [] and s.state.replies.defense.strikes == {"pi-15": "cosine -0.43"}
    assert one_round(2) == []
    (reason,) = one_round(3)
    assert "points against the global model's last step (cosine -0.43" in reason
    assert reason.endswith(", and did in 2 of its last 4 rounds")
    s.state.strikes.clear()
    s.state.last_step = {"w": np.ones(4, np.float32)}
    s.arrays = {k: v.copy() for k, v in GLOBAL.items()}
    train(s, 9, [*[honest(n, 1.0) for n in (11, 12, 13, 14)], honest(15, -1.0)])  # cosine -1: at once
    assert [r.device for r in s.state.replies.rejections] == ["pi-15"]


def test_with_one_strike_allowed_a_pull_is_rejected_at_once_and_strikes_survive_a_checkpoint(tmp_path):
    from fleet.federated.on_server.state import load_checkpoint, save_checkpoint

    s = strategy(norm_bound=3.0, min_pull=-0.5, max_sign_skew=None, min_cos=None, strikes=1)
    train(s, 1, [*[honest(n, 1.0) for n in (11, 12, 13, 14)], honest(15, -0.7)])
    assert [r.device for r in s.state.replies.rejections] == ["pi-15"] and s.state.strikes == {"pi-15": [1]}
    save_checkpoint(tmp_path, s.arrays, s.state)
    assert load_checkpoint(tmp_path)[1].strikes == {"pi-15": [1]}


def test_with_similarity_on_sybils_alike_over_rounds_are_weighed_down_not_rejected():
    start = {**GLOBAL, "u": np.zeros(64, np.float32)}
    s = spread_strategy(similarity=True, max_sign_skew=None, min_cos=None)
    goal = 2.0 * np.random.default_rng(99).normal(size=64)
    for r in range(1, 4):
        s.arrays = {k: v.copy() for k, v in start.items()}
        replies = [spread_update(n, 10 * r + n) for n in (11, 12, 13, 14, 15, 16)]
        for node in (17, 18):
            sybil = spread_update(node, 10 * r + node)
            sybil.arrays["u"] = (goal + 0.3 * np.random.default_rng(node + r).normal(size=64)).astype(np.float32)
            replies.append(sybil)
        out = train(s, r, replies)
    weights = s.state.replies.defense.similarity
    assert set(weights) == {"pi-17", "pi-18"} and max(weights.values()) < 0.5  # every honest device keeps 1
    assert s.state.replies.rejections == [] and s.state.replies.defense.as_dict()["similarity"] == weights
    assert abs(float(out["u"] @ goal)) < abs(float(np.mean([r.arrays["u"] for r in replies], axis=0) @ goal))

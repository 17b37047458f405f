"""``fleet bench robustness``: what each attack changes in a real device's reply, and the bench end to end.

The honest replies come from the real ClientApp handlers (client/client_app.py) training the tiny fleet's
model on its synthetic data, with a size-proportional profile so the trained subset is the same on any machine.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, Metadata, RecordDict

from client import client_app
from fleet.base.errors import ConfigError
from fleet.bench import adversary_app as adv
from fleet.bench.robustness import check_choices, run_figures
from fleet.engine.experiment import make_model
from fleet.engine.models import model_meta
from fleet.federated.on_device.round import full_round_time
from fleet.federated.shared import keys
from fleet.federated.shared.config import load_fleet_config, run_dir
from fleet.federated.shared.transfer import encode_upload
from tests.conftest import proportional_profile

TINY = "simulations/fleet-tiny.yaml"
ROOT = Path(__file__).resolve().parent.parent


def incoming(message_type: str, content: RecordDict) -> Message:
    """A message as the SuperNode hands it to the ClientApp."""
    meta = Metadata(
        run_id=1,
        message_id=f"to-device-{message_type}",
        src_node_id=1,
        dst_node_id=7,
        reply_to_message_id="",
        group_id="1",
        created_at=time.time(),
        ttl=600.0,
        message_type=message_type,
    )
    return Message(content=content, metadata=meta)


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    """The tiny fleet's device 0, its context, the global model and the messages of round 1."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("runs")
    cfg = load_fleet_config(TINY, {"output_dir": str(out)})
    model = make_model(cfg.model, cfg.train.seed)
    m = cfg.model
    profile = proportional_profile(
        model, cfg.train.batch_size, cfg.data.input_size, meta=model_meta(m.name, m.num_classes, m.in_channels, False)
    )
    profile_path = profile.save(out / "profile.yaml")
    run_config = {"config": TINY, "output_dir": str(out), "hardware.profile": str(profile_path)}

    def context(partition: int) -> Context:
        return Context(
            run_id=1, node_id=7, node_config={"partition-id": partition}, state=RecordDict(), run_config=run_config
        )

    glob = RecordDict({})
    client_app.put_arrays(glob, model.state_dict())
    deadline = 0.5 * full_round_time(cfg, profile)  # half the round: the honest device trains a subset
    train_cfg = ConfigRecord({keys.SERVER_ROUND: 1, keys.STRATEGY: "fleet", keys.DEADLINE_S: deadline})
    train_msg = incoming(MessageType.TRAIN, RecordDict({**glob, keys.CONFIG: train_cfg}))
    eval_cfg = ConfigRecord({keys.SERVER_ROUND: 1, keys.RUN_TAG: ""})
    eval_msg = incoming(MessageType.EVALUATE, RecordDict({**glob, keys.CONFIG: eval_cfg}))
    honest = client_app.train(train_msg, context(0))
    return {
        "cfg": cfg,
        "context": context,
        "state_dict": model.state_dict(),
        "train_msg": train_msg,
        "eval_msg": eval_msg,
        "honest": honest,
        "honest_eval": client_app.evaluate(eval_msg, context(0)),
    }


def poisoned(device, attack: str, seed: int = 0) -> Message:
    gen = torch.Generator().manual_seed(seed)
    return adv.poison_train_reply(
        attack, device["train_msg"], device["honest"], gen, transfer=device["cfg"].federation.transfer
    )


def values(device, reply: Message) -> dict[str, torch.Tensor]:
    """The values a train reply's upload stands for (in float16 transfers it carries changes)."""
    return adv.uploaded_values(device["train_msg"], reply, device["cfg"].federation.transfer)[0]


def metrics(msg: Message) -> dict:
    return dict(msg.content[keys.METRICS])


def test_honest_reply_uploads_a_trained_subset(device):
    sent, full = values(device, device["honest"]), device["state_dict"]
    assert 0 < metrics(device["honest"])[keys.SELECTED] < metrics(device["honest"])[keys.NUM_TENSORS]
    assert set(sent) < set(full)  # so all_tensors below uploads more than an honest device
    assert any(k.endswith(adv.RUNNING_VAR) for k in sent)  # norm statistics always travel


@pytest.mark.parametrize("attack", adv.ATTACKS)
def test_every_attack_is_a_reply_to_the_same_message_from_the_same_device(device, attack):
    reply = poisoned(device, attack)
    assert reply.metadata.reply_to_message_id == device["train_msg"].metadata.message_id
    assert reply.metadata.message_type == MessageType.TRAIN
    assert reply.content[keys.DEVICE][keys.DEVICE_NAME] == "device-0"
    assert metrics(reply)[keys.PARTITION_ID] == 0


@pytest.mark.parametrize(("attack", "scale"), [("sign_flip", -10.0), ("scaled_update", 1e3)])
def test_update_attacks_scale_the_honest_update(device, attack, scale):
    honest, bad, glob = values(device, device["honest"]), values(device, poisoned(device, attack)), device["state_dict"]
    assert set(bad) == set(honest)
    moved = 0
    for name, t in honest.items():
        if adv.is_norm_statistic(name):
            assert torch.equal(bad[name], t), name  # honest statistics: no negative variance to give it away
            continue
        honest_update = t.double() - glob[name].double()
        bad_update = bad[name].double() - glob[name].double()
        # the upload's own rounding: at worst float16's (federation.transfer) of the change, float32's of the weight
        change = abs(scale) * honest_update.abs().max().item()
        tol = 2**-10 * change + 1e-6 * (1 + glob[name].double().abs().max().item())
        assert torch.allclose(bad_update, scale * honest_update, atol=tol), name
        moved += int(honest_update.abs().max() > 0)
    assert moved > 0
    assert metrics(poisoned(device, attack)) == metrics(device["honest"])  # the lie is in the weights only


def test_under_float16_transfers_an_attack_works_on_values_and_sends_changes_as_an_honest_device_does(device):
    """The honest reply as a float16 fleet's device sends it (each tensor's change from the model received);
    the attack reads the values it stands for and sends its own as changes in float16 too, so it is judged
    by the server's checks, not given away by its dtype."""
    received, honest = device["state_dict"], values(device, device["honest"])
    content = device["honest"].content
    wire = RecordDict({keys.METRICS: content[keys.METRICS], keys.DEVICE: content[keys.DEVICE]})
    client_app.put_arrays(wire, encode_upload(honest, received, "float16"))
    honest16 = Message(wire, reply_to=device["train_msg"])
    gen = torch.Generator().manual_seed(0)
    bad = adv.poison_train_reply("scaled_update", device["train_msg"], honest16, gen, transfer="float16")
    sent = client_app.global_weights(bad)
    assert all(t.dtype == torch.float16 for t in sent.values() if t.is_floating_point())
    meant = adv.uploaded_values(device["train_msg"], bad, "float16")[0]
    name = next(n for n in honest if not adv.is_norm_statistic(n) and n in adv.trainable_names(device["train_msg"]))
    update = honest[name].double() - received[name].double()
    # 1000x the honest update, to float16's precision of each (twice rounded: the honest upload, the attack's)
    tol = 2**-9 * 1e3 * update.abs().max().item() + 1e-6
    assert torch.allclose(meant[name].double() - received[name].double(), 1e3 * update, atol=tol), name


def test_huge_samples_claims_1e12_and_sends_the_honest_weights(device):
    bad = poisoned(device, "huge_samples")
    assert metrics(bad)[keys.NUM_EXAMPLES] == 10**12
    honest = values(device, device["honest"])
    assert all(torch.equal(t, honest[k]) for k, t in values(device, bad).items())


def test_random_weights_replaces_every_float_tensor_with_noise_of_its_scale(device):
    honest, bad = values(device, device["honest"]), values(device, poisoned(device, "random_weights"))
    assert set(bad) == set(honest)
    for name, t in honest.items():
        assert bad[name].dtype == t.dtype and bad[name].shape == t.shape
        if t.numel() >= 1000:
            assert not torch.allclose(bad[name], t)
            ratio = adv.scale_of(bad[name]) / adv.scale_of(t)
            assert 0.8 < ratio < 1.2, name
    again = values(device, poisoned(device, "random_weights"))  # the same seed: the same noise
    assert all(torch.equal(again[k], bad[k]) for k in bad)


def test_bn_poison_sets_running_var_negative_and_running_mean_huge(device):
    honest, bad = values(device, device["honest"]), values(device, poisoned(device, "bn_poison"))
    assert set(bad) == set(honest)
    poisoned_names = [k for k in bad if adv.is_norm_statistic(k)]
    assert poisoned_names
    for name, t in bad.items():
        if name.endswith(adv.RUNNING_VAR):
            assert torch.all(t == -1.0), name
        elif name.endswith(adv.RUNNING_MEAN):
            assert torch.all(t == adv.POISON_RUNNING_MEAN), name
        else:
            assert torch.equal(t, honest[name]), name


def test_metric_poison_lies_in_train_and_evaluate_metrics(device):
    bad = poisoned(device, "metric_poison")
    got = metrics(bad)
    assert got[keys.FULL_TIME_S] == 1e-9 and got[keys.PREDICTED_TIME_S] == 1e12
    assert got[keys.BYTES_UPLOADED] == -(10**12) and got[keys.TRAINED_FRACTION] == 7.0
    assert math.isnan(got[keys.LOSS])
    assert got[keys.NUM_EXAMPLES] == metrics(device["honest"])[keys.NUM_EXAMPLES]
    honest = values(device, device["honest"])
    assert all(torch.equal(t, honest[k]) for k, t in values(device, bad).items())
    ev = adv.poison_evaluate_reply("metric_poison", device["eval_msg"], device["honest_eval"])
    assert ev.metadata.reply_to_message_id == device["eval_msg"].metadata.message_id
    assert metrics(ev)[keys.GLOBAL_ACCURACY] == 1e6 and math.isnan(metrics(ev)[keys.PERSONAL_ACCURACY])
    assert metrics(ev)[keys.NUM_EXAMPLES] == metrics(device["honest_eval"])[keys.NUM_EXAMPLES]
    # every other attack leaves evaluation alone
    assert adv.poison_evaluate_reply("sign_flip", device["eval_msg"], device["honest_eval"]) is device["honest_eval"]


def test_all_tensors_uploads_every_state_dict_key_near_the_received_model(device):
    bad = poisoned(device, "all_tensors")
    sent, glob = values(device, bad), device["state_dict"]
    assert set(sent) == set(glob) and len(sent) > len(values(device, device["honest"]))
    for name, g in glob.items():
        assert sent[name].dtype == g.dtype and sent[name].shape == g.shape
        if g.is_floating_point():
            assert (sent[name].double() - g.double()).abs().max() <= 6 * adv.ALL_TENSORS_NOISE * adv.scale_of(g)
        else:
            assert torch.equal(sent[name], g)  # num_batches_tracked: as received
    got = metrics(bad)
    assert got[keys.SELECTED] == 1
    real_bytes = sum(t.numel() * t.element_size() for t in sent.values())
    assert 0 < got[keys.BYTES_UPLOADED] < 1e-3 * real_bytes


def test_the_app_attacks_only_listed_partitions_and_only_with_an_attack_file(device):
    ctx0, ctx3 = device["context"](0), device["context"](3)
    spec = run_dir(device["cfg"]) / adv.ATTACK_FILE
    assert adv.attack_file(ctx0) == spec
    assert adv.attack_of(ctx0) is None  # no file: the real device
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"attack": "huge_samples", "partitions": [0]}))
    try:
        assert adv.attack_of(ctx0) == "huge_samples" and adv.attack_of(ctx3) is None
        assert metrics(adv.train(device["train_msg"], ctx0))[keys.NUM_EXAMPLES] == 10**12
        honest = metrics(adv.train(device["train_msg"], ctx3))[keys.NUM_EXAMPLES]
        assert 0 < honest < 1000
        assert adv.evaluate(device["eval_msg"], ctx0).content[keys.METRICS][keys.GLOBAL_ACCURACY] <= 1
        spec.write_text(json.dumps({"attack": "nonsense", "partitions": [0]}))
        with pytest.raises(ValueError, match="unknown attack 'nonsense'"):
            adv.attack_of(ctx0)
    finally:
        spec.unlink()


def test_figures_of_a_finished_and_of_a_crashed_run(tmp_path):
    def row(pid: int, acc: float, n: int = 10) -> dict:
        return {"partition_id": pid, "global_accuracy": acc, "test_examples": n}

    done = tmp_path / "done"
    done.mkdir()
    (done / "summary.json").write_text(json.dumps({"rounds": 4}))
    rounds = [
        {
            "round": r,
            "rejections": [{"device": "device-0", "reason": "x"}] * (r == 1)
            + [{"device": "device-2", "reason": "y"}] * (r == 2),
            "devices": [row(0, 0.0), row(2, a), row(3, b, 30)],
            "server_accuracy": server,
            "defense": {"skewed": {"device-0": 2, "device-2": 1}} if r == 3 else {},
        }
        for r, a, b, server in ((1, 0.1, 0.1, 0.2), (2, 0.5, 0.7, 0.3), (3, 0.6, 0.6, 0.4), (4, 0.9, 0.5, 0.8))
    ]
    (done / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    fig = run_figures(done, None, honest_from=2, adversaries=["device-0"])  # partition 0 (an adversary): no judge
    assert fig == {
        "final_accuracy": pytest.approx((0.3 + 0.4 + 0.8) / 3),  # the server's test set, last 3 rounds
        "honest_device_accuracy": pytest.approx((0.65 + 0.6 + 0.6) / 3),
        "rejected_replies": 2,
        "honest_rejected": 1,  # device-2's: the adversary's rejection is not counted
        "honest_tensors_left_out": 1,  # device-2's tensor; the adversary's two are not counted
        "server_crashed": False,
        "rounds": 4,
    }
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    lines = [
        {"round": 1, "devices": [row(2, 0.5)], "rejections": [{"reason": "x"}]},
        {"round": 2, "devices": [row(2, float("nan"))], "rejections": [{"reason": "y"}, {"reason": "z"}]},
    ]
    (crashed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"round": 3, "glo')
    fig = run_figures(crashed, "exit 1: boom", honest_from=2, adversaries=[])
    assert fig["server_crashed"] and fig["error"] == "exit 1: boom"
    assert fig["final_accuracy"] is None  # no server accuracy recorded
    assert fig["honest_device_accuracy"] == 0.5 and fig["rejected_replies"] == 3 and fig["rounds"] == 2  # NaN skipped
    assert fig["honest_rejected"] == 3  # a clean run: every rejection is an honest device's
    assert run_figures(done, "timed out after 5s", 2, [])[
        "server_crashed"
    ]  # a non-zero exit counts even with a summary
    assert run_figures(tmp_path / "never", None, 2, [])["server_crashed"]


def test_bad_choices_are_one_line_errors():
    with pytest.raises(ConfigError, match="'flip' is not an attack"):
        check_choices(["flip"], [1], 8)
    with pytest.raises(ConfigError, match="--adversaries: 8 is not allowed"):
        check_choices(["sign_flip"], [8], 8)
    check_choices(list(adv.ATTACKS), [1, 2], 8)


def test_robustness_config_loads_and_the_cli_knows_every_attack():
    from fleet.cli import build_parser

    cfg = load_fleet_config("simulations/robustness.yaml")
    assert cfg.devices.num_devices == 8 and cfg.start.samples > 0
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    robustness = bench._subparsers._group_actions[0].choices["robustness"]
    assert all(a in robustness.format_help() for a in adv.ATTACKS)


@pytest.mark.slow
def test_bench_end_to_end_prints_one_json_object(tmp_path):
    cmd = [sys.executable, "-c", "import sys; from fleet.cli import main; sys.exit(main())"]
    cmd += [
        "bench",
        "robustness",
        "--config",
        TINY,
        "--attacks",
        "sign_flip",
        "--adversaries",
        "1",
        "--cost-seeds",
        "0",
        "--set",
        "federation.rounds=2",
        "--output-dir",
        str(tmp_path),
        "--json",
    ]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    report = json.loads(out)  # nothing but the JSON object on stdout
    assert "sign_flip" in err  # progress went to stderr
    assert isinstance(report["clean_final_accuracy"], float) and report["aggregation"] == "trimmed_mean"
    assert not report["clean"]["server_crashed"]
    assert len(report["attacks"]) == 1
    entry = report["attacks"][0]
    assert {"attack", "adversaries", "final_accuracy", "rejected_replies", "server_crashed"} <= set(entry)
    assert (entry["attack"], entry["adversaries"], entry["server_crashed"]) == ("sign_flip", 1, False)
    assert isinstance(entry["final_accuracy"], float) and isinstance(entry["rejected_replies"], int)
    assert entry["rounds"] == 2
    assert json.loads((tmp_path / "robustness.json").read_text())["attacks"] == report["attacks"]
    (cost,) = report["clean_cost"]["seeds"]  # seed 0's clean run reused, its plain-mean twin run
    assert cost["seed"] == 0 and cost["defenses"] == report["clean_final_accuracy"]
    assert cost["cost"] == pytest.approx(cost["plain_mean"] - cost["defenses"])
    assert report["clean_cost"]["mean_cost"] == pytest.approx(cost["cost"])
    spec = json.loads((Path(entry["run_dir"]) / adv.ATTACK_FILE).read_text())
    assert spec == {"attack": "sign_flip", "partitions": [0]}


def spied(device) -> list[adv.attacks.Update]:
    """Two honest updates seen a round earlier: the device's own, and one that trained only the
    first half of its tensors, scaled (so tensors differ in how many devices trained them)."""
    own = adv.own_update(
        values(device, device["honest"]), device["state_dict"], set(adv.trainable_names(device["train_msg"]))
    )
    half = dict(list(own.items())[: len(own) // 2])
    return [own, {n: 2 * u for n, u in half.items()}]


@pytest.mark.parametrize("attack", adv.KNOWING)
def test_an_adaptive_attacker_that_knows_nothing_yet_sends_its_honest_reply(device, attack):
    assert poisoned(device, attack) is device["honest"]  # round 1: no honest update seen


def test_alie_replaces_the_trained_tensors_and_keeps_the_statistics(device):
    honest = spied(device)
    gen = torch.Generator().manual_seed(0)
    transfer = device["cfg"].federation.transfer
    reply = adv.poison_train_reply("alie", device["train_msg"], device["honest"], gen, honest, transfer=transfer)
    bad, glob, sent = values(device, reply), device["state_dict"], values(device, device["honest"])
    assert set(bad) == set(sent) and metrics(reply)[keys.SELECTED] == metrics(device["honest"])[keys.SELECTED]
    own = adv.own_update(sent, glob, set(adv.trainable_names(device["train_msg"])))
    expected = adv.attacks.alie(own, honest)
    for name, t in bad.items():
        if name in expected:
            assert torch.allclose(t.double() - glob[name].double(), expected[name], atol=1e-5), name
        else:
            assert torch.equal(t, sent[name]), name


def test_mask_abuse_claims_the_rarest_tensors_and_passes_the_upload_check(device):
    from fleet.federated.on_server.robust import upload_problem

    honest = spied(device)
    gen = torch.Generator().manual_seed(0)
    transfer = device["cfg"].federation.transfer
    reply = adv.poison_train_reply("mask_abuse", device["train_msg"], device["honest"], gen, honest, transfer=transfer)
    bad, names = values(device, reply), adv.trainable_names(device["train_msg"])
    half = set(honest[1])
    assert bad and set(bad) == {n for n in values(device, device["honest"]) if n in names and n not in half}
    arrays = {n: t.numpy() for n, t in bad.items()}
    assert upload_problem(arrays, metrics(reply)[keys.SELECTED], names) is None  # claims exactly what it sends
    assert metrics(reply)[keys.BYTES_UPLOADED] == sum(a.nbytes for a in arrays.values())


def test_honest_devices_leave_their_update_for_the_next_rounds_adversaries(device):
    ctx3 = device["context"](3)
    spec = run_dir(device["cfg"]) / adv.ATTACK_FILE
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"attack": "alie", "partitions": [0]}))
    try:
        adv.train(device["train_msg"], ctx3)  # honest in round 1: leaves its update
        assert (adv.spy_dir(ctx3, 1) / "3.pt").is_file()
        content = device["train_msg"].content
        config = ConfigRecord({**dict(content[keys.CONFIG]), keys.SERVER_ROUND: 2})
        round2 = incoming(MessageType.TRAIN, RecordDict({**content, keys.CONFIG: config}))
        seen = adv.spied_updates(device["context"](0), round2)
        assert len(seen) == 1 and set(seen[0]) <= set(adv.trainable_names(device["train_msg"]))
        assert adv.spied_updates(device["context"](0), device["train_msg"]) == []  # round 1: nothing before it
    finally:
        spec.unlink()
        shutil.rmtree(spec.parent / adv.SPY_DIR, ignore_errors=True)


def test_an_adaptive_adversary_sends_the_strength_its_dry_run_found_and_notes_it(device):
    ctx3, ctx0 = device["context"](3), device["context"](0)
    spec = run_dir(device["cfg"]) / adv.ATTACK_FILE
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"attack": "backdoor", "partitions": [0], "adaptive": True}))
    try:
        adv.train(device["train_msg"], ctx3)  # an honest device of round 1 leaves its update
        assert adv.train(device["train_msg"], ctx0) is not None  # round 1: nothing seen, nothing searched ...
        assert not (spec.parent / adv.EDGE_DIR).exists()
        assert (adv.spy_dir(ctx0, 1) / adv.RECEIVED).is_file()  # ... but its model kept: round 2's last step
        content = device["train_msg"].content
        config = ConfigRecord({**dict(content[keys.CONFIG]), keys.SERVER_ROUND: 2})
        round2 = incoming(MessageType.TRAIN, RecordDict({**content, keys.CONFIG: config}))
        reply = adv.train(round2, ctx0)
        note = json.loads((spec.parent / adv.EDGE_DIR / "2-0.json").read_text())
        assert note["round"] == 2 and note["partition"] == 0 and note["strength"] > 0
        # each tensor the honest device trained too is boosted to the strength found, in its typical lengths
        honest = adv.spied_updates(ctx0, round2)[0]
        sent = adv.own_update(values(device, reply), device["state_dict"], set(honest))
        ratios = [float(sent[n].norm() / honest[n].norm()) for n in honest if n in sent and honest[n].norm() > 0]
        assert ratios and all(r == pytest.approx(note["strength"], rel=2e-3) for r in ratios)
    finally:
        spec.unlink()
        shutil.rmtree(spec.parent / adv.SPY_DIR, ignore_errors=True)
        shutil.rmtree(spec.parent / adv.EDGE_DIR, ignore_errors=True)


def test_data_attacks_train_the_real_device_on_altered_labels(device):
    base = client_app.device_of(device["context"](0))
    flipped = adv.PoisonedDevice(base.cfg, base.partition_id, base.name, base.node_config, attack="label_flip")
    assert torch.equal(flipped.data().train.labels, 9 - base.data().train.labels)
    backdoor = adv.PoisonedDevice(base.cfg, base.partition_id, base.name, base.node_config, attack="backdoor")
    share = float((backdoor.data().train.labels != base.data().train.labels).float().mean())
    assert 0.3 < share <= 0.5  # half triggered as class 0; the ones already of class 0 keep their label


def test_the_plain_mean_the_defenses_cost_is_measured_against_has_every_defense_off():
    from fleet.bench.robustness import PLAIN_MEAN

    robust = load_fleet_config("simulations/robustness.yaml", {"robust.similarity": True, **PLAIN_MEAN}).robust
    assert robust.aggregation == "mean"
    assert (robust.norm_bound, robust.min_pull, robust.min_cos, robust.max_sign_skew, robust.norm_growth) == (None,) * 5
    assert robust.validate is None and robust.similarity is False  # off, though the bench's --set turned it on

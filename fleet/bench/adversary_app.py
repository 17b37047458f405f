"""A ClientApp for ``fleet bench robustness``: the real device, except that adversarial ones lie.

Attacks are bench code, as fault injection is test code (tests/failing_client_app.py): the
production ClientApp has no attack switch. This app runs the real handlers of
:mod:`client.client_app` and, on a device the bench named adversarial, rewrites the honest reply
before it leaves, so an attack is exactly "what an honest device would have sent, changed so".

The bench writes ``<run_dir>/attack.json`` (``{"attack": "sign_flip", "partitions": [0]}``)
before launching the simulation; a device is adversarial when its node config ``partition-id``
is listed there. Without that file this app behaves exactly like the real one.

The adaptive attacks (:mod:`fleet.bench.attacks`) know the honest updates of the previous round:
under them every honest device also leaves its update in ``<run_dir>/spy/<round>/``, which the
adversaries read a round later (a device the bench made honest still answers exactly as the real one).
Label flipping and the backdoor train the real device on altered data.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client import client_app
from fleet.bench import attacks, edge
from fleet.bench.attack_names import ATTACKS, DATA_ATTACKS, KNOWING
from fleet.federated.on_device import tasks
from fleet.federated.shared import keys, packing
from fleet.federated.shared.config import config_from_run_config, run_dir
from fleet.federated.shared.split import DeviceData
from fleet.federated.shared.transfer import encode_upload, upload_values

ATTACK_FILE = "attack.json"
SPY_DIR = "spy"
HUGE_SAMPLES = 10**12
UPDATE_SCALES = {"scaled_update": 1e3, "sign_flip": -10.0}
POISON_RUNNING_VAR = -1.0
POISON_RUNNING_MEAN = 3e4  # 10^4 times a typical mean, and still a float16 (federation.transfer: float16)
ALL_TENSORS_NOISE = 1e-2  # relative to each tensor's scale: close enough to the global model to look plausible
TRAIN_METRIC_POISON: dict[str, float | int] = {
    keys.FULL_TIME_S: 1e-9,  # drags the next deadline (the fastest full round) to nothing
    keys.PREDICTED_TIME_S: 1e12,  # would stall the simulated clock
    keys.BYTES_UPLOADED: -(10**12),
    keys.LOSS: math.nan,
    keys.TRAINED_FRACTION: 7.0,
}
EVALUATE_METRIC_POISON: dict[str, float] = {keys.GLOBAL_ACCURACY: 1e6, keys.PERSONAL_ACCURACY: math.nan}
# torch's BatchNorm buffer names (model state_dict suffixes, not message keys)
RUNNING_VAR, RUNNING_MEAN = ".running_var", ".running_mean"


def attack_file(context: Context) -> Path:
    """Where the bench leaves the run's attack: in the run's directory, found from the run config."""
    return run_dir(config_from_run_config(dict(context.run_config))) / ATTACK_FILE


def attack_spec(context: Context) -> dict | None:
    """The run's attack file (``{"attack": ..., "partitions": [...]}``), or None in a clean run."""
    path = attack_file(context)
    if not path.is_file():
        return None
    spec = json.loads(path.read_text())
    if spec.get("attack") not in ATTACKS:
        raise ValueError(f"{path}: unknown attack {spec.get('attack')!r}; use one of {', '.join(ATTACKS)}")
    return spec


def attack_of(context: Context) -> str | None:
    """This device's attack, or None when it is honest (no attack file, or not one of its partitions)."""
    spec = attack_spec(context)
    partition = context.node_config.get(keys.NODE_PARTITION_ID)
    if spec is None or partition is None or int(partition) not in {int(p) for p in spec.get("partitions", [])}:
        return None
    return str(spec["attack"])


def scale_of(tensor: torch.Tensor) -> float:
    """A tensor's typical magnitude (its RMS), floored so that an all-zero tensor still gets noise."""
    return max(float(tensor.double().pow(2).mean().sqrt()), 1e-3)


def is_norm_statistic(name: str) -> bool:
    return name.endswith((RUNNING_VAR, RUNNING_MEAN))


def poison_arrays(
    attack: str, sent: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor], gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """The tensors an adversarial device uploads instead of the honest ``sent`` ones.

    ``received`` is the global model the device was sent: an update is ``sent - received``. The update
    attacks scale the weights' update only and send honest norm statistics: a scaled running_var
    update turns negative, which a one-line check catches, so scaling it too would test that check
    rather than the norm bound and robust means. The statistics have their own attack, ``bn_poison``."""
    out = dict(sent)
    if attack in UPDATE_SCALES:
        scale = UPDATE_SCALES[attack]
        for name, t in sent.items():
            if t.is_floating_point() and not is_norm_statistic(name):
                g = received[name].double()
                out[name] = (g + scale * (t.double() - g)).to(t.dtype)
    elif attack == "random_weights":
        for name, t in sent.items():
            if t.is_floating_point():
                out[name] = (torch.randn(t.shape, generator=gen, dtype=torch.float64) * scale_of(t)).to(t.dtype)
    elif attack == "bn_poison":
        for name, t in sent.items():
            if name.endswith(RUNNING_VAR):
                out[name] = torch.full_like(t, POISON_RUNNING_VAR)
            elif name.endswith(RUNNING_MEAN):
                out[name] = torch.full_like(t, POISON_RUNNING_MEAN)
    elif attack == "all_tensors":
        out = {}
        for name, g in received.items():
            noise = torch.randn(g.shape, generator=gen, dtype=torch.float64) * ALL_TENSORS_NOISE * scale_of(g)
            out[name] = (g.double() + noise).float() if g.is_floating_point() else g.clone()
    return out


def poison_train_metrics(attack: str, metrics: Mapping[str, object], sent: Mapping[str, torch.Tensor]) -> dict:
    """The metrics an adversarial device reports with its train reply; ``sent``: the honest upload."""
    out = dict(metrics)
    if attack == "huge_samples":
        out[keys.NUM_EXAMPLES] = HUGE_SAMPLES
    elif attack == "metric_poison":
        out.update(TRAIN_METRIC_POISON)
    elif attack == "all_tensors":
        # "I trained one small tensor": the bytes of the smallest tensor it would honestly have sent
        out[keys.SELECTED] = 1
        out[keys.BYTES_UPLOADED] = min((t.numel() * t.element_size() for t in sent.values()), default=4)
    return out


def _generator(msg: Message, context: Context) -> torch.Generator:
    """Seeded by partition and round: an attacked run is as reproducible as a clean one."""
    server_round = int(msg.content[keys.CONFIG].get(keys.SERVER_ROUND, 0))
    partition = int(context.node_config.get(keys.NODE_PARTITION_ID, 0))
    return torch.Generator().manual_seed(1_000_003 * server_round + partition)


def uploaded_values(
    msg: Message, reply: Message, transfer: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The values an honest train reply stands for, and the model its device received: the attacks work on
    values; what they send is encoded as an honest upload is (``federation.transfer``)."""
    received = client_app.global_weights(msg)
    return upload_values(client_app.global_weights(reply), received, transfer), received


def transfer_of(context: Context) -> str:
    return config_from_run_config(dict(context.run_config)).federation.transfer


def poison_train_reply(
    attack: str,
    msg: Message,
    reply: Message,
    gen: torch.Generator,
    honest: list[attacks.Update] | None = None,
    *,
    transfer: str,
    strength: float | None = None,
) -> Message:
    """The honest train ``reply`` to ``msg`` rewritten by ``attack``: a new reply to the same message.
    ``honest``: the spied honest updates an adaptive attack works from (without them, in round 1, it
    sends its honest reply); ``transfer``: the fleet's, as the reply is encoded; ``strength``: an attack
    that knows the honest updates at this strength (None: its fixed one)."""
    if reply.has_error() or attack == "label_flip" or (attack in KNOWING and not honest):
        return reply  # label flipping is all in the data it trained on
    content = reply.content
    sent, received = uploaded_values(msg, reply, transfer)
    metrics = poison_train_metrics(attack, dict(content[keys.METRICS]), sent)
    if attack in KNOWING:
        names = trainable_names(msg)
        arrays = adaptive_arrays(attack, sent, received, honest or [], names, strength)
        metrics[keys.SELECTED] = sum(1 for name in arrays if name in set(names))
        metrics[keys.BYTES_UPLOADED] = sum(t.numel() * t.element_size() for t in arrays.values())
    else:
        arrays = poison_arrays(attack, sent, received, gen)
    new = RecordDict({keys.METRICS: MetricRecord(metrics), keys.DEVICE: content[keys.DEVICE]})
    client_app.put_arrays(new, encode_upload(arrays, received, transfer))
    return Message(new, reply_to=msg)


def own_update(sent: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor], names) -> attacks.Update:
    """The trainable float tensors of an upload as updates (float64) from the model received."""
    return {n: sent[n].double() - received[n].double() for n in sent if n in names and sent[n].is_floating_point()}


def adaptive_arrays(
    attack: str,
    sent: Mapping[str, torch.Tensor],
    received: Mapping[str, torch.Tensor],
    honest: list[attacks.Update],
    names: list[str],
    strength: float | None = None,
) -> dict[str, torch.Tensor]:
    """What an adaptive attacker uploads at ``strength`` (None: the attack's fixed one): its honest upload
    with the trainable tensors' updates replaced (mask abuse: only the tensors it claims)."""
    update = attacks.craft(attack, own_update(sent, received, set(names)), honest, strength)
    out = {} if attack == "mask_abuse" else dict(sent)
    for name, u in update.items():
        out[name] = (received[name].double() + u).float()  # values; encoded as an honest upload is
    return out


_NAMES: dict[str, list[str]] = {}


def trainable_names(msg: Message) -> list[str]:
    """The model's trainable tensors in the message's order: the floats a BatchNorm does not keep as
    statistics (what a device may claim as trained)."""
    names = msg.content[keys.PACKING][packing.NAMES]
    key = ",".join(names)
    if key not in _NAMES:
        _NAMES[key] = [n for n in names if not is_norm_statistic(n) and not n.endswith("num_batches_tracked")]
    return _NAMES[key]


# --- what the adaptive attackers know: the honest updates of the previous round ------------------
def spy_dir(context: Context, server_round: int) -> Path:
    return attack_file(context).parent / SPY_DIR / str(server_round)


def leave_update(context: Context, msg: Message, reply: Message) -> None:
    """An honest device's update of this round, for the adversaries of the next (written atomically;
    the round before last is removed: nobody reads it again)."""
    if reply.has_error():
        return
    server_round = _round_of(msg)
    sent, received = uploaded_values(msg, reply, transfer_of(context))
    update = {n: u.float() for n, u in own_update(sent, received, set(trainable_names(msg))).items()}
    folder = spy_dir(context, server_round)
    folder.mkdir(parents=True, exist_ok=True)
    partition = int(context.node_config.get(keys.NODE_PARTITION_ID, 0))
    tmp = folder / f".{partition}.pt.tmp"
    torch.save(update, tmp)
    os.replace(tmp, folder / f"{partition}.pt")
    shutil.rmtree(spy_dir(context, server_round - 2), ignore_errors=True)


def spied_updates(context: Context, msg: Message) -> list[attacks.Update]:
    """The honest updates of the previous round (none in round 1)."""
    folder = spy_dir(context, _round_of(msg) - 1)
    files = sorted(folder.glob("*.pt")) if folder.is_dir() else []
    return [{n: t.double() for n, t in torch.load(f, weights_only=True).items()} for f in files]


def _round_of(msg: Message) -> int:
    return int(msg.content[keys.CONFIG].get(keys.SERVER_ROUND, 0))


# --- at the edge of the checks: the largest strength the server's own defense accepts (fleet.bench.edge) --------
EDGE_DIR = "edge"  # <run_dir>/edge/<round>-<partition>.json: the strength each adversary chose, for the bench
RECEIVED = "received.model"  # in a round's spy folder: the global model an adversary received (not a *.pt update)


def last_step_seen(context: Context, msg: Message, received: Mapping[str, torch.Tensor], names: list[str]) -> dict:
    """The global model's last step as an adversary saw it (this round's model less the last it received, where
    it received one), after leaving this round's for the next."""
    server_round = _round_of(msg)
    folder = spy_dir(context, server_round)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{RECEIVED}.{os.getpid()}.tmp"
    torch.save({n: received[n] for n in names}, tmp)
    os.replace(tmp, folder / RECEIVED)
    before = spy_dir(context, server_round - 1) / RECEIVED
    if not before.is_file():
        return {}
    old = torch.load(before, weights_only=True)
    steps = {n: (received[n] - old[n]).numpy() for n in names if n in old}
    return {n: d for n, d in steps.items() if d.any()}


def edge_of(
    attack: str, context: Context, msg: Message, reply: Message, honest: list[attacks.Update], colluders: int
) -> float | None:
    """The largest strength at which the server's defense, run here on the spied honest updates and the
    ``colluders``' crafted replies, keeps them whole (:mod:`fleet.bench.edge`); noted for the bench. None in a
    round with no honest update seen yet, which still leaves the model received for the next round's last step."""
    cfg = config_from_run_config(dict(context.run_config))
    sent, received = uploaded_values(msg, reply, cfg.federation.transfer)
    names = trainable_names(msg)
    trend = last_step_seen(context, msg, received, names)
    if not honest:
        return None
    own = own_update(sent, received, set(names))

    def values(update: attacks.Update) -> dict:
        return {n: (received[n].double() + u).float().numpy() for n, u in update.items()}

    current = {n: t.numpy() for n, t in received.items()}
    dry = edge.DryRun(cfg.robust, current, names, [values(h) for h in honest], colluders, trend)
    start = attacks.FIXED_STRENGTH[attack] or 1.0
    strength = edge.edge_strength(lambda s: dry.accepts(values(attacks.craft(attack, own, honest, s))), start)
    partition = int(context.node_config.get(keys.NODE_PARTITION_ID, 0))
    note = attack_file(context).parent / EDGE_DIR / f"{_round_of(msg)}-{partition}.json"
    note.parent.mkdir(parents=True, exist_ok=True)
    note.write_text(json.dumps({"round": _round_of(msg), "partition": partition, "strength": strength}))
    return strength


@dataclasses.dataclass
class PoisonedDevice(tasks.Device):
    """The real device, training on altered data: labels flipped, or part of it backdoored."""

    attack: str = "label_flip"

    def data(self) -> DeviceData:
        data = super().data()
        if self.attack == "label_flip":
            return dataclasses.replace(data, train=attacks.flip_labels(data.train))
        return dataclasses.replace(data, train=attacks.backdoor_data(data.train, self.cfg.data.input_size, self.seed))


def device_train(msg: Message, context: Context, attack: str | None) -> Message:
    """The device's train reply, from altered data under a data attack."""
    if attack not in DATA_ATTACKS:
        return client_app.train(msg, context)
    base = client_app.device_of(context)
    device = PoisonedDevice(base.cfg, base.partition_id, base.name, base.node_config, base.long_lived, attack=attack)
    return client_app.train_device(msg, device)


def poison_evaluate_reply(attack: str, msg: Message, reply: Message) -> Message:
    """The honest evaluate ``reply``, with poisoned accuracies under ``metric_poison`` (else unchanged)."""
    if attack != "metric_poison" or reply.has_error():
        return reply
    metrics = {**dict(reply.content[keys.METRICS]), **EVALUATE_METRIC_POISON}
    new = RecordDict({keys.METRICS: MetricRecord(metrics), keys.DEVICE: reply.content[keys.DEVICE]})
    return Message(new, reply_to=msg)


app = ClientApp()
app.query()(client_app.query)


@app.train()
def train(msg: Message, context: Context) -> Message:
    spec, attack = attack_spec(context), attack_of(context)
    reply = device_train(msg, context, attack)
    if attack is None:
        if spec is not None and spec["attack"] in KNOWING:
            leave_update(context, msg, reply)
        return reply
    honest = spied_updates(context, msg) if attack in KNOWING else None
    adaptive = attack in KNOWING and not reply.has_error() and bool(spec and spec.get("adaptive"))
    colluders = len(spec["partitions"]) if spec else 0
    strength = edge_of(attack, context, msg, reply, honest or [], colluders) if adaptive else None
    gen, transfer = _generator(msg, context), transfer_of(context)
    return poison_train_reply(attack, msg, reply, gen, honest, transfer=transfer, strength=strength)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    reply = client_app.evaluate(msg, context)
    attack = attack_of(context)
    return reply if attack is None else poison_evaluate_reply(attack, msg, reply)

"""A ClientApp for ``fleet bench robustness``: the real device, except that adversarial ones lie.

Attacks are bench code, as fault injection is test code (tests/failing_client_app.py): the
production ClientApp has no attack switch. This app runs the real handlers of
:mod:`client.client_app` and, on a device the bench named adversarial, rewrites the honest reply
before it leaves, so an attack is exactly "what an honest device would have sent, changed so".

The bench writes ``<run_dir>/attack.json`` (``{"attack": "sign_flip", "partitions": [0]}``)
before launching the simulation; a device is adversarial when its node config ``partition-id``
is listed there. Without that file this app behaves exactly like the real one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client import client_app
from fleet.federated import keys
from fleet.federated.config import config_from_run_config, run_dir

ATTACK_FILE = "attack.json"
ATTACKS = (
    "huge_samples",  # the reply claims 1e12 samples: one device outweighs the fleet in a sample-weighted mean
    "scaled_update",  # the weights' update (reply - received global) times 1e3
    "sign_flip",  # the weights' update times -10: gradient ascent, amplified
    "random_weights",  # every uploaded float tensor replaced by noise of its own scale
    "bn_poison",  # BatchNorm running_var -1 (a negative variance) and running_mean 1e6
    "metric_poison",  # absurd train metrics (clocks, bytes, loss, trained fraction) and evaluate accuracies
    "all_tensors",  # uploads every tensor (received + small noise) while claiming one trained tensor and few bytes
)
HUGE_SAMPLES = 10**12
UPDATE_SCALES = {"scaled_update": 1e3, "sign_flip": -10.0}
POISON_RUNNING_VAR = -1.0
POISON_RUNNING_MEAN = 1e6
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


def attack_of(context: Context) -> str | None:
    """This device's attack, or None when it is honest (no attack file, or not one of its partitions)."""
    path = attack_file(context)
    if not path.is_file():
        return None
    spec = json.loads(path.read_text())
    partition = context.node_config.get(keys.NODE_PARTITION_ID)
    if partition is None or int(partition) not in {int(p) for p in spec.get("partitions", [])}:
        return None
    if spec.get("attack") not in ATTACKS:
        raise ValueError(f"{path}: unknown attack {spec.get('attack')!r}; use one of {', '.join(ATTACKS)}")
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
            out[name] = (g.double() + noise).to(g.dtype) if g.is_floating_point() else g.clone()
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


def poison_train_reply(attack: str, msg: Message, reply: Message, gen: torch.Generator) -> Message:
    """The honest train ``reply`` to ``msg`` rewritten by ``attack``: a new reply to the same message."""
    if reply.has_error():
        return reply
    content = reply.content
    sent = content[keys.ARRAYS].to_torch_state_dict()
    received = msg.content[keys.ARRAYS].to_torch_state_dict()
    metrics = poison_train_metrics(attack, dict(content[keys.METRICS]), sent)
    arrays = poison_arrays(attack, sent, received, gen)
    new = RecordDict({keys.METRICS: MetricRecord(metrics), keys.DEVICE: content[keys.DEVICE]})
    new[keys.ARRAYS] = ArrayRecord.from_torch_state_dict(arrays)
    return Message(new, reply_to=msg)


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
    reply = client_app.train(msg, context)
    attack = attack_of(context)
    return reply if attack is None else poison_train_reply(attack, msg, reply, _generator(msg, context))


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    reply = client_app.evaluate(msg, context)
    attack = attack_of(context)
    return reply if attack is None else poison_evaluate_reply(attack, msg, reply)

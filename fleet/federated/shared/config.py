"""The fleet's config: the experiment's model/data/train sections plus one section per part of the fleet.

One YAML file (see ``simulations/``) drives ``fleet simulate``, ``flwr run .``
and the benchmarks. Each section is a small dataclass that carries its own rules
(``RULES``, by field name): ``federation`` (the rounds), ``elastic`` (how a device
picks its tensors), ``devices`` (the simulated devices), ``simulation`` (Flower's
engine on Ray), ``membership`` (deployment), ``robust`` (aggregation that one device
cannot steer), ``personalization``, ``evaluation`` and ``start`` (the starting
model). Every field is validated on load; a bad one raises
:class:`~fleet.base.errors.ConfigError` naming the field, its value and what is
allowed, and a field of the old flat ``federation`` section names its new place.
docs/config.md is generated from these dataclasses (``fleet.commands.reference``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from fleet.base.errors import ConfigError
from fleet.data.shift import ShiftConfig, check_shift
from fleet.engine.config import (
    LABELS_RULE,
    ExperimentConfig,
    Rule,
    apply_overrides,
    build_dataclass,
    check_moved,
    read_yaml_mapping,
)
from fleet.engine.config import MOVED as ENGINE_MOVED
from fleet.federated.shared.class_config import DeviceClassConfig, check_classes
from fleet.federated.shared.paths import resolve_path
from fleet.federated.shared.personal import METHODS as PERSONAL_METHODS
from fleet.federated.shared.personal import POLICIES as PERSONAL_POLICIES
from fleet.federated.shared.personal import method_of, models_of
from fleet.federated.shared.robust_choices import AGGREGATIONS, NORM_ACTIONS, VALIDATIONS

STRATEGIES = ("fleet", "naive", "fedavg", "ditto")
STATE_PRECISIONS = ("float32", "float16")  # federation.state_precision: how a device's saved momentum is stored
TRANSFERS = ("float32", "float16")  # federation.transfer: the dtype a model's float tensors cross the network in
RAY_ADDRESS = re.compile(r"[A-Za-z0-9.\-]+:[0-9]{1,5}")  # host:port of a Ray head (its GCS)
PARTITIONS = ("iid", "dirichlet", "shards")
RUN_ONLY_KEYS = ("config", "resume", "simulation")  # run-config keys that are not fields of the YAML


Rules = ClassVar[dict[str, Rule]]  # a section's own checks, by field name (fleet.engine.config.rule_of)


@dataclass
class FederationConfig:
    """The rounds: which strategy, how many, how long each may take, and how the server steps."""

    # fleet (elastic + window + blending), naive (per-device elastic), fedavg (full training), ditto (naive's
    # selection with personalization.method ditto: a personal model trained toward the global one)
    strategy: str = "fleet"
    rounds: int = 10  # rounds to run (time_budget_s may stop the run sooner)
    time_budget_s: float | None = None  # also stop once the simulated clock reaches this (equal-time comparisons)
    local_steps: int = 10  # training batches per device per round
    deadline_s: float | None = None  # round deadline; null: the fastest device's full-training time
    deadline_factor: float = 1.0  # scales the automatic deadline
    deadline_includes_upload: bool = (
        True  # the deadline bounds compute + upload; each tensor's upload is charged to the device's budget
    )
    devices_per_round: int | None = None  # sample up to this many connected devices per round (seeded); null: all
    timeout_s: float = 600.0  # bounds waiting for min_devices, and a simulated round (its wall time is not the clock's)
    # FedAvgM: the server keeps a momentum of each tensor's aggregated update, moved only in rounds where some device
    # trained that tensor (null: off, the plain masked average). server_lr scales the step the momentum takes.
    # Off by default: it steadies the global model but costs the personalized mean (docs/results.md, "Server
    # momentum, measured")
    server_momentum: float | None = None
    server_lr: float = 1.0  # with server_momentum: each tensor moves by server_lr times its momentum
    # the precision a device's momentum is saved in between its rounds (float16 | float32): float16 halves a
    # thousand devices' state on disk and is restored to float32 when the device trains again; paired seeds found
    # no accuracy cost (docs/results.md, "Scale")
    state_precision: str = "float16"
    # how the model's float tensors cross the network (float32 | float16): float16 halves what a round moves both
    # ways (up, each tensor's change from the model sent), decoded at the boundary.
    # float16 by default: at the same deadline, paired seeds found the encoding level with float32 (docs/results.md,
    # "Compact transfers"); float32 for a byte-exact comparison with older runs
    transfer: str = "float16"

    RULES: Rules = {
        "strategy": (lambda v: v in STRATEGIES, "one of " + ", ".join(STRATEGIES)),
        "rounds": (lambda v: v >= 1, "an integer >= 1"),
        "time_budget_s": (lambda v: v is None or v > 0, "a number of simulated seconds > 0 or null (rounds only)"),
        "local_steps": (lambda v: v >= 1, "an integer >= 1"),
        "deadline_s": (lambda v: v is None or v > 0, "a number of seconds > 0 or null (automatic)"),
        "deadline_factor": (lambda v: v > 0, "a number > 0"),
        "devices_per_round": (lambda v: v is None or v >= 1, "an integer >= 1 or null (all connected)"),
        "timeout_s": (lambda v: v > 0, "a number > 0"),
        "server_momentum": (lambda v: v is None or 0 <= v < 1, "a number in [0, 1) (e.g. 0.9), or null (off)"),
        "server_lr": (lambda v: 0 < v <= 10, "a number in (0, 10]"),
        "state_precision": (lambda v: v in STATE_PRECISIONS, "float16 or float32"),
        "transfer": (lambda v: v in TRANSFERS, " or ".join(TRANSFERS)),
    }


@dataclass
class ElasticConfig:
    """How a device picks its tensors each round: when it probes importance, FedEL's window and blending."""

    importance_interval: int = 2  # re-probe local importance every this many rounds (DP runs every round)
    # skip a due probe that costs more than the round must shed (a device whose budget covers nearly everything);
    # false: probe whenever due, as ElasticTrainer does (docs/results.md, "The probe rule, measured")
    probe_only_when_it_pays: bool = True
    # skip a due probe that leaves less of the deadline than the device's cheapest round (its floor): the probe
    # would stretch the round past the deadline, and every device waits for the slowest (docs/results.md, "A probe
    # that does not fit the deadline")
    probe_only_when_it_fits: bool = True
    # FedEL sliding block window with rollback (fleet strategy only); off by default: it never lifted the
    # benchmark's accuracy (docs/results.md)
    window: bool = False
    window_blocks: int = 2  # blocks inside the window
    window_schedule: str = "rollback"  # rollback: slide to the input, jump back to the output; pingpong: walk back
    window_mode: str = (
        "cover"  # cover: as many window tensors as fit, then the most important anywhere; only: the DP stays inside
    )
    window_fit: bool = True  # widen a device's window block by block while training all of it fits its budget
    num_blocks: int = 6  # the model's tensors are cut into this many contiguous blocks
    blend_beta: float | None = 0.6  # I = beta*I_local + (1-beta)*I_global; null disables blending
    min_rho_margin: float = 0.02  # rho is clamped to the device floor plus this

    RULES: Rules = {
        "importance_interval": (lambda v: v >= 1, "an integer >= 1"),
        "window_schedule": (lambda v: v in ("rollback", "pingpong"), "rollback or pingpong"),
        "window_mode": (lambda v: v in ("cover", "only"), "cover or only"),
        "window_blocks": (lambda v: v >= 1, "an integer >= 1"),
        "num_blocks": (lambda v: v >= 1, "an integer >= 1"),
        "blend_beta": (lambda v: v is None or 0 <= v <= 1, "a number in [0, 1] or null"),
        "min_rho_margin": (lambda v: 0 <= v < 0.5, "a number in [0, 0.5)"),
    }


@dataclass
class DevicesConfig:
    """The simulated devices: how many, how fast, on which uplinks, holding which share of the data."""

    num_devices: int = 8  # devices in the fleet, newcomers included (data.device_roots: one per sub-folder)
    # simulation: the last this many devices of the split never take part; after a run they personalize from its
    # final global model (fleet bench pfl: new devices, with their own data and shift)
    newcomers: int = 0
    tiers: list[float] = field(default_factory=lambda: [1.0, 2.0, 3.0, 4.0])  # device i gets tiers[i % len]
    # kinds of simulated devices, each a share of the fleet with its speed, uplink and availability; empty: tiers in
    # turn, bandwidth_bytes_per_s, always online (simulations/fleet.yaml ships three example classes)
    device_classes: list[DeviceClassConfig] = field(default_factory=list)
    bandwidth_bytes_per_s: float = 12.5e6  # uplink of a simulated device (100 Mbit/s Wi-Fi)
    memory_budgets_mb: list[float] = field(
        default_factory=list
    )  # device i: [i % len] MB of activation memory, 0 = unlimited
    # how one shared dataset is split over the devices: iid, dirichlet (each class's samples shared out by
    # Dirichlet(alpha) draws) or shards (2 classes per device); the same split on every device and the server
    partition: str = "dirichlet"
    alpha: float = 0.5  # dirichlet: the smaller, the more skewed a device's label mix (0.1: mostly one or two classes)
    test_fraction: float = 0.2  # each device's held-out split for personalized accuracy
    samples_per_device: int | None = None  # cap a device's data (keeps simulations small)
    # devices whose inputs differ, not only their label mix: each simulated device's images (and optionally
    # labels) go through its own fixed transform, in training and in its held-out split alike (fleet/data/shift.py)
    shift: ShiftConfig = field(default_factory=ShiftConfig)

    RULES: Rules = {
        "num_devices": (lambda v: v >= 1, "an integer >= 1"),
        "newcomers": (lambda v: v >= 0, "an integer >= 0 (devices that never take part)"),
        "tiers": (lambda v: len(v) >= 1 and all(t >= 1 for t in v), "a non-empty list of slow-down factors >= 1"),
        "bandwidth_bytes_per_s": (lambda v: v > 0, "a number > 0"),
        "memory_budgets_mb": (
            lambda v: all(b >= 0 for b in v),
            "a list of MB per device in turn (0 = unlimited), e.g. [0, 40]",
        ),
        "partition": (lambda v: v in PARTITIONS, "one of " + ", ".join(PARTITIONS)),
        "alpha": (lambda v: v > 0, "a number > 0"),
        "test_fraction": (lambda v: 0 < v < 1, "a number in (0, 1)"),
        "samples_per_device": (lambda v: v is None or v >= 4, "an integer >= 4 or null"),
    }

    @property
    def taking_part(self) -> int:
        """Devices that take part in the run: every one but the newcomers."""
        return self.num_devices - self.newcomers


@dataclass
class SimulationConfig:
    """Flower's simulation engine on Ray: where it runs and what each ClientApp gets."""

    # simulation on an existing Ray cluster (host:port of its head, as `ray start --head` prints it); every
    # machine of the cluster needs this repo and its venv at the same path, and the data. null: a local Ray
    ray_address: str | None = None
    client_cpus: float = 1.0  # simulation: CPUs reserved per ClientApp
    client_threads: int = 1  # torch threads inside a ClientApp (deployed ones too)
    # simulation: share of a GPU reserved per ClientApp (0.25: four devices on one GPU). Ray hides the GPU from a
    # ClientApp that reserves none, so a simulation with train.device cuda needs a share > 0
    client_gpus: float = 0.0

    RULES: Rules = {
        "ray_address": (
            lambda v: v is None or RAY_ADDRESS.fullmatch(v) is not None,
            "the Ray head's host:port, as `ray start --head` prints it (e.g. 192.168.1.10:6379), or null (a local Ray)",
        ),
        "client_cpus": (lambda v: v > 0, "a number > 0"),
        "client_threads": (lambda v: v >= 1, "an integer >= 1"),
        "client_gpus": (lambda v: 0 <= v <= 1 or v == int(v), "a share of one GPU from 0 to 1, or a whole number"),
    }


@dataclass
class MembershipConfig:
    """Open membership (deployment): devices come and go; the fleet never waits on one that is gone."""

    min_devices: int | None = None  # start once this many devices are connected; null: num_devices less newcomers
    # a deployed round closes at deadline + its devices' learned round-trip overhead + grace_s: slack on what was
    # measured, and before anything was (a ClientApp's first start, 5-15 s on a Pi, is learned from its first reply)
    grace_s: float = 30.0
    max_missed: int = 2  # after this many missed rounds in a row a device is benched until it answers a query

    RULES: Rules = {
        "min_devices": (lambda v: v is None or v >= 1, "an integer >= 1 or null (devices.num_devices)"),
        "grace_s": (lambda v: 0 < v <= 3600, "a number of seconds in (0, 3600]"),
        "max_missed": (lambda v: v >= 1, "an integer >= 1"),
    }


@dataclass
class RobustConfig:
    """Robust aggregation: every reply is untrusted, so no single device can move the model or the clocks far."""

    # mean | trimmed_mean | median | centered_clip, per tensor over the devices that trained it; trimmed_mean by
    # default: one device's scaled update cannot carry the tensor with it, as it carries a mean (docs/results.md,
    # robustness)
    aggregation: str = "trimmed_mean"
    trim_fraction: float = 0.25  # trimmed_mean: drop this share of the values at each end, per coordinate
    # an update's norm may be this multiple of the median norm per tensor (else clipped to it), and a device's
    # whole update this multiple of the others' on the tensors they share (else scaled to their size); null: off
    norm_bound: float | None = 3.0
    norm_action: str = "clip"  # clip (scale it down to the bound) or reject the reply
    # a device whose update pulls against the others' median by more than this many typical update lengths (median
    # over the tensors it shares with at least 3 others) is rejected whole: the only guard for tensors that
    # attackers alone trained (docs/results.md: the measured ranges); null: off
    min_pull: float | None = -0.5
    # ... and one whose update's cosine with the global model's last step (median over the tensors it sent) is below
    # this, however small (IPM, mask abuse); an honest non-IID device can dip below it in one round, hence the
    # strikes below (docs/results.md has the measured ranges); null: off
    min_cos: float | None = -0.3
    # ... and one whose share of rising coordinates is this far from the others' (ALIE, Min-Max); each large weight
    # but the classifier is held to it on its own too, and left out of the reply past it (Min-Max on those); null: off
    max_sign_skew: float | None = 0.2
    # a device below min_pull or min_cos by at most twice the floor is rejected only on its strikes-th such round
    # within strike_window rounds; before that its update is kept at half its length: one round's direction does not
    # tell a non-IID honest device from an attacker, a direction that repeats does (1: rejected at once)
    strikes: int = 3
    strike_window: int = 4  # rounds a strike is remembered: 3 in 4 rejects; fewer wrong rounds each count half
    # a tensor's bound follows its typical update norm of earlier rounds, which may grow by at most this factor a
    # round: where only attackers (or one honest device) trained a tensor, its senders cannot set their own bound
    norm_growth: float | None = 1.25
    # judge each reply on the server's own clean data (a sample of what it pretrained on, held out from every device):
    # start = by the loss a tenth of its step adds (Zeno); trust = by its direction against the server's own step, its
    # mean over the rounds (FLTrust's cosine, over rounds); null: off (a deployed server holds no data; on the
    # robustness bench start rejected an honest device, trust an honest device in 4 of 8 attack runs: docs/results.md)
    validate: str | None = None
    # a reply whose loss rise on that data exceeds the fleet's median rise by more than this (nats) is rejected
    max_loss_rise: float = 0.2
    # FoolsGold: each device's update scaled by how unlike every other device its updates have been over the rounds
    # (sybils that share a goal, such as flipped labels or a backdoor, send alike updates round after round; honest
    # non-IID devices differ); off: on the robustness bench it weighed honest pairs down and missed the colluders
    # (docs/results.md, "FoolsGold's weights")
    similarity: bool = False
    max_samples_per_device: int = 100_000  # cap on a reply's sample weight (simulation: the device's data size)
    time_band: float = 4.0  # a reported full-round time is clamped to [known / band, known * band]

    RULES: Rules = {
        "aggregation": (lambda v: v in AGGREGATIONS, "one of " + ", ".join(AGGREGATIONS)),
        "trim_fraction": (lambda v: 0 <= v < 0.5, "a number in [0, 0.5)"),
        "norm_bound": (lambda v: v is None or v >= 1, "a multiple >= 1 of the median update norm, or null"),
        "norm_action": (lambda v: v in NORM_ACTIONS, "clip or reject"),
        "min_pull": (lambda v: v is None or v <= 0, "a number <= 0 (typical update lengths), or null"),
        "strikes": (lambda v: v >= 1, "an integer >= 1 (1: rejected at once)"),
        "strike_window": (lambda v: v >= 1, "an integer >= 1 (rounds)"),
        "min_cos": (lambda v: v is None or -1 <= v <= 0, "a cosine in [-1, 0], or null"),
        "max_sign_skew": (lambda v: v is None or 0 < v <= 1, "a share in (0, 1], or null"),
        "norm_growth": (lambda v: v is None or v >= 1, "a factor >= 1, or null"),
        "validate": (lambda v: v in VALIDATIONS, "start, trust or null"),
        "max_loss_rise": (lambda v: v > 0, "a loss difference > 0 (nats)"),
        "max_samples_per_device": (lambda v: v >= 1, "an integer >= 1"),
        "time_band": (lambda v: v >= 1, "a factor >= 1"),
    }


@dataclass
class PersonalizationConfig:
    """What each device keeps for itself, and how its personal model is made."""

    # tensors each device keeps for itself, never sent nor averaged: none | head (FedPer) | norms (FedBN) | head+norms
    policy: str = "none"
    # how a device makes its personal model in a round, under any strategy (docs/algorithms.md, "Personal models"):
    # none (the model it trained), ditto (a second model pulled toward the global one), fedrep (its head first, then
    # the shared body; needs a personal head), fedala (the global model merged into its own by learned weights
    # before training), apfl (a second model mixed with the shared one by a learned alpha)
    method: str = "none"
    ditto_lambda: float = 0.1  # Ditto's pull of the personal model toward the global model (0: plain local training)
    # which tensors Ditto's personal model trains in an elastic round: same (the shared update's selection) or own
    # (its own selection by the same importance, within what the shared update leaves of the budget; it is never
    # sent, so it pays no upload and may take the upload-heavy output-side tensors the shared update cannot)
    personal_selection: str = "same"
    head_steps: int | None = None  # fedrep: steps on the head before the body's; null: federation.local_steps (FedRep)
    ala_tensors: int = 2  # fedala: the last this many tensors are merged by learned weights (FedALA's p; 2: the head)
    ala_fraction: float = 0.8  # fedala: share of the device's data the merge weights learn on (FedALA's s: 80%)
    apfl_alpha: float = 0.5  # apfl: the starting share of the personal model in the mix (then learned each step)
    # before a device is evaluated it fine-tunes a copy of the global model for this many local steps (elastic, within
    # the same share of the deadline a round's steps get; its simulated time goes on the clock); 0: no fine-tuning
    finetune_steps: int = 0

    RULES: Rules = {
        "policy": (lambda v: v in PERSONAL_POLICIES, "one of " + ", ".join(PERSONAL_POLICIES)),
        "method": (lambda v: v in PERSONAL_METHODS, "one of " + ", ".join(PERSONAL_METHODS)),
        "head_steps": (lambda v: v is None or v >= 1, "an integer >= 1, or null (federation.local_steps)"),
        "personal_selection": (lambda v: v in ("same", "own"), "same or own"),
        "ala_tensors": (lambda v: v >= 1, "an integer >= 1 (the last tensors of the model)"),
        "ala_fraction": (lambda v: 0 < v <= 1, "a share in (0, 1]"),
        "apfl_alpha": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        "ditto_lambda": (lambda v: v >= 0, "a number >= 0 (0: the personal model trains freely)"),
        "finetune_steps": (lambda v: v >= 0, "an integer >= 0 (local steps; 0: no fine-tuning)"),
    }


@dataclass
class EvaluationConfig:
    """Evaluation is a round trip to every evaluated device: at hundreds of devices, ask fewer, less often."""

    every: int = 1  # evaluate every this many rounds (and always the run's last round)
    devices: int | None = None  # evaluate a seeded sample of this many of the round's trained devices; null: all
    # evaluate every connected member, not only the round's trained devices: with devices_per_round a sample, the
    # fleet's personalized figures then cover every device, as pFL benchmarks score (fleet bench pfl)
    all_devices: bool = False
    # also score the global model each round on the data's test split held by the server (data.test_per_class per
    # class; no device's data): balanced and low-noise, where the devices' small skewed splits are not. A deployed
    # server usually holds no data, hence off by default
    server_test: bool = False
    # score each round's global model on the next round's trainers, in their train message, before they train:
    # no evaluation wave, and no second download of the model a round (45 MB to each evaluated device for a
    # ResNet-18). The round's record is written once those scores are in; the run's last round still evaluates
    # in a wave of its own. The trainers of the next round score it, whatever evaluation.devices says. null: on
    # where devices are deployed (each message costs a device its start and a download), off in simulation (a
    # wave costs a simulated device nothing it does not model) and wherever every member is scored
    # (evaluation.all_devices) or fine-tunes first (personalization.finetune_steps), which a score riding on
    # training cannot give
    pipelined: bool | None = None

    RULES: Rules = {
        "every": (lambda v: v >= 1, "an integer >= 1 (rounds)"),
        "devices": (lambda v: v is None or v >= 1, "an integer >= 1, or null (every trained device)"),
    }


@dataclass
class StartConfig:
    """The fleet's starting model (benches): pretrained on samples held out from every device."""

    samples: int = 0  # samples held out from the devices to pretrain the start model (0: start as model.weights)
    epochs: int = 2  # passes over the held-out samples when pretraining the start model
    classes: list[int] | None = None  # pretrain only on these labels (a start from other classes); null: all

    RULES: Rules = {
        "samples": (lambda v: v >= 0, "an integer >= 0"),
        "epochs": (lambda v: v >= 1, "an integer >= 1"),
        "classes": LABELS_RULE,
    }


@dataclass
class FleetConfig(ExperimentConfig):
    """A fleet: the experiment's model, data and training, plus one section per part of the federation."""

    name: str = "fleet"  # the run's folder under output_dir (runs/<name>/: metrics, plots, checkpoint, devices' state)
    federation: FederationConfig = field(default_factory=FederationConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    robust: RobustConfig = field(default_factory=RobustConfig)
    personalization: PersonalizationConfig = field(default_factory=PersonalizationConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    start: StartConfig = field(default_factory=StartConfig)


C = TypeVar("C", bound=FleetConfig)
# Sections of a fleet YAML that a tool above the core owns, reads and checks with its own extension of
# FleetConfig: ``testbed``, the emulated devices of ``fleet testbed`` (fleet/testbed/config.py). The core's
# loader leaves them out, so one file serves that tool and the apps it starts.
SECTIONS_ABOVE = ("testbed",)

SECTIONS = tuple(
    f.name
    for f in dataclasses.fields(FleetConfig)
    if f.name not in {f.name for f in dataclasses.fields(ExperimentConfig)}
)

# The federation section was one flat list of 54 fields; each moved field names its new place when it is used.
_FEDERATION_MOVED: dict[str, str] = {
    **{
        f: f"elastic.{f}"
        for f in (
            "importance_interval",
            "probe_only_when_it_pays",
            "window",
            "window_blocks",
            "window_schedule",
            "window_mode",
            "window_fit",
            "num_blocks",
            "blend_beta",
            "min_rho_margin",
        )
    },
    **{
        f: f"devices.{f}"
        for f in (
            "num_devices",
            "newcomers",
            "tiers",
            "device_classes",
            "bandwidth_bytes_per_s",
            "memory_budgets_mb",
            "partition",
            "alpha",
            "test_fraction",
            "samples_per_device",
            "shift",
        )
    },
    **{f: f"simulation.{f}" for f in ("ray_address", "client_cpus", "client_threads")},
    **{f: f"membership.{f}" for f in ("min_devices", "grace_s", "max_missed")},
    **{
        f: f"robust.{f}"
        for f in (
            "aggregation",
            "trim_fraction",
            "norm_bound",
            "norm_action",
            "min_pull",
            "max_samples_per_device",
            "time_band",
        )
    },
    "personal": "personalization.policy",
    "ditto_lambda": "personalization.ditto_lambda",
    "finetune_steps": "personalization.finetune_steps",
    "eval_every": "evaluation.every",
    "eval_devices": "evaluation.devices",
    "server_eval": "evaluation.server_test",
    "pretrained_samples": "start.samples",
    "pretrain_epochs": "start.epochs",
    "pretrain_classes": "start.classes",
}
MOVED: dict[str, str] = {**ENGINE_MOVED, **{f"federation.{old}": new for old, new in _FEDERATION_MOVED.items()}}


def _check_rules(cfg: FleetConfig) -> None:
    """Checks that span sections; each field's own rule is checked as the section is built."""
    dev, el = cfg.devices, cfg.elastic
    check_classes(dev.device_classes)
    _check_shift(cfg)
    if dev.newcomers >= dev.num_devices:
        raise ConfigError(
            f"devices.newcomers: {dev.newcomers} leaves none of the {dev.num_devices} devices to take part; "
            "use fewer than devices.num_devices"
        )
    if cfg.personalization.method == "fedrep" and cfg.personalization.policy not in ("head", "head+norms"):
        raise ConfigError(
            f"personalization.method: fedrep trains a personal head, but personalization.policy is "
            f"{cfg.personalization.policy!r}; use policy head or head+norms"
        )
    if cfg.federation.strategy == "ditto" and cfg.personalization.method not in ("none", "ditto"):
        raise ConfigError(
            f"personalization.method: {cfg.personalization.method} cannot run beside the ditto strategy (naive "
            "selection with Ditto's personal model); use federation.strategy naive or fleet with this method"
        )
    _check_pipelined(cfg)
    if el.window_blocks > el.num_blocks:
        raise ConfigError(
            f"elastic.window_blocks: {el.window_blocks} exceeds elastic.num_blocks={el.num_blocks}; "
            "use a window no larger than the number of blocks"
        )
    if cfg.start.classes is not None and max(cfg.start.classes) >= cfg.model.num_classes:
        raise ConfigError(
            f"start.classes: label {max(cfg.start.classes)} is not below "
            f"model.num_classes={cfg.model.num_classes}; "
            "use labels of the model's classes"
        )


def compute_steps(cfg: FleetConfig) -> int:
    """Training steps a round costs a device: Ditto trains two models, the shared update and the device's
    personal model, ``local_steps`` each, and its elastic budget covers both."""
    fed = cfg.federation
    return fed.local_steps * models_of(method_of(fed.strategy, cfg.personalization.method))


def pipelined(cfg: FleetConfig, simulated: bool) -> bool:
    """Whether a round's evaluation rides on the next round's training: evaluation.pipelined, or where it is
    null, whether the devices are deployed and can give what a riding score gives."""
    if cfg.evaluation.pipelined is not None:
        return cfg.evaluation.pipelined
    return not (simulated or cfg.evaluation.all_devices or cfg.personalization.finetune_steps)


def _check_pipelined(cfg: FleetConfig) -> None:
    """What a score riding on the next round's training cannot give: every member's score, a fine-tuned one."""
    if not cfg.evaluation.pipelined:
        return
    if cfg.evaluation.all_devices:
        raise ConfigError(
            "evaluation.pipelined: only the next round's trainers score the model, not every member "
            "(evaluation.all_devices); turn one of them off"
        )
    if cfg.personalization.finetune_steps:
        raise ConfigError(
            "evaluation.pipelined: a device scores the model it received before training, with no fine-tuning "
            "(personalization.finetune_steps); turn one of them off"
        )


def _check_shift(cfg: FleetConfig) -> None:
    """The shift's own fields, and whether the data can take it: it transforms slices of a shared dataset."""
    check_shift(cfg.devices.shift, "devices.shift", cfg.model.in_channels)
    if cfg.data.shift.active:
        raise ConfigError(
            "data.shift: a fleet gives each device its own domain with devices.shift; move the shift there"
        )
    if cfg.devices.shift.active and cfg.data.device_roots is not None:
        raise ConfigError(
            "devices.shift: the devices read their own folders (data.device_roots), which are already their own "
            "domains; drop devices.shift, or simulate with a shared dataset split across devices"
        )


def fleet_config_from_dict(data: dict | None, overrides: dict[str, Any] | None = None, cls: type[C] = FleetConfig) -> C:
    """``cls`` (a FleetConfig, or a tool's extension of it) from a raw mapping, every field and rule checked.
    A section of :data:`SECTIONS_ABOVE` that ``cls`` does not have is left out: its tool reads and checks it."""
    data = apply_overrides(dict(data or {}), overrides or {})
    check_moved(data, MOVED)
    own = {f.name for f in dataclasses.fields(cls)}
    data = {k: v for k, v in data.items() if k in own or k not in SECTIONS_ABOVE}
    cfg = build_dataclass(cls, data, "")
    _check_rules(cfg)
    return cfg


def load_fleet_config(
    path: str | Path | None, overrides: dict[str, Any] | None = None, cls: type[C] = FleetConfig
) -> C:
    data = read_yaml_mapping(resolve_path(path), shown=path) if path is not None else {}
    check_moved(data, MOVED, path)
    return fleet_config_from_dict(data, overrides, cls)


_FROM_RUN_CONFIG: dict[tuple, FleetConfig] = {}  # a simulation worker reads the same run config for every message


def config_from_run_config(run_config: dict[str, Any]) -> FleetConfig:
    """The run's config, parsed once per process for the same run config and unchanged file (see
    :func:`parse_run_config`). Nothing may change the returned config: it is shared."""
    path = run_config.get("config") or None
    stat = None
    if path is not None:
        try:
            st = resolve_path(str(path)).stat()
            stat = (st.st_mtime_ns, st.st_size)
        except OSError:
            stat = None  # parse_run_config names the missing file
    if stat is None:
        return parse_run_config(run_config)
    key = (tuple(sorted((k, repr(v)) for k, v in run_config.items())), stat)
    if key not in _FROM_RUN_CONFIG:
        _FROM_RUN_CONFIG.clear()
        _FROM_RUN_CONFIG[key] = parse_run_config(run_config)
    return _FROM_RUN_CONFIG[key]


def parse_run_config(run_config: dict[str, Any]) -> FleetConfig:
    """Flower's run config (``[tool.flwr.app.config]`` plus ``--run-config``) to a validated config.

    ``config`` names the YAML file; every other key is a dotted override
    (``federation.rounds``), so ``flwr run . --run-config "federation.rounds=3"`` works.
    """
    overrides = {k: v for k, v in run_config.items() if k not in RUN_ONLY_KEYS and v != ""}
    path = run_config.get("config") or None
    return load_fleet_config(path, overrides)


def run_dir(cfg: FleetConfig) -> Path:
    out = Path(cfg.output_dir).expanduser()
    if not out.is_absolute():
        out = Path.cwd() / out
    return out / cfg.name

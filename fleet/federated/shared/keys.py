"""The message protocol between the server and a device: one name per key.

The server and the devices are different programs, and in deployment different
machines and versions; a key spelled two ways fails silently (a ``.get`` that
never finds its value). Every record and metric key is therefore named here once,
and client/, server/ and the tracking use these names, never string literals.
"""

from __future__ import annotations

# --- records inside a Message's RecordDict ----------------------------------------------
ARRAYS = "arrays"  # ArrayRecord: the global model (to a device), the trained tensors (from it), packed
PACKING = "packing"  # ConfigRecord: how ARRAYS' buffers hold the tensors (fleet.federated.shared.packing's index)
CONFIG = "config"  # ConfigRecord: what the server asks of the round
METRICS = "metrics"  # MetricRecord: what the device reports
DEVICE = "device"  # ConfigRecord in a query reply: who the device says it is (MetricRecords hold numbers only)

# --- server -> device (ConfigRecord) -----------------------------------------------------
SERVER_ROUND = "server-round"  # set by Flower's FedAvg in every train and evaluate message
STRATEGY = "strategy"  # fleet | naive | fedavg
DEADLINE_S = "deadline-s"  # the round deadline in seconds; 0: train fully
RUN_TAG = "run-tag"  # a device's saved state from another run is ignored
GLOBAL_IMPORTANCE_NAMES = "gi-names"  # the server's global importance signal, per tensor name ...
GLOBAL_IMPORTANCE_VALUES = "gi-values"  # ... and its values, in the same order
SCORE_RECEIVED = "score-received"  # score the model received before training it (evaluation.pipelined)

# --- device -> server (ConfigRecord ``DEVICE`` of a query reply) ----------------------------
DEVICE_NAME = "device-name"  # the name the device goes by in metrics, plots and its state dir

# --- device -> server (MetricRecord) -----------------------------------------------------
PARTITION_ID = "partition-id"  # the device's slice of a shared dataset (simulation-style split only)
ROUNDS_TRAINED = "rounds-trained"  # rounds this device has trained in this run, counted in its saved state
NUM_EXAMPLES = "num-examples"  # samples behind a reply: the aggregation weight
TIER = "tier"  # the device's slow-down factor against its profile
FULL_TIME_S = "full-time-s"  # seconds one round's local work takes when training every tensor
MIN_RHO = "min-rho"  # the device's floor: a forward pass over a full step
SELECTED = "selected"  # shared tensors trained this round: exactly the trainable tensors the reply carries
PERSONAL_SELECTED = "personal-selected"  # personal tensors trained this round (personalization.policy; never sent)
NUM_TENSORS = "num-tensors"  # trainable tensors in the model
TRAINED_FRACTION = "trained-fraction"  # share of the weights trained
RHO = "rho"  # predicted step time over a full step's
PREDICTED_TIME_S = "predicted-time-s"  # the timing model's figure for the round (the simulated clock)
MEASURED_TIME_S = "measured-time-s"  # wall time of the round's training on the host
SPEEDUP = "speedup"  # full-training time over predicted time
BYTES_UPLOADED = "bytes-uploaded"  # bytes of the tensors in the reply
LOSS = "loss"  # mean training loss of the round
STEPS = "steps"  # local steps trained
MEMORY_BUDGET_BYTES = "memory-budget-bytes"  # activation memory budget (only under one)
MEMORY_PEAK_BYTES = "memory-peak-bytes"  # measured activation peak (only under a budget)
MEMORY_ADDED_S = "memory-added-s"  # seconds the memory plan adds per step (only under a budget)
CUDA = "cuda"  # 1: the device trained on a CUDA GPU (only then; a reply without it trained on the CPU)
GLOBAL_ACCURACY = "global-accuracy"  # the global model on the device's held-out split
PERSONAL_ACCURACY = "personal-accuracy"  # the device's personalized model on the same split
FINETUNED_ACCURACY = "finetuned-accuracy"  # the global model after personalization.finetune_steps local steps
FINETUNE_TIME_S = "finetune-time-s"  # simulated seconds that fine-tuning took on the device (its clock)
# seconds from the start of the device's ClientApp process to the start of its work (Flower's process start,
# the imports, its data and model): what each message costs it before training or evaluating
READY_S = "ready-s"
EVAL_TIME_S = "eval-time-s"  # wall time of the evaluation on the host (the scale bench's overhead ratio)
# wall time of scoring the personalized model as its training ends: evaluation work a train reply carries
SCORE_TIME_S = "score-time-s"
# a train reply's score of the model it received (evaluation.pipelined): its held-out split's size; the scores are
# GLOBAL_ACCURACY and PERSONAL_ACCURACY, and EVAL_TIME_S the scoring's wall time
TEST_EXAMPLES = "test-examples"

# --- operator -> device: a SuperNode's --node-config ---------------------------------------
NODE_PARTITION_ID = "partition-id"  # which slice of the shared dataset this device trains on (simulation-style)
NODE_DATA_ROOT = "data-root"  # the device's own images: it trains on these instead of a shared dataset's slice
NODE_DEVICE_NAME = "device-name"  # the device's name; default: device-<partition-id>, else the host name
NODE_TIER = "tier"  # slow-down factor against the profile (simulated tiers); default: devices.tiers
NODE_PROFILE = "profile"  # the device's own profile YAML (else hardware.profile, else measured once)
NODE_MEMORY_BUDGET_MB = "memory-budget-mb"  # activation memory budget
NODE_SPILL_DIR = "spill-dir"  # where paged-out activations go
NODE_STATE_DIR = "state-dir"  # where state that outlives a round is kept
NODE_UPLINK_MBPS = "uplink-mbps"  # the device's uplink: it plans its upload at this rate; default: the fleet's
NODE_DEVICE = "device"  # where the device trains: auto, cpu or cuda; default: train.device
NODE_THREADS = "threads"  # torch threads of the device's ClientApp (its cores); default: simulation.client_threads

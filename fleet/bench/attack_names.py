"""The robustness bench's attacks by name, with what each does: the CLI lists them without importing
torch or Flower (fleet/bench/adversary_app.py carries them out)."""

ATTACKS = (
    "huge_samples",  # the reply claims 1e12 samples: one device outweighs the fleet in a sample-weighted mean
    "scaled_update",  # the weights' update (reply - received global) times 1e3
    "sign_flip",  # the weights' update times -10: gradient ascent, amplified
    "random_weights",  # every uploaded float tensor replaced by noise of its own scale
    "bn_poison",  # BatchNorm running_var -1 (a negative variance) and running_mean 1e6
    "metric_poison",  # absurd train metrics (clocks, bytes, loss, trained fraction) and evaluate accuracies
    "all_tensors",  # uploads every tensor (received + small noise) while claiming one trained tensor and few bytes
    "alie",  # the honest mean minus one standard deviation per coordinate (fleet.bench.attacks)
    "ipm_0.1",  # -0.1 x the honest mean
    "ipm_1",  # -1 x the honest mean
    "min_max",  # the honest mean moved along -std as far as the honest spread hides it
    "label_flip",  # honest training on labels C - 1 - y
    "backdoor",  # half its samples carry a pixel patch labelled class 0; the update boosted to under the bound
    "mask_abuse",  # claims only the tensors the fewest honest devices trained; reversed and enlarged there
    "min_max_unsampled",  # Min-Max everywhere but the coordinates a reader of the code takes to be judged
    "alie_large",  # ALIE on the largest tensors (80% of the values), the many small ones honest
    "min_max_unheld",  # Min-Max on the large tensors not judged on their own sign skew: classifier, norm vectors
)
# need the honest updates (spied)
KNOWING = (
    "alie",
    "ipm_0.1",
    "ipm_1",
    "min_max",
    "backdoor",
    "mask_abuse",
    "min_max_unsampled",
    "alie_large",
    "min_max_unheld",
)
DATA_ATTACKS = ("label_flip", "backdoor")  # train on altered data
# the attacks with a strength to search in adaptive mode (--adaptive; fleet.bench.edge); Min-Max's and IPM's other
# scale are left out: at a searched strength Min-Max is ALIE (the honest mean along minus the honest spread), and
# ipm_0.1 is ipm_1
ADAPTIVE = ("alie", "ipm_1", "alie_large", "min_max_unsampled", "min_max_unheld", "backdoor", "mask_abuse")

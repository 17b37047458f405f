#!/usr/bin/env bash
# The main job: install (first time), then simulate the default fleet (simulations/fleet.yaml):
# 8 devices in 4 speed tiers personalizing a pretrained ResNet-18 on non-IID Fashion-MNIST.
# Extra arguments go to `fleet simulate` (e.g. --rounds 5, --strategy fedavg).
set -euo pipefail
export PYTHONUNBUFFERED=1  # progress lines show at once, also through a pipe
cd "$(dirname "$0")"
bash scripts/install.sh
. .venv/bin/activate
exec fleet simulate "$@"

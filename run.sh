#!/usr/bin/env bash
# The main job: install (first time), then personalize a pretrained model on a real dataset with every method.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install.sh
. .venv/bin/activate
exec fleet personalize "$@"

#!/usr/bin/env bash
# fleet on a CUDA GPU, in one command (docs/gpu.md): a profile measured on the GPU, the timing model's
# error and the speedup at rho 0.5 against it, a memory plan at 50% of the unconstrained peak, and a
# 4-device simulation whose devices train on the GPU. About 8 minutes on one GPU.
# On a machine without a CUDA GPU it stops at once with one line.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || { echo "gpu-check: $PY not found; run scripts/install.sh first (or set PYTHON)" >&2; exit 2; }
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu-check: no CUDA GPU here (torch.cuda.is_available() is False); run it on a machine with one" >&2
  exit 2
fi
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
fleet() { "$PY" -m fleet.cli "$@"; }
step() { echo; echo "== $* =="; }

"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "on", torch.cuda.get_device_name(0))'
MODEL=(--model resnet18 --batch-size 32 --input-size 32 --in-channels 3 --num-classes 10)

step "fleet profile (resnet18, batch 32, input 32, cuda)"
fleet profile "${MODEL[@]}" --device cuda --out "$OUT/resnet18-cuda.yaml"

step "fleet bench timing (against that profile)"
fleet bench timing --profile "$OUT/resnet18-cuda.yaml" --device cuda --repeats 15

step "fleet profile and fleet bench timing for mobilenet_v2 (the timing target covers both models)"
fleet profile --model mobilenet_v2 --batch-size 32 --input-size 32 --in-channels 3 --num-classes 10 \
  --device cuda --out "$OUT/mobilenet_v2-cuda.yaml"
fleet bench timing --profile "$OUT/mobilenet_v2-cuda.yaml" --device cuda --repeats 15

step "fleet bench speedup at rho 0.5"
fleet bench speedup --profile "$OUT/resnet18-cuda.yaml" --device cuda --rho 0.5 --repeats 15

step "fleet bench memory at 50% of the unconstrained peak, on the GPU (pages to pinned host memory)"
fleet bench memory "${MODEL[@]}" --budget-fraction 0.5 --device cuda --repeats 15

step "fleet simulate: 4 devices training on the GPU (each profiles itself there once)"
fleet simulate simulations/fleet-tiny.yaml --name gpu-check-simulate --output-dir "$OUT" \
  --set train.device=cuda --set simulation.client_gpus=0.25
echo
echo "gpu-check: done; outputs in $OUT"

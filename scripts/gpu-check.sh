#!/usr/bin/env bash
# fleet on a CUDA GPU, in one command (docs/gpu.md): a profile measured on the GPU, the timing model's
# error and the speedup at rho 0.5 against it, a memory plan at 50% of the unconstrained peak, and a
# 4-device simulation whose devices train on the GPU. About 2.5 minutes on an H200 (129-152 s).
# On a machine without a CUDA GPU it stops at once with one line.
#
# Every step runs even when one before it failed, so a short GPU window reports all it can; the
# script ends with one verdict line per target and exits 1 when a step failed or a target was missed.
# GPU_CHECK_DEVICE=cpu runs the same steps on the CPU: a dry run of the script itself, not a check.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
# A GPU step of these models takes milliseconds and is bound by the host's kernel launches, whose speed
# drifts between the profile and the bench: many cheap repeats keep the medians steady (docs/gpu.md).
REPEATS=${REPEATS:-31}               # timed steps per variant in the benches
PROFILE_REPEATS=${PROFILE_REPEATS:-21}  # repeats per profiler measurement
[ -x "$PY" ] || command -v "$PY" >/dev/null || {
  echo "gpu-check: $PY not found; run scripts/install.sh first (or set PYTHON)" >&2
  exit 2
}
if [ "$DEVICE" = cuda ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu-check: no CUDA GPU here (torch.cuda.is_available() is False); run it on a machine with one" >&2
  exit 2
fi
OUT=${GPU_CHECK_OUT:-runs/gpu-check}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}  # seconds a step may take before it is stopped and counted as failed
mkdir -p "$OUT"
rm -f "$OUT"/*.json
export PYTHONUNBUFFERED=1
FLEET=("$PY" -m fleet.cli)
FAILED=()
# step NAME JSON CMD...: print a header, run CMD (into the file JSON with --json, then print it; "-" for
# none) under the step timeout, and remember NAME when it fails.
step() {
  local name=$1 json=$2 t0=$SECONDS
  shift 2
  echo
  echo "== $name =="
  if [ "$json" = - ]; then
    timeout -k 10 "$STEP_TIMEOUT" "$@"
  else
    timeout -k 10 "$STEP_TIMEOUT" "$@" --json >"$json" && cat "$json"
  fi || FAILED+=("$name")
  echo "($name: $((SECONDS - t0)) s)"
}

"$PY" -c 'import torch; c = torch.cuda.is_available(); print("torch", torch.__version__, "CUDA", torch.version.cuda, "on", torch.cuda.get_device_name(0) if c else "no GPU")'
SIM_GPUS=0.25
[ "$DEVICE" = cuda ] || SIM_GPUS=0
for model in resnet18 mobilenet_v2; do
  step "fleet profile $model (batch 32, 32x32 RGB, $DEVICE)" - \
    "${FLEET[@]}" profile --model "$model" --batch-size 32 --input-size 32 --in-channels 3 --num-classes 10 \
    --device "$DEVICE" --repeats "$PROFILE_REPEATS" --out "$OUT/$model-$DEVICE.yaml"
  step "fleet bench timing $model (against that profile)" "$OUT/timing-$model.json" \
    "${FLEET[@]}" bench timing --profile "$OUT/$model-$DEVICE.yaml" --device "$DEVICE" --repeats "$REPEATS"
done
step "fleet bench speedup at rho 0.5 (resnet18)" "$OUT/speedup.json" \
  "${FLEET[@]}" bench speedup --profile "$OUT/resnet18-$DEVICE.yaml" --device "$DEVICE" --rho 0.5 --repeats "$REPEATS"
step "fleet bench memory at 50% of the unconstrained peak (pages to pinned host memory on a GPU)" "$OUT/memory.json" \
  "${FLEET[@]}" bench memory --model resnet18 --batch-size 32 --input-size 32 --in-channels 3 --num-classes 10 \
  --budget-fraction 0.5 --device "$DEVICE" --repeats "$REPEATS"
step "fleet simulate: 4 devices training on the $DEVICE (each profiles itself there once)" - \
  "${FLEET[@]}" simulate simulations/fleet-tiny.yaml --name gpu-check-simulate --output-dir "$OUT" \
  --set train.device="$DEVICE" --set simulation.client_gpus="$SIM_GPUS"

echo
echo "== verdicts =="
"$PY" -m fleet.bench.gpu_check "$OUT" || FAILED+=("a target")
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu-check: failed: ${FAILED[*]}; outputs in $OUT"
  exit 1
fi
echo "gpu-check: done, every target met; outputs in $OUT"

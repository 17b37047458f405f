#!/usr/bin/env bash
# Installs fleet and everything it needs into ./.venv (idempotent; fast when nothing changed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
stamp=.venv/.fleet-installed
want="$(uname -m) $(cat pyproject.toml requirements.lock | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "installing fleet into .venv (first time: a few minutes) ..."
  python -m pip install -q "pip==26.3"
  # Every package at the version CI ran (requirements.lock): a newer numpy or torch build moves a round's floats.
  lock=(-c requirements.lock)
  # torch/torchvision pairs that install on CPU-only boxes; pip picks the wheel for this machine.
  case "$(uname -m)" in
    aarch64|arm64) python -m pip install -q "torch==2.9.1" "torchvision==0.24.1" ;;
    *) python -m pip install -q "${lock[@]}" "torch==2.14.1" "torchvision==0.29.1" ;;
  esac
  # An editable install always ends in setuptools' "Editable installation" notice (a warning
  # of its build backend that -q does not hide); it is information only.
  PYTHONWARNINGS="ignore:Editable installation" python -m pip install -q "${lock[@]}" -e '.[test]'
  echo "$want" > "$stamp"
fi
# The default real dataset (Debian's dataset-fashion-mnist); fleet falls back to a clear error without it.
if [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing Debian package dataset-fashion-mnist ..."
  (apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1; }) \
    || echo "warning: could not install dataset-fashion-mnist; tests that need it are skipped" >&2
fi

#!/usr/bin/env bash
# Install (first time), then run the test suite; extra arguments go to pytest (e.g. -m slow).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install.sh
. .venv/bin/activate
exec python -m pytest "$@"

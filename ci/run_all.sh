#!/usr/bin/env bash
# The cookbook's main job (README): install, then execute every notebook end to end with its tiny
# defaults. Executed copies, PNG figures and metrics.json per notebook land in ./outputs (or $1).
# Extra arguments go to ci/run_notebooks.py, e.g. `bash ci/run_all.sh outputs -p TRAIN_ITERS 200`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash ci/setup_env.sh
out="${1:-outputs}"
shift || true
.venv/bin/python ci/run_notebooks.py --out "$out" "$@"

#!/usr/bin/env bash
# Create .venv (Python 3.11) and install the cookbook with its notebook and test extras at the exact versions
# of ci/constraints.txt (pyproject.toml holds the ranges). Idempotent: a second run only checks that everything
# is installed. On a CPU machine torch==2.13.0 resolves to the CPU wheel on disk; on a GPU machine that already
# has torch, use ci/gpu.sh instead (it keeps the machine's torch).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PYTHON="$candidate"; break
    fi
  done
fi
if [ -z "$PYTHON" ]; then
  echo "setup_env: CI's environment is Python 3.11 (ci/constraints.txt was resolved for it); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
# PIPESTATUS: fail on pip's exit code, not grep's (grep only drops this machine's local-index notices).
.venv/bin/python -m pip install --quiet -c ci/constraints.txt -e ".[notebooks,test]" 2>&1 | grep -v "^WARNING: Location" || true
test "${PIPESTATUS[0]}" -eq 0
.venv/bin/python -W ignore -c "import torch, megatron.core, transformers, papermill; print(f'setup_env: torch {torch.__version__}, megatron-core {megatron.core.__version__}, transformers {transformers.__version__}')"

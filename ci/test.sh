#!/usr/bin/env bash
# The cookbook's test command (README): installs what it needs, then runs every test tier that this
# machine supports: unit tests, 2-process Megatron-Core runs, and every notebook through papermill.
# GPU-only tests skip themselves (with the reason) where no CUDA device is present.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash ci/setup_env.sh
# The linter first: a tree that is not clean under ruff (pyproject.toml) fails before the long tiers.
.venv/bin/ruff check .
# --timeout: a hung distributed test fails after 10 minutes instead of eating the CI budget.
set +e
# --durations: where the CI budget (45 minutes on 2 cores) goes, printed at the end of every run.
.venv/bin/python -m pytest tests -q -rs --timeout 600 --durations=25 "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; the suite is broken" >&2
  exit 1
fi
exit "$status"

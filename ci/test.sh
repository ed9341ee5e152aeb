#!/usr/bin/env bash
# The cookbook's test command (README): installs what it needs, then runs every test tier that this
# machine supports: unit tests, 2-process Megatron-Core runs, and every notebook through papermill.
# GPU-only tests skip themselves (with the reason) where no CUDA device is present.
#
# With no arguments the notebooks and the other tiers run as two pytest sessions side by side: most of a
# test's time is a worker's start (a fresh Python importing torch, Megatron-Core and transformers, one core)
# and notebook 08 alone takes ~13 minutes, so on 2 cores the two streams finish well before one would.
# Moving notebook 02 into the tests' stream was tried (CI on 4c60cce): the tests' session then ran 40:19 and
# notebook 08, beside it the whole time, 32.5 min instead of 23.8: 49:17 in all against 45:02. The suite's CPU
# work (~88 core-minutes) is the limit, not the split.
# Each session has its own temporary folder and log; both logs are printed, and the exit status is the
# first failure's. Arguments (e.g. -m "not notebook") run one session with them, as before.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash ci/setup_env.sh
# The linter first: a tree that is not clean under ruff (pyproject.toml) fails before the long tiers.
.venv/bin/ruff check .
# --timeout: a hung distributed test fails after 10 minutes instead of eating the CI budget (notebooks
# carry their own, longer limit). --durations: where the CI budget (45 minutes on 2 cores) goes.
PYTEST=(.venv/bin/python -m pytest tests -q -rs --timeout 600 --durations=25)

check_collected() {  # pytest's 5: it collected no tests, so the suite is broken
  if [ "$1" -eq 5 ]; then
    echo "test.sh: pytest collected no tests ($2); the suite is broken" >&2
    return 1
  fi
  return "$1"
}

set +e
if [ "$#" -gt 0 ]; then
  "${PYTEST[@]}" "$@"
  check_collected $? "$*"
  exit $?
fi
work=$(mktemp -d)
trap 'kill 0 2>/dev/null; rm -rf "$work"' INT TERM
"${PYTEST[@]}" -m notebook --basetemp "$work/notebooks" > "$work/notebooks.log" 2>&1 &
notebooks=$!
"${PYTEST[@]}" -m "not notebook" --basetemp "$work/tests"
tests_status=$?
wait "$notebooks"
notebooks_status=$?
echo "================ notebooks (the second pytest session) ================"
cat "$work/notebooks.log"
rm -rf "$work"
check_collected "$tests_status" "-m 'not notebook'" || exit $?
check_collected "$notebooks_status" "-m notebook" || exit $?
exit 0

#!/usr/bin/env bash
# The cookbook's test command (README): installs what it needs, then runs every test tier that this
# machine supports: unit tests, 2-process Megatron-Core runs, and every notebook through papermill.
# GPU-only tests skip themselves (with the reason) where no CUDA device is present.
#
# Two ends of the supported Megatron-Core range (core/machine/versions.py): everything runs on the default environment,
# .venv (Megatron-Core 0.19 on Python 3.12); the second tier, the tests marked `both_ends` (the compatibility layer's
# patches and the paths that break first on a new release), runs again on .venv-mcore016 (0.16 on Python 3.11), after
# the tests' session; after the notebooks the tests marked `releases` (tests/test_versions.py) move checkpoints and
# runs between the two. `--mcore 0.16 ARGS` runs one session with ARGS on 0.16.
#
# With no arguments the notebooks (with the real-model tests, minutes each too) and the other tiers run as
# two pytest sessions side by side: most of a test's time is a worker's start (a fresh Python importing torch,
# Megatron-Core and transformers, one core), so on 2 cores the two streams finish well before one would.
# The suite's CPU work is the limit, not the split: moving notebook 02 into the tests' stream made CI slower
# (CI on 4c60cce: 49:17 against 45:02); cutting work made it faster (notebook 08 from 24 minutes to ~5).
# Each session has its own temporary folder and log; both logs are printed, and the exit status is the
# first failure's. Arguments (e.g. -m "not notebook") run one session with them, as before; `-m real_notebook` runs
# notebooks 01, 03, 06 and 07 on their default model, SmolLM2 (about 20 minutes), which CI leaves out.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash ci/setup_env.sh
venv=.venv
if [ "${1:-}" = "--mcore" ]; then
  case "${2:-}" in
    0.16) venv=.venv-mcore016; bash ci/setup_env.sh 0.16 ;;
    0.19) venv=.venv ;;
    *) echo "test.sh: --mcore takes 0.19 (the default) or 0.16; got '${2:-}'" >&2; exit 2 ;;
  esac
  shift 2
fi
# The linter first: a tree that is not clean under ruff (pyproject.toml) fails before the long tiers.
.venv/bin/ruff check .
# --timeout: a hung distributed test fails after 10 minutes instead of eating the CI budget (notebooks
# carry their own, longer limit). --durations: where the CI budget (45 minutes on 2 cores) goes.
PYTEST=("$venv/bin/python" -m pytest tests -q -rs --timeout 600 --durations=25)
SECOND_TIER=(.venv-mcore016/bin/python -m pytest tests -q -rs --timeout 600 --durations=10 -m "both_ends and not notebook")
RELEASES=("$venv/bin/python" -m pytest tests -q -rs --timeout 900 --durations=5 -m releases)

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
# One thread per session: the launcher gives a one-process worker every core (OMP_NUM_THREADS = cores / processes)
# unless the environment says otherwise, so two sessions side by side ran 2 x 2 OpenMP threads on 2 cores, and
# oversubscribed OpenMP threads wait on each other at every parallel region. Measured: two copies of notebook 06
# side by side took 257 s with 2 threads each and 97 s with 1 (the same losses); docs/megatron-core-on-cpu.md.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Two streams, about equal: the notebooks, then the tests that move checkpoints and runs between the releases; the
# tests, then the second tier. The 0.16 environment is set up beside them (pip, mostly waiting on the disk): only the
# streams' second halves need it.
( bash ci/setup_env.sh 0.16 > "$work/setup016.log" 2>&1; echo $? > "$work/setup016.status" ) &
setup016=$!
# The serving environment (vLLM, llm-compressor) for notebook 13 and the tests marked `serving`, set up beside the
# 0.16 one; the tests that need it wait for its status file (tests/conftest.py's serving_env) and fail if it failed.
export PAI_COOKBOOK_SERVE_SETUP="$work/setupserve.status"
( bash ci/setup_env.sh serve > "$work/setupserve.log" 2>&1; echo $? > "$work/setupserve.status.tmp"
  mv "$work/setupserve.status.tmp" "$work/setupserve.status" ) &
(
  "${PYTEST[@]}" -m "(notebook or real_model or second_stream) and not real_notebook" --basetemp "$work/notebooks"
  echo $? > "$work/notebooks.status"
  while [ ! -f "$work/setup016.status" ]; do sleep 5; done
  echo "================ checkpoints and runs moved between Megatron-Core 0.16 and 0.19 ================"
  if [ "$(cat "$work/setup016.status")" -eq 0 ]; then
    "${RELEASES[@]}" --basetemp "$work/releases"
    echo $? > "$work/releases.status"
  fi
) > "$work/notebooks.log" 2>&1 &
notebooks=$!
"${PYTEST[@]}" -m "not notebook and not real_model and not releases and not second_stream and not full_matrix" \
  --basetemp "$work/tests"
tests_status=$?
wait "$setup016"
setup016_status=$(cat "$work/setup016.status")
cat "$work/setup016.log"
echo "================ the second tier: Megatron-Core 0.16 on Python 3.11 (.venv-mcore016) ================"
second_status=1
if [ "$setup016_status" -eq 0 ]; then
  "${SECOND_TIER[@]}" --basetemp "$work/second"
  second_status=$?
fi
wait "$notebooks"
cat "$work/setupserve.log" 2>/dev/null
notebooks_status=$(cat "$work/notebooks.status" 2>/dev/null || echo 1)
releases_status=$(cat "$work/releases.status" 2>/dev/null || echo 1)
echo "================ notebooks, the real model, then the release-crossing tests (the second stream) ================"
cat "$work/notebooks.log"
rm -rf "$work"
check_collected "$tests_status" "-m 'not notebook and not real_model and not second_stream'" || exit $?
[ "$setup016_status" -eq 0 ] || { echo "test.sh: bash ci/setup_env.sh 0.16 failed (its log is above)" >&2; exit 1; }
check_collected "$second_status" "-m both_ends on Megatron-Core 0.16" || exit $?
check_collected "$notebooks_status" "-m '(notebook or real_model or second_stream) and not real_notebook'" || exit $?
check_collected "$releases_status" "-m releases" || exit $?
exit 0

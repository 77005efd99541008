#!/usr/bin/env bash
# Create ./.venv (or $DPOOL_VENV) if needed and install dpool into it. Sourced by the other scripts.
#
# torch: an already installed torch is kept; otherwise a machine with an NVIDIA GPU gets the default
# (CUDA) build from the package index, and a CPU-only machine gets torch==2.13.0, which on this
# project's machines is a small CPU build kept on local disk. (Elsewhere, point PIP_EXTRA_INDEX_URL at
# PyTorch's CPU wheel index to stay light.)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${DPOOL_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
if ! python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install --quiet "torch>=2.1"
  else
    python -m pip install --quiet "torch==2.13.0"
  fi
fi
python -m pip install --quiet -e ".[test,examples]"

#!/usr/bin/env bash
# Create ./.venv (or $DPOOL_VENV) if needed and install dpool into it with the extras in $DPOOL_EXTRAS
# (default: test,examples,docs). Sourced by the other scripts.
#
# torch: an already installed torch is kept; otherwise a machine with an NVIDIA GPU gets the default
# (CUDA) build from the package index, and a CPU-only machine gets torch==2.13.0, which on this
# project's machines is a small CPU build kept on local disk. (Elsewhere, point PIP_EXTRA_INDEX_URL at
# PyTorch's CPU wheel index to stay light.)
#
# pip runs only when pyproject.toml or the extras changed since this venv's last install (a stamp file in
# the venv records them), so running an example again starts at once.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${DPOOL_VENV:-.venv}
EXTRAS=${DPOOL_EXTRAS:-test,examples,docs}
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
STAMP="$VENV/.dpool-installed"
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1) $EXTRAS"
# (a stamp covering more extras than asked for also serves: the test venv runs the example too)
if [ ! -f "$STAMP" ] || ! python - "$STAMP" "$WANT" <<'PY'
import sys
have, want = open(sys.argv[1]).read().split(), sys.argv[2].split()
sys.exit(0 if have[0] == want[0] and set(want[1].split(",")) <= set(have[1].split(",")) else 1)
PY
then
  python -m pip install --quiet -e ".[$EXTRAS]"
  echo "$WANT" > "$STAMP"
fi
# An editable install compiles none of the checkout's modules, and where PYTHONDONTWRITEBYTECODE is set no
# process writes them either: then every worker would compile dpool, its worker package and the module of the
# model it unpickles (a test's, an example's) again at its start. Compiled once here; stale files are redone.
python -m compileall -q -j 0 dpool workers tests benchmarks examples >/dev/null

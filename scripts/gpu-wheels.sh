#!/usr/bin/env bash
# Download into .whl/ (ignored by git) the wheels scripts/gpu-check.sh installs on a GPU machine that has no
# package index: what its image lacks, for its Python (CPython 3.12, x86_64 Linux). Run it where pip reaches
# an index; it downloads nothing already there.
#   bash scripts/gpu-wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${DPOOL_WHEELS:-.whl}
# The GPU image has torch, msgpack, psutil, cloudpickle, pytest, pytest-timeout, hypothesis, transformers,
# accelerate and lightning; it lacks pyzmq (which needs nothing else on CPython).
PACKAGES=("pyzmq>=25")
mkdir -p "$WHEELS"
if ls "$WHEELS"/pyzmq-*cp312*manylinux*x86_64*.whl >/dev/null 2>&1; then
  echo "gpu-wheels: $WHEELS already holds them"
  exit 0
fi
"${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$WHEELS" "${PACKAGES[@]}"
ls "$WHEELS"

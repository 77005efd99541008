#!/usr/bin/env bash
# Run dpool's tests on a GPU machine that already has a CUDA torch and may have no package index.
#   bash scripts/gpu-test.sh                      # the CUDA tests (tests/test_cuda.py)
#   bash scripts/gpu-test.sh tests                # the whole suite
#   bash scripts/gpu-test.sh --groups             # the whole suite, in six groups of files run at once
#   bash scripts/gpu-test.sh --groups "tests/test_cuda.py tests/test_examples_bench.py" "tests/test_faults.py" ...
#                                                 # each group in its own pytest process, all at once
#   DPOOL_WHEELS=/path/to/wheels bash scripts/gpu-test.sh
# It keeps the installed torch (never reinstalls it) and installs only what is missing (pyzmq,
# msgpack, psutil, cloudpickle, pytest, pytest-timeout, hypothesis, transformers, and nbclient with
# ipykernel for the notebook test). Offline, $DPOOL_WHEELS (default: .whl/) must hold every missing
# package and each of their own missing dependencies: its wheels are installed as they are, without
# resolving. Without that folder, pip uses the configured index.
#
# --groups runs scripts/pytest-groups.sh (each group its own pytest process, shared-memory folder and runtime
# folder; "rest" is every file no group names). Keep the GPU tests (tests/test_cuda.py) and the examples
# (they use the GPU too) in one group: the preflight test takes nearly all of the GPU's memory.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
site=${DPOOL_SITE:-/tmp/dpool-site}
# An earlier run's install is reused.
if [ -d "$site" ]; then export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"; fi
"$PY" -c "import torch; assert torch.cuda.is_available(), 'this script is for machines with a GPU'; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))"
missing=$("$PY" - <<'PY'
import importlib.util
mods = {"zmq": "pyzmq", "msgpack": "msgpack", "psutil": "psutil", "cloudpickle": "cloudpickle",
        "pytest": "pytest", "pytest_timeout": "pytest-timeout", "hypothesis": "hypothesis",
        "transformers": "transformers", "nbclient": "nbclient", "ipykernel": "ipykernel"}
print(" ".join(pkg for mod, pkg in mods.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
  wheels=${DPOOL_WHEELS:-.whl}
  if [ -d "$wheels" ]; then
    echo "missing: $missing; installing every wheel of $wheels"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl
  else
    "$PY" -m pip install -q --target "$site" $missing
  fi
  case ":${PYTHONPATH:-}:" in *":$site:"*) ;; *) export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" ;; esac
fi
# The worker package installs as dpool_workers; a checkout gets the name through a link (tests run
# `python -m dpool_workers.cli`).
# A failure's traceback is printed when the test fails (tests/conftest.py), so that a run cut off by a time
# limit still says why.
export DPOOL_TEST_EARLY_TRACEBACKS=${DPOOL_TEST_EARLY_TRACEBACKS:-1}
links=$site-links
mkdir -p "$links" && ln -sfn "$PWD/workers" "$links/dpool_workers"
export PYTHONPATH="$PWD:$links${PYTHONPATH:+:$PYTHONPATH}"
if [ $# -eq 0 ]; then set -- tests/test_cuda.py; fi
if [ "$1" != "--groups" ]; then
  exec "$PY" -m pytest -p no:cacheprovider "$@"
fi
shift
if [ $# -eq 0 ]; then  # the whole suite in six groups of about equal time
  set -- "tests/test_cuda.py tests/test_examples_bench.py" tests/test_faults.py \
    "tests/test_daemon.py tests/test_bad_input.py tests/test_building_blocks.py tests/test_errors.py" \
    "tests/test_multinode.py tests/test_semantics.py tests/test_parity.py" "tests/test_lifecycle.py tests/test_ctrl_c.py" rest
fi
PYTHON=$PY exec bash scripts/pytest-groups.sh "$@"

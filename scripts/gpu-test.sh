#!/usr/bin/env bash
# Run dpool's tests on a GPU machine that already has a CUDA torch and may have no package index.
#   bash scripts/gpu-test.sh                      # the CUDA tests (tests/test_cuda.py)
#   bash scripts/gpu-test.sh tests                # the whole suite
#   DPOOL_WHEELS=/path/to/wheels bash scripts/gpu-test.sh
# It keeps the installed torch (never reinstalls it) and installs only what is missing (pyzmq,
# msgpack, psutil, cloudpickle, pytest, pytest-timeout), offline from $DPOOL_WHEELS (default: .whl/)
# when that folder exists, else from the configured index.
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
        "pytest": "pytest", "pytest_timeout": "pytest-timeout"}
print(" ".join(pkg for mod, pkg in mods.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
  wheels=${DPOOL_WHEELS:-.whl}
  if [ -d "$wheels" ]; then
    "$PY" -m pip install -q --no-index --find-links "$wheels" --target "$site" $missing
  else
    "$PY" -m pip install -q --target "$site" $missing
  fi
  case ":${PYTHONPATH:-}:" in *":$site:"*) ;; *) export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" ;; esac
fi
# The worker package installs as dpool_workers; a checkout gets the name through a link (tests run
# `python -m dpool_workers.cli`).
links=$site-links
mkdir -p "$links" && ln -sfn "$PWD/workers" "$links/dpool_workers"
export PYTHONPATH="$PWD:$links${PYTHONPATH:+:$PYTHONPATH}"
if [ $# -eq 0 ]; then set -- tests/test_cuda.py; fi
"$PY" -m pytest -p no:cacheprovider "$@"

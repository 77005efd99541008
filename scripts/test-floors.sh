#!/usr/bin/env bash
# The integration tests against the oldest versions the extras allow: pyproject.toml's floors of transformers,
# accelerate and lightning, pinned exactly, in a venv of their own (./.venv-floors, or $DPOOL_FLOORS_VENV).
#   bash scripts/test-floors.sh              # the floors pyproject.toml declares
#   bash scripts/test-floors.sh transformers==4.47.0 lightning==2.3.0    # other pins, to find a floor
# Not part of the README's test command (it installs a second set of libraries); run it when a floor changes.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DPOOL_FLOORS_VENV:-.venv-floors}
if [ $# -gt 0 ]; then
  PINS=("$@")
else
  # each extra's ">=X" floor as "==X"
  mapfile -t PINS < <(python3 - <<'PY'
import re
text = open("pyproject.toml").read()
extras = text[text.index("[project.optional-dependencies]"):text.index("[project.scripts]")]
floors = {}
for line in extras.splitlines():
    if line.startswith(("transformers", "lightning", "accelerate")):
        for name, version in re.findall(r'"(transformers|lightning|accelerate)>=([^"]+)"', line):
            floors[name] = version
print("\n".join(f"{name}=={version}" for name, version in sorted(floors.items())))
PY
)
fi
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install --quiet "torch==2.13.0" -e . "pytest>=7" "pytest-timeout>=2.1" "hypothesis>=6" "${PINS[@]}"
echo "test-floors: $(python -c 'import torch, transformers, accelerate, lightning; print(f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}, lightning {lightning.__version__}")')"
python -m pytest -q -p no:cacheprovider tests/test_integration_transformers.py tests/test_integration_accelerate.py \
  tests/test_integration_lightning.py

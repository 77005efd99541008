#!/usr/bin/env bash
# Set up dpool from nothing and run its tests: the README's test command, and what CI runs.
#   bash scripts/setup-and-test.sh            # all tests
#   bash scripts/setup-and-test.sh -k parity  # extra arguments go to pytest
set -euo pipefail
# shellcheck source=setup.sh
. "$(dirname "$0")/setup.sh"
python -m pytest "$@"

#!/usr/bin/env bash
# Set up dpool from nothing, lint and type-check it, build the docs site strictly, and run its tests: the
# README's test command, and what CI runs.
#   bash scripts/setup-and-test.sh            # all tests
#   bash scripts/setup-and-test.sh -k parity  # extra arguments go to pytest
set -euo pipefail
# shellcheck source=setup.sh
. "$(dirname "$0")/setup.sh"
# Lint and type checks first (seconds; configured in pyproject.toml), then the site (broken links and
# references fail it), then the tests.
python -m ruff check .
python -m mypy
python -m sphinx -W --keep-going -q -b html docs docs/_build/html
python -m pytest "$@"

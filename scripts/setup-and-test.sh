#!/usr/bin/env bash
# Set up dpool from nothing, lint and type-check it, build the docs site strictly, and run its tests: the
# README's test command, and what CI runs.
#   bash scripts/setup-and-test.sh            # all tests, in three groups of files run at once
#   bash scripts/setup-and-test.sh -k parity  # extra arguments go to one pytest over the whole suite
set -euo pipefail
# shellcheck source=setup.sh
. "$(dirname "$0")/setup.sh"
# Lint and type checks first (seconds; configured in pyproject.toml), then the site (broken links and
# references fail it), then the tests.
python -m ruff check .
python -m mypy
python -m sphinx -W --keep-going -q -b html docs docs/_build/html
if [ $# -gt 0 ]; then
  exec python -m pytest "$@"
fi
# Three groups of files at once: much of the suite waits (worker start-up, heartbeats, a peer's timeout) rather
# than computes, and three groups fill those waits on two cores. Each takes about a third of the suite's time
# (the third group is every file the first two do not name).
PYTHON=python bash scripts/pytest-groups.sh \
  "tests/test_multinode.py tests/test_faults.py tests/test_hardening.py tests/test_daemon.py tests/test_doctor.py \
tests/test_examples_bench.py tests/test_bad_input.py" \
  "tests/test_lifecycle.py tests/test_integration_transformers.py tests/test_integration_lightning.py \
tests/test_integration_accelerate.py tests/test_integration_sentence_transformers.py tests/test_integration_trl.py \
tests/test_install.py tests/test_errors_lifecycle.py tests/test_release.py tests/test_doc_snippets.py" \
  rest

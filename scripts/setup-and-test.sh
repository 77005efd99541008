#!/usr/bin/env bash
# Set up dpool from nothing, lint and type-check it, build the docs site strictly, and run its tests: the
# README's test command, and what CI runs. It fails if any of them fails.
#   bash scripts/setup-and-test.sh            # all tests, in three groups of files run at once
#   bash scripts/setup-and-test.sh -k parity  # extra arguments go to one pytest over the whole suite
set -euo pipefail
# shellcheck source=setup.sh
. "$(dirname "$0")/setup.sh"
# The lint first (it takes no time; configured in pyproject.toml). Then the type check and the site (broken links
# and references fail it): before a pytest of your own, or while the groups below run (they are single-threaded
# and would otherwise add their minute to the suite's wall time), failing the command at the end.
python -m ruff check .
if [ $# -gt 0 ]; then
  python -m mypy
  python -m sphinx -W --keep-going -q -b html docs docs/_build/html
  exec python -m pytest "$@"
fi
checks=$(mktemp -d)
python -m mypy >"$checks/mypy.log" 2>&1 &
mypy_pid=$!
python -m sphinx -W --keep-going -q -b html docs docs/_build/html >"$checks/sphinx.log" 2>&1 &
sphinx_pid=$!
finish_checks() {  # the type check's and the site's results, after the tests; a failure fails the command
  local ok=0
  if ! wait "$mypy_pid"; then echo "mypy failed:"; ok=1; fi
  cat "$checks/mypy.log"
  if ! wait "$sphinx_pid"; then echo "the docs site failed to build (sphinx -W):"; ok=1; fi
  cat "$checks/sphinx.log"
  rm -rf "$checks"
  return $ok
}
# Three groups of files at once: much of the suite waits (worker start-up, heartbeats, a peer's timeout) rather
# than computes, and three groups fill those waits on two cores. Each takes about a third of the suite's time
# (the third group is every file the first two do not name).
tests=0
PYTHON=python bash scripts/pytest-groups.sh \
  "tests/test_multinode.py tests/test_faults.py tests/test_hardening.py tests/test_daemon.py tests/test_doctor.py \
tests/test_examples_bench.py tests/test_bad_input.py" \
  "tests/test_lifecycle.py tests/test_ctrl_c.py tests/test_integration_transformers.py tests/test_integration_lightning.py \
tests/test_integration_accelerate.py tests/test_integration_sentence_transformers.py tests/test_integration_trl.py \
tests/test_install.py tests/test_errors.py tests/test_release.py tests/test_doc_snippets.py" \
  rest || tests=$?
checks_ok=0
finish_checks || checks_ok=1
[ "$tests" -eq 0 ] && [ "$checks_ok" -eq 0 ]

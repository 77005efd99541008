#!/usr/bin/env bash
# Run the test files in groups, each group in its own pytest process, all at once; print each group's log
# when it ends, and exit non-zero if any group failed.
#   bash scripts/pytest-groups.sh "tests/test_a.py tests/test_b.py" "tests/test_c.py" rest
# A group is a space-separated list of test files; the word "rest" stands for every tests/test_*.py file
# that no other group names. Python is $PYTHON (default: python).
#
# The suite's leak checks look at this process's children, fds and socket files, and at every dpool segment
# of the shared-memory directory, so each group gets its own DPOOL_SHM_DIR and XDG_RUNTIME_DIR. Logs go to
# $DPOOL_TEST_LOGS (default: a new temporary folder), one per group.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
named=" $* "
groups=()
for group in "$@"; do
  if [ "$group" = rest ]; then
    group=""
    for f in tests/test_*.py; do
      case "$named" in *" $f "*) ;; *) group="$group $f" ;; esac
    done
    group=${group# }
  fi
  groups+=("$group")
done
logs=${DPOOL_TEST_LOGS:-$(mktemp -d)}
mkdir -p "$logs"
pids=()
runs=()
shms=()
for k in "${!groups[@]}"; do
  shm=/dev/shm/dpool-tests-$$-$k run=$(mktemp -d)   # mktemp -d: mode 0700, as dpool wants its runtime dir
  runs+=("$run")
  shms+=("$shm")
  mkdir -p "$shm"
  # shellcheck disable=SC2086  # a group is a space-separated list of test paths
  DPOOL_SHM_DIR=$shm XDG_RUNTIME_DIR=$run "$PY" -m pytest -p no:cacheprovider ${groups[$k]} >"$logs/group$k.log" 2>&1 &
  pids+=($!)
done
status=0
for k in "${!groups[@]}"; do
  if wait "${pids[$k]}"; then rc=0; else rc=$?; status=1; fi
  echo "=================== group $k: exit $rc: ${groups[$k]}"
  cat "$logs/group$k.log"
  rmdir "${shms[$k]}" 2>/dev/null || { echo "group $k left files in ${shms[$k]}"; status=1; }
done
rm -rf "${runs[@]}"
for k in "${!groups[@]}"; do echo "group $k: exit status in its log above; $(tail -n 1 "$logs/group$k.log")"; done
exit $status

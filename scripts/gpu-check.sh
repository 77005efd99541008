#!/usr/bin/env bash
# Everything dpool checks on a GPU, in one run on a machine with one GPU, each step within its own time limit:
#   bash scripts/gpu-wheels.sh                 # first, on a machine with a package index: the wheels it needs
#   bash scripts/gpu-check.sh [OUT]            # on the GPU machine; OUT defaults to $OUT, else gpu-check-out/
#   bash scripts/gpu-check.sh --dry-run [OUT]  # anywhere: the wheels, the test selection and OUT are checked,
#                                              # nothing runs
# In this order, each step bounded by its own time limit and run whatever the one before did:
#   1. the CUDA tests (tests/test_cuda.py, tests/test_cuda_integrations.py) on device_ids=[0, 0] and
#      `dpool-workers doctor`'s training step on the GPU, then the docs' GPU-marked Python snippets
#      (tests/test_doc_snippets.py -k gpu);
#   2. a selection of them again with DPOOL_TEST_COPY_PATH=1 (the copy path of workers on another GPU);
#   3. benchmarks/gpu.py, resnet, encoder and probe against one process and nn.DataParallel, four times,
#      alternating DPOOL_CUDA_ASYNC_REPLIES unset and =1 (unset, set, unset, set);
#   4. benchmarks/gpu.py --trace on resnet, in both modes (the GPU's idle fraction, where the host waits);
#   5. benchmarks/gpu.py --mps: dpool [0] and [0, 0] under NVIDIA's Multi-Process Service.
# OUT then holds at most 8 files: log.txt (everything printed), tests.log (the tests' output), bench.json
# (the four benchmark runs), trace.json (both modes' trace summaries), mps.json and summary.json (each step's
# exit status and seconds). Missing packages (the GPU image lacks pyzmq) are installed from .whl/ by
# scripts/gpu-test.sh, without an index.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUTDIR=${1:-${OUT:-gpu-check-out}}
PY=${PYTHON:-python3}
WHEELS=${DPOOL_WHEELS:-.whl}
TESTS="tests/test_cuda.py tests/test_cuda_integrations.py tests/test_doctor.py::test_doctor_passes_here_and_runs_a_training_step"
COPY_PATH_TESTS="parity or copy_path or train or optimizer"  # (-k) what the copy path must get right
# What the GPU image lacks (see scripts/gpu-wheels.sh, which downloads exactly these).
NEEDED_WHEELS="pyzmq"

check() {  # the plan: wheels, test selection, output folder
  local ok=0
  for pkg in $NEEDED_WHEELS; do
    if ! ls "$WHEELS"/"$pkg"-*cp312*manylinux*x86_64*.whl >/dev/null 2>&1; then
      echo "gpu-check: no $pkg wheel for CPython 3.12 on x86_64 in $WHEELS/: run bash scripts/gpu-wheels.sh" >&2
      ok=1
    fi
  done
  for f in $TESTS tests/test_doc_snippets.py benchmarks/gpu.py scripts/gpu-test.sh; do
    f=${f%%::*}
    [ -f "$f" ] || { echo "gpu-check: $f is missing" >&2; ok=1; }
  done
  if ! mkdir -p "$OUTDIR" || [ ! -w "$OUTDIR" ]; then
    echo "gpu-check: cannot write to $OUTDIR" >&2
    ok=1
  elif [ "$(find "$OUTDIR" -maxdepth 1 -type f | wc -l)" -gt 0 ]; then
    echo "gpu-check: $OUTDIR is not empty (at most 8 files come back from a device run: use an empty one)" >&2
    ok=1
  fi
  if [ $ok -ne 0 ]; then return $ok; fi  # (the collection below takes seconds: only once the rest holds)
  # one collection: both files must import (a collection error fails it), and the copy-path selection must pick
  # tests of tests/test_cuda.py
  # shellcheck disable=SC2086
  selected=$("$PY" -m pytest -p no:cacheprovider --collect-only -q -k "$COPY_PATH_TESTS" $TESTS 2>&1)
  if [ $? -ne 0 ] || [ "$(grep -c "^tests/test_cuda.py::" <<<"$selected")" -lt 3 ]; then
    echo "gpu-check: the tests do not collect, or -k '$COPY_PATH_TESTS' picks too few of them:" >&2
    tail -n 5 <<<"$selected" >&2
    ok=1
  fi
  return $ok
}

if [ $DRY -eq 1 ]; then
  if check; then echo "gpu-check: dry run OK: wheels ($NEEDED_WHEELS), $TESTS (copy path: -k '$COPY_PATH_TESTS'), $OUTDIR"; exit 0; fi
  exit 1
fi
check || exit 1
exec > >(tee "$OUTDIR/log.txt") 2>&1
"$PY" -c "import torch; assert torch.cuda.is_available(), 'this script is for machines with a GPU'"  || exit 1
nvidia-smi -L || true
SCRATCH=$(mktemp -d)
STEPS=()
step() {  # step NAME SECONDS COMMAND...: run it bounded, note its status and time
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  echo "=== $name (at most ${limit} s)"
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  STEPS+=("$name $rc $(( $(date +%s) - t0 ))")
  echo "=== $name: exit $rc after $(( $(date +%s) - t0 )) s"
}
export PYTHONUNBUFFERED=1 DPOOL_WHEELS="$WHEELS"
# shellcheck disable=SC2086
step tests 200 bash -c "set -o pipefail; bash scripts/gpu-test.sh $TESTS 2>&1 | tee $SCRATCH/tests.log"
step copy-path 70 bash -c "set -o pipefail; DPOOL_TEST_COPY_PATH=1 bash scripts/gpu-test.sh tests/test_cuda.py -k '$COPY_PATH_TESTS' \
  2>&1 | tee -a $SCRATCH/tests.log"
step snippets 30 bash -c "set -o pipefail; bash scripts/gpu-test.sh tests/test_doc_snippets.py -k gpu 2>&1 \
  | tee -a $SCRATCH/tests.log"
cp "$SCRATCH/tests.log" "$OUTDIR/tests.log"
# the install gpu-test.sh made, for the benchmark's processes
export PYTHONPATH="$PWD:${DPOOL_SITE:-/tmp/dpool-site}:${DPOOL_SITE:-/tmp/dpool-site}-links${PYTHONPATH:+:$PYTHONPATH}"
BENCH=(benchmarks/gpu.py --workloads resnet,encoder,probe --setups single,dataparallel,dpool1,dpool --steps 20
       --repeats 3 --warmup 3)
for round in 1 2; do
  step "bench-$round-sync" 40 env -u DPOOL_CUDA_ASYNC_REPLIES "$PY" "${BENCH[@]}" --out "$SCRATCH/bench-$round-sync.json"
  step "bench-$round-async" 40 env DPOOL_CUDA_ASYNC_REPLIES=1 "$PY" "${BENCH[@]}" --out "$SCRATCH/bench-$round-async.json"
done
step trace-sync 30 env -u DPOOL_CUDA_ASYNC_REPLIES "$PY" benchmarks/gpu.py --trace "$SCRATCH/trace-sync" \
  --workloads resnet --setups single,dpool1,dpool
step trace-async 30 env DPOOL_CUDA_ASYNC_REPLIES=1 "$PY" benchmarks/gpu.py --trace "$SCRATCH/trace-async" \
  --workloads resnet --setups single,dpool1,dpool
step mps 50 "$PY" benchmarks/gpu.py --mps --workloads resnet,encoder,probe --setups single,dpool1,dpool --steps 20 \
  --repeats 3 --warmup 3 --out "$OUTDIR/mps.json"
"$PY" - "$SCRATCH" "$OUTDIR" "${STEPS[@]}" <<'PY'
import glob, json, os, sys
scratch, out, steps = sys.argv[1], sys.argv[2], sys.argv[3:]
def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
bench = {os.path.basename(p)[6:-5]: load(p) for p in sorted(glob.glob(os.path.join(scratch, "bench-*.json")))}
trace = {m: load(os.path.join(scratch, f"trace-{m}", "summary.json")) for m in ("sync", "async")}
for name, data in (("bench.json", bench), ("trace.json", trace)):
    with open(os.path.join(out, name), "w") as f:
        json.dump(data, f, indent=1)
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump([{"step": s.split()[0], "exit": int(s.split()[1]), "seconds": int(s.split()[2])} for s in steps], f,
              indent=1)
PY
rm -rf "$SCRATCH"
failed=0
for s in "${STEPS[@]}"; do
  set -- $s
  [ "$2" = 0 ] || { echo "gpu-check: step $1 failed (exit $2)"; failed=1; }
done
exit $failed

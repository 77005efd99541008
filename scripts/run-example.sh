#!/usr/bin/env bash
# Set up dpool if needed (with the examples' extra only), then run the main example (extra arguments go to it):
#   bash scripts/run-example.sh                      # CNN training with dpool
#   bash scripts/run-example.sh --mode single        # the same without dpool
set -euo pipefail
export DPOOL_EXTRAS=${DPOOL_EXTRAS:-examples}
# shellcheck source=setup.sh
. "$(dirname "$0")/setup.sh"
python examples/train_cnn.py "$@"

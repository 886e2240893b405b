#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the whole suite, slow tests
# included.  gpu/npu tests skip cleanly without the hardware.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then echo "no tests collected" >&2; fi
exit "$rc"

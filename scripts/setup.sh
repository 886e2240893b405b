#!/usr/bin/env bash
# Creates .venv and installs turnscale with its env extras and test tools.
# torch is pinned in the same pip call as everything that depends on it: an unpinned
# torch lets pip pick a multi-GB CUDA build on a machine without a GPU.
# Override the pin with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.14.1" on a CUDA box).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS:-envs,dev}

if ! command -v java >/dev/null 2>&1; then
  # ScienceWorld runs a JVM per instance.
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    # Best effort: without Java only the SciWorld tests skip, so a failed install must not stop setup.
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >/dev/null; } \
      || echo "setup: could not install Java 17; SciWorld will be unavailable" >&2
  else
    echo "setup: java not found; SciWorld needs Java 17 (apt-get install openjdk-17-jre-headless)" >&2
  fi
fi

if ! command -v chromium >/dev/null 2>&1; then
  # env=web and the viewer's browser tests drive Debian's chromium through Playwright (never `playwright install`).
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "setup: chromium not found; env=web and the viewer's browser tests will skip (apt-get install chromium chromium-driver)" >&2
  fi
fi

if ! command -v slurmctld >/dev/null 2>&1; then
  # The Slurm launcher's cluster test runs a real slurmctld + slurmd (Debian 12: slurm-wlm 22.05).
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    # Best effort: without Slurm only that test skips.
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm >/dev/null; } \
      || echo "setup: could not install slurm-wlm; the Slurm cluster test will skip" >&2
  else
    echo "setup: slurmctld not found; the Slurm cluster test will skip (apt-get install slurm-wlm)" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.turnscale-installed
want="$(cat pyproject.toml | sha1sum | cut -c1-16) $TORCH_SPEC $EXTRAS"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/pip install -q --disable-pip-version-check "$TORCH_SPEC" -e ".[$EXTRAS]"
  echo "$want" > "$stamp"
fi

"""``common.procs.die_with_parent``: a child started with it ends when its launcher is
SIGKILLed (real processes: the test starts a launcher, which starts the child)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from turnscale.common.procs import die_with_parent

LAUNCHER = """
import os, subprocess, sys, time
from turnscale.common.procs import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=die_with_parent(os.getpid()))
print(child.pid, flush=True)
time.sleep(120)
"""


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (a reparented child may wait for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_started_with_die_with_parent_ends_when_its_launcher_is_killed():
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True, env=env)
    child = 0
    try:
        assert launcher.stdout is not None
        child = int(launcher.stdout.readline())
        assert _running(child)
        os.kill(launcher.pid, signal.SIGKILL)  # no handler in the launcher can see this
        launcher.wait(timeout=60)
        deadline = time.monotonic() + 60
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child), "the child outlived its SIGKILLed launcher"
    finally:
        for pid in (launcher.pid, child):
            if pid and _running(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait(timeout=60)


def test_a_child_whose_launcher_is_already_gone_exits_before_exec(tmp_path):
    """The returned ``preexec_fn`` checks the parent: a stale ``parent_pid`` ends the child
    with status 1 before the command runs (here: before it writes its file)."""
    marker = tmp_path / "ran"
    proc = subprocess.Popen([sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"],
                            preexec_fn=die_with_parent(os.getpid() + 1_000_000))
    assert proc.wait(timeout=60) != 0
    assert not marker.exists()

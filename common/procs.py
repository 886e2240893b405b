"""Child processes started and ended by pid: what the one-machine launcher, the e2e
benchmark and the integration tests use to run envhub servers, learners and actors.

Invariants: every child is started by us and ended by its pid (SIGTERM, then SIGKILL
after a grace period); every wait is bounded in time; children log to files in the run
directory, so a piped terminal sees only the launcher's own progress.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence


class ChildFailed(RuntimeError):
    """A child exited when it should be running, or never became ready."""


def _load_prctl():
    """``prctl`` from libc, loaded in the parent: a ``preexec_fn`` runs between fork and
    exec, where importing or loading libraries is unsafe.  ``None`` off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen(..., preexec_fn=die_with_parent(os.getpid()))``:
    the kernel SIGTERMs the child when the thread that started it exits -- even by SIGKILL,
    which no handler in the launcher can see (``PR_SET_PDEATHSIG``; Linux only, elsewhere
    only the check below applies).  A child whose parent is already gone (``os.getppid()``
    is no longer ``parent_pid`` when it runs) exits with status 1 before ``exec``.

    Children are in their own sessions (a terminal's Ctrl-C reaches only the launcher), so
    without this a killed launcher would leave its learner, actors and envhub running.
    Start children from the thread that lives as long as they should (every caller here
    uses the main thread).  The returned function only calls ``prctl`` (loaded in the
    parent, at import): nothing is imported or allocated between fork and exec."""

    def preexec() -> None:
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 15.0, sig: int = signal.SIGTERM) -> int | None:
        """Signal the child by pid and wait up to ``grace_s``; SIGKILL if it is still there."""
        return stop_process(self.popen, grace_s, sig)

    def kill(self) -> None:
        """SIGKILL now (failure-injection tests)."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)


def stop_process(popen: subprocess.Popen, grace_s: float = 15.0, sig: int = signal.SIGTERM) -> int | None:
    """Send ``sig`` to a process we started (by its pid), wait up to ``grace_s``, then SIGKILL
    it; returns its exit status.  A process that already exited is only reaped."""
    if popen.poll() is None:
        try:
            os.kill(popen.pid, sig)
        except ProcessLookupError:
            pass
        try:
            popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout=10)
    return popen.returncode


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for children: one OpenMP thread unless told otherwise, this checkout
    importable, no hub access."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


@dataclass
class ProcessGroup:
    """Children of one launcher, each ``<python> -m <module> <args>``; ``close()`` ends them in
    reverse start order.  ``module`` is the caller's (the application passes ``turnscale``): the
    shared layer names no module above it."""

    log_dir: Path
    module: str
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, args: Sequence[str], env: dict[str, str] | None = None, python: str = "") -> Child:
        """``<python> -m <module> <args>`` (``python``: empty for this interpreter)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        log = open(log_path, "ab")
        popen = subprocess.Popen(
            [python or sys.executable, "-m", self.module, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env(env),
            start_new_session=True,
            preexec_fn=die_with_parent(os.getpid()),
        )
        log.close()
        child = Child(name, popen, log_path)
        self.children.append(child)
        return child

    def check_alive(self) -> None:
        for c in self.children:
            if not c.alive():
                raise ChildFailed(f"{c.name} (pid {c.pid}) exited with {c.popen.returncode}:\n{c.tail()}")

    def close(self, grace_s: float = 15.0) -> None:
        for c in reversed(self.children):
            c.stop(grace_s)

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_http_ok(url: str, timeout_s: float, child: Child | None = None) -> None:
    """Poll ``url`` until it answers 200; fail early if ``child`` dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child is not None and not child.alive():
            raise ChildFailed(f"{child.name} exited with {child.popen.returncode} before {url} was ready:\n{child.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.2)
    raise ChildFailed(f"{url} not ready after {timeout_s:.0f}s" + (f":\n{child.tail()}" if child else ""))


def setup_process() -> None:
    """Common start of a role process (learner, actor): ``kill -USR1 <pid>`` dumps every
    thread's stack, logging to stderr at ``$TURNSCALE_LOG`` (INFO), and torch limited to
    ``$OMP_NUM_THREADS`` threads when that is set (tests and CI set it to 1)."""
    import faulthandler
    import logging

    faulthandler.register(signal.SIGUSR1)
    logging.basicConfig(level=os.environ.get("TURNSCALE_LOG", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if os.environ.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

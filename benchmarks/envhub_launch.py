"""Start an envhub server as a child process (tests, benchmarks).

    with envhub_server("babyai", idle_timeout_s=1.0) as url:
        ...
    with envhub_process("web", stop_grace_s=30.0) as (proc, url):  # when the pid matters
        ...

Binds 127.0.0.1 on a free port (unless ``port=`` is given), waits for ``GET /health`` = 200,
and ends the child by its pid (SIGTERM, then SIGKILL after ``stop_grace_s``, 10 s by default).  Overrides are env keys
(``max_instances=4`` -> ``++env.max_instances=4``); a key with a dot is passed as it is.
The child's output goes to a temp file, shown if startup fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Iterator

from turnscale.protocol.transport import free_port  # re-exported: tests and the probe import it from here

__all__ = ["envhub_process", "envhub_server", "free_port", "stop", "wait_healthy"]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> dict:
    """Poll ``url/health`` until 200; raise if ``proc`` exits or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"envhub exited with {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1.0) as r:
                if r.status == 200:
                    return json.loads(r.read())
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"envhub at {url} not healthy within {timeout_s} s")


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace_s)


@contextlib.contextmanager
def envhub_server(env: str = "babyai", *, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 60.0,
                  **overrides: object) -> Iterator[str]:
    """The server's base URL (see the module docstring)."""
    with envhub_process(env, host=host, port=port, startup_timeout_s=startup_timeout_s, **overrides) as (_, url):
        yield url


@contextlib.contextmanager
def envhub_process(env: str = "babyai", *, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 60.0,
                   stop_grace_s: float = 10.0, **overrides: object) -> Iterator[tuple[subprocess.Popen, str]]:
    """The server's process and base URL, healthy on entry; ended by its pid on exit."""
    port = port or free_port()
    args = [sys.executable, "-m", "turnscale", "envhub", f"env={env}", f"host={host}", f"port={port}"]
    args += [f"++{k if '.' in k else 'env.' + k}={v}" for k, v in overrides.items()]
    log = tempfile.NamedTemporaryFile("w+", prefix=f"envhub-{env}-", suffix=".log", delete=False)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    url = f"http://{host}:{port}"
    try:
        try:
            wait_healthy(url, proc, startup_timeout_s)
        except Exception as exc:
            log.seek(0)
            raise RuntimeError(f"envhub {env} did not start ({exc}): {log.read()[-3000:]}") from None
        yield proc, url
    finally:
        stop(proc, grace_s=stop_grace_s)
        log.close()
        os.unlink(log.name)

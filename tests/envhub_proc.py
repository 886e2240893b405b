"""Start an envhub server process for a test: free port on 127.0.0.1, wait for /health, end by pid.

    with envhub_server("babyai", idle_timeout_s=1.0) as url:
        ...

Overrides are ``env.<key>=<value>`` (``max_instances=4`` -> ``env.max_instances=4``); a key
with a dot is passed as it is.  The server's stderr goes to a temp file, shown if startup fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> dict:
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


@contextlib.contextmanager
def envhub_server(env: str = "babyai", **overrides: object) -> Iterator[str]:
    port = free_port()
    args = [sys.executable, "-m", "turnscale", "envhub", f"env={env}", "host=127.0.0.1", f"port={port}"]
    args += [f"++{k if '.' in k else 'env.' + k}={v}" for k, v in overrides.items()]
    log = tempfile.NamedTemporaryFile("w+", prefix=f"envhub-{env}-", suffix=".log", delete=False)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, proc)
        except Exception:
            log.seek(0)
            raise RuntimeError(f"envhub did not start: {log.read()[-3000:]}")
        yield url
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()
        os.unlink(log.name)

"""Start a non-envhub server process (stand-ins, the retrieval service) on 127.0.0.1, wait for
its health URL, end it by pid.  envhub servers themselves: ``tests.envhub_proc.envhub_server``."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from typing import Iterator

import httpx

from tests.envhub_proc import free_port
from turnscale.common.procs import stop_process

__all__ = ["free_port", "serve"]


@contextlib.contextmanager
def serve(args: list[str], health_url: str, timeout_s: float = 60.0) -> Iterator[subprocess.Popen]:
    """``[sys.executable, *args]`` until the block ends; ready when ``health_url`` answers 200."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(health_url, timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{health_url} not ready after {timeout_s} s")
            time.sleep(0.1)
        yield proc
    finally:
        stop_process(proc, 10)

"""``env.exit_after_idle_s`` (#32 item 4): an envhub whose learner died leaves no actors
behind to call it; once no env request has arrived for that long it says why, closes its
instances and exits by itself, instead of holding its node until the job's time limit.
Against a real server process; ``/health`` and ``/metrics`` polling (a supervisor, a
monitoring probe) does not keep it alive, env requests do."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.envhub_proc import free_port, stop, wait_healthy
from turnscale import conf
from turnscale.envhub.main import EXIT_IDLE

LIMIT_S = 2.0
"""Short, so the test takes seconds; the server checks a few times per limit."""
EXIT_MARGIN_S = 15.0
"""How long after the limit the exit may take: shutdown closes instances and the family on a
loaded 2-core box (the point is that it ends at all, not how fast)."""


def _post(url: str, path: str, body: dict) -> object:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _get(url: str, path: str) -> object:
    with urllib.request.urlopen(url + path, timeout=10) as r:
        return json.loads(r.read())


def _poll_health_for(url: str, proc: subprocess.Popen, seconds: float) -> None:
    """``/health``, ``/``, ``/metrics`` only, for ``seconds`` or until the process exits."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and proc.poll() is None:
        for path in ("/health", "/", "/metrics", "/v1/health", "/v1/metrics"):
            try:
                _get(url, path)
            except OSError:
                pass
        time.sleep(0.1)


def test_an_envhub_without_env_requests_for_exit_after_idle_s_says_why_and_exits(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "envhub.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "turnscale", "envhub", "env=babyai", "host=127.0.0.1", f"port={port}",
                                 f"env.exit_after_idle_s={LIMIT_S}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, timeout_s=60)
        # never used yet (the actors may still be queued): health polling past the limit, still serving
        _poll_health_for(url, proc, LIMIT_S + 1.0)
        assert proc.poll() is None, log_path.read_text()[-3000:]

        # env requests for longer than the limit keep it alive
        env_id = _post(url, "/v1/create", {})["id"]
        _post(url, "/v1/reset", {"id": env_id, "data_idx": 0})
        end = time.monotonic() + LIMIT_S + 1.5
        while time.monotonic() < end:
            _get(url, f"/v1/observation?id={env_id}")
            time.sleep(0.3)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        last_request = time.monotonic()

        # only health polling from now on: it ends by itself, saying why, instances closed
        _poll_health_for(url, proc, LIMIT_S + EXIT_MARGIN_S)
        rc = proc.wait(timeout=5)
        exited_after = time.monotonic() - last_request
    finally:
        stop(proc)
    text = log_path.read_text()
    assert rc == EXIT_IDLE, text[-3000:]
    assert exited_after >= LIMIT_S  # not before the limit since the last env request
    assert f"no request for {LIMIT_S:g} s (env.exit_after_idle_s): no learner's actors left; exiting" in text
    assert "closing 1 env instance(s)" in text
    assert "Traceback" not in text


def test_exit_after_idle_s_defaults_to_never_and_refuses_a_negative_value():
    assert conf.load([]).env.exit_after_idle_s == 0
    with pytest.raises(conf.ConfigError, match="env.exit_after_idle_s"):
        conf.load(["++env.exit_after_idle_s=-1"])

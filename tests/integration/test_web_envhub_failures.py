"""The browser pool's failure handling through the real ``turnscale envhub env=web`` server
process: a renderer killed by pid breaks only its own instance (a typed error, the neighbour goes
on, a new ``/create`` works); the browser process killed by pid is replaced, the server stays up,
and no chromium of that server is left once it stops.  Processes are found by walking ``/proc``
from the server's pid (its chromium carries ``--turnscale-pool=<uuid>``)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.envhub_proc import envhub_process

pytestmark = pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"),
                                reason="Debian's chromium is not installed (scripts/setup.sh installs it as root)")
WAIT_S = 120.0
"""Bound on every wait for the browser to notice a death (generous: the box is shared)."""


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def descendants(pid: int) -> list[int]:
    kids, out = _children(), [pid]
    for p in out:  # grows while iterating
        out.extend(kids.get(p, []))
    return out[1:]


def chromium_main(server_pid: int) -> int:
    """The pool's browser process (the marker switch, no ``--type=``) below the server."""
    mains = [p for p in descendants(server_pid)
             if b"--turnscale-pool=" in _cmdline(p) and b"--type=" not in _cmdline(p)]
    assert len(mains) == 1, mains
    return mains[0]


def renderers(server_pid: int) -> set[int]:
    return {p for p in descendants(server_pid) if b"--type=renderer" in _cmdline(p)}


def marker_processes(marker: bytes) -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit() and marker in _cmdline(int(d))]


@contextmanager
def web_server() -> Iterator[tuple[subprocess.Popen, httpx.Client]]:
    """A ``turnscale envhub env=web`` process (healthy) and a client for its ``/v1`` routes."""
    with envhub_process("web", startup_timeout_s=WAIT_S, stop_grace_s=30.0) as (proc, url):
        with httpx.Client(base_url=url + "/v1", timeout=WAIT_S) as c:
            yield proc, c


def new_instance(c: httpx.Client, data_idx: int) -> int:
    eid = c.post("/create").json()["id"]
    r = c.post("/reset", json={"id": eid, "data_idx": data_idx})
    assert r.status_code == 200, r.text
    return eid


def scroll(c: httpx.Client, eid: int) -> httpx.Response:
    return c.post("/step", json={"id": eid, "action": "```scroll [down]```"})


def until_broken(c: httpx.Client, eid: int) -> httpx.Response:
    """Step ``eid`` until the server answers with an error (Playwright learns of a death
    asynchronously); bounded by ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        r = scroll(c, eid)
        if r.status_code != 200:
            return r
    raise AssertionError(f"instance {eid} kept working for {WAIT_S} s after its browser process was killed")


def oracle_succeeds(c: httpx.Client, eid: int, data_idx: int) -> bool:
    assert c.post("/reset", json={"id": eid, "data_idx": data_idx}).status_code == 200
    for _ in range(40):
        action = c.get("/expert", params={"id": eid}).json()["action"]
        out = c.post("/step", json={"id": eid, "action": f"```{action}```"}).json()
        if out["done"]:
            return out["info"]["success"]
    return False


def test_a_killed_renderer_breaks_only_its_instance_over_http():
    with web_server() as (proc, c):
        a = new_instance(c, 0)
        before = renderers(proc.pid)
        b = new_instance(c, 1)
        b_renderers = renderers(proc.pid) - before  # a was idle meanwhile: these render b's page
        assert b_renderers
        for pid in b_renderers:
            os.kill(pid, signal.SIGKILL)
        r = until_broken(c, b)
        assert r.status_code == 500 and r.json()["error"]["code"] == "env_error"
        assert "BrowserBroken" in r.json()["error"]["message"] and "create a new one" in r.json()["error"]["message"]
        again = scroll(c, b)
        assert again.status_code == 410 and again.json()["error"]["code"] == "broken"
        assert scroll(c, a).json()["info"]["valid"]  # the neighbour goes on
        assert oracle_succeeds(c, a, 2)
        fresh = new_instance(c, 3)
        assert oracle_succeeds(c, fresh, 3)
        assert c.get("/health").json()["status"] == "ok"


def test_a_killed_browser_is_replaced_and_leaves_no_chromium_after_the_server_stops():
    with web_server() as (proc, c):
        a = new_instance(c, 0)
        idle = new_instance(c, 1)
        old = chromium_main(proc.pid)
        marker = next(arg for arg in _cmdline(old).split(b"\0") if arg.startswith(b"--turnscale-pool="))
        os.kill(old, signal.SIGKILL)
        r = until_broken(c, a)
        assert r.status_code == 500 and "BrowserBroken" in r.json()["error"]["message"]
        assert c.get("/health").json()["status"] == "ok"  # the server stays up
        fresh = new_instance(c, 4)  # a new browser is launched for it
        assert oracle_succeeds(c, fresh, 4)
        new = chromium_main(proc.pid)
        assert new != old and marker in _cmdline(new)
        assert oracle_succeeds(c, idle, 5)  # an instance that was idle gets a new context at reset
        c.post("/close", json={"id": a})
    assert proc.returncode is not None
    deadline = time.monotonic() + WAIT_S  # orphans reparented to init die with their pipe; bounded
    while marker_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker_processes(marker) == []

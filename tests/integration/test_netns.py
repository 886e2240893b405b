"""The test cluster (``cluster.netns``): fake hosts reach each other by address, a rate cap is
visible, a cut link refuses connections and a restored one carries them again, and teardown
leaves no namespace, link or process behind — also when the body raises, and for processes
that ignore SIGTERM or left their process group.  Needs root; skips with the reason elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from turnscale.cluster.netns import Cluster, available, leftovers

_ok, _why = available()
pytestmark = pytest.mark.skipif(not _ok, reason=f"test cluster unavailable: {_why}")

PY = sys.executable

# a TCP sink: accepts connections forever, reads each to EOF, answers the byte count
SINK = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(8)
print("listening", flush=True)
while True:
    c, _ = s.accept()
    n = 0
    while True:
        b = c.recv(1 << 16)
        if not b:
            break
        n += len(b)
    c.sendall(str(n).encode()); c.close()
"""

# a client: sends N bytes to host:port, prints the seconds until the sink acknowledged them all
SEND = """
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + 10
while True:
    try:
        c = socket.create_connection((host, port), timeout=1); break
    except OSError:
        if time.monotonic() > deadline: raise
        time.sleep(0.05)
c.settimeout(30)
t = time.monotonic()
c.sendall(b"x" * n); c.shutdown(socket.SHUT_WR)
got = int(c.recv(64))
assert got == n, (got, n)
print(time.monotonic() - t)
"""

# one connection attempt: exit 0 when it connects, 3 when it fails
PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
except OSError as e:
    print(e); sys.exit(3)
"""


def _sink(c: Cluster, host: str, port: int) -> subprocess.Popen:
    p = c.spawn(host, [PY, "-c", SINK, c.addr(host), str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                cwd="/")
    line = p.stdout.readline()  # bounded: the sink prints at once or dies (EOF)
    assert line.strip() == b"listening", line
    return p


def _send_s(c: Cluster, src: str, dst: str, port: int, nbytes: int) -> float:
    r = c.run(src, [PY, "-c", SEND, c.addr(dst), str(port), str(nbytes)], timeout=60)
    assert r.returncode == 0, r.stderr
    return float(r.stdout.strip())


def test_hosts_reach_each_other_and_rate_cap_is_visible():
    with Cluster(["a", "b"]) as c:
        assert c.addr("a") != c.addr("b")
        assert c.addr("a").rsplit(".", 1)[1] == "1" and c.addr("b").rsplit(".", 1)[1] == "2"
        for h in ("a", "b"):  # lo is up in every namespace
            r = c.run(h, ["ip", "-br", "link", "show", "lo"])
            assert "UP" in r.stdout or "UNKNOWN" in r.stdout, r.stdout
        _sink(c, "b", 5001)
        _sink(c, "a", 5002)
        nbytes = 2_000_000
        _send_s(c, "b", "a", 5002, 1000)  # the other direction works too
        uncapped = _send_s(c, "a", "b", 5001, nbytes)
        c.set_rate("a", 20)  # 2 MB at 20 Mbit/s: 0.8 s at least
        capped = _send_s(c, "a", "b", 5001, nbytes)
        c.set_rate("b", 20)
        c.set_rate("a", None)  # the cap on b's link also caps what b receives
        capped_in = _send_s(c, "a", "b", 5001, nbytes)
        c.set_rate("b", None)
        again = _send_s(c, "a", "b", 5001, nbytes)
    print(f"2 MB: uncapped {uncapped:.3f} s, a capped at 20 Mbit/s {capped:.3f} s, "
          f"b capped {capped_in:.3f} s, uncapped again {again:.3f} s")
    assert capped >= 0.65 and capped_in >= 0.65, (capped, capped_in)
    assert capped > 3 * uncapped and capped > 3 * again, (uncapped, capped, again)
    assert not leftovers(c.prefix)


def test_cut_link_refuses_and_restored_link_carries():
    with Cluster(["a", "b", "c"], rate_mbit=100) as c:
        _sink(c, "b", 5003)

        def probe(src: str) -> int:
            return c.run(src, [PY, "-c", PROBE, c.addr("b"), "5003", "1.0"], timeout=20).returncode

        assert probe("a") == 0 and probe("c") == 0
        c.set_link("b", False)
        assert probe("a") == 3 and probe("c") == 3
        c.set_link("b", True)
        deadline = time.monotonic() + 10
        while probe("a") != 0:
            assert time.monotonic() < deadline, "the restored link does not carry connections"
        assert probe("c") == 0
        # cutting a is local to a: b and c still talk
        c.set_link("a", False)
        assert probe("c") == 0 and probe("a") == 3
    assert not leftovers(c.prefix)


def _ns_pids(c: Cluster) -> list[int]:
    out = []
    for h in c.hosts:
        r = subprocess.run(["ip", "netns", "pids", c.netns(h)], capture_output=True, text=True, timeout=10)
        out += [int(x) for x in r.stdout.split()]
    return out


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_teardown_leaves_nothing_even_when_the_body_raises():
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
                "time.sleep(120)")
    procs: list[subprocess.Popen] = []
    pids: list[int] = []
    with pytest.raises(RuntimeError, match="test body failed"):
        with Cluster(["a", "b"], kill_grace_s=1.0) as c:
            procs.append(c.spawn("a", ["sleep", "120"]))
            p = c.spawn("b", [PY, "-c", stubborn], stdout=subprocess.PIPE)  # ignores SIGTERM: KILLed
            assert p.stdout.readline() == b"up\n"
            procs.append(p)
            # a process that left its process group (a new session): found by its namespace
            procs.append(c.spawn("b", ["setsid", "-f", "sleep", "120"]))
            deadline = time.monotonic() + 10
            while len(_ns_pids(c)) < 3:
                assert time.monotonic() < deadline, _ns_pids(c)
                time.sleep(0.05)
            pids = _ns_pids(c)
            assert leftovers(c.prefix)
            raise RuntimeError("test body failed")
    assert not leftovers(c.prefix), leftovers(c.prefix)
    assert all(p.poll() is not None for p in procs)
    assert all(_gone(pid) for pid in pids), [pid for pid in pids if not _gone(pid)]
    assert not os.path.exists(f"/var/run/netns/{c.prefix}-1")
    c.close()  # idempotent


def test_cleanup_command_removes_a_crashed_cluster():
    c = Cluster(["a", "b"], prefix="tsclean" + os.urandom(1).hex()[:1])
    try:
        p = c.spawn("a", ["sleep", "120"])
        assert len(leftovers(c.prefix)) == 5  # 2 namespaces, bridge, 2 veths (root side)
        r = subprocess.run([PY, "-m", "turnscale.cluster.netns", "--cleanup", c.prefix], capture_output=True, text=True,
                           timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        assert r.returncode == 0, r.stderr
        assert not leftovers(c.prefix)
        p.wait(timeout=10)
    finally:
        c.close()
    assert not leftovers(c.prefix)


def test_unclosed_cluster_is_torn_down_at_exit_and_on_sigterm():
    """A process that never closes its cluster: ``atexit`` tears it down on a normal exit, the
    SIGTERM handler (installed where nobody else handles SIGTERM) on a kill."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys, time; from cluster.netns import Cluster; c = Cluster(['a', 'b'], prefix=sys.argv[1]); "
            "c.spawn('a', ['sleep', '60']); print('up', flush=True); time.sleep(float(sys.argv[2]))")
    tag = os.urandom(2).hex()
    r = subprocess.run([PY, "-c", code, f"tsx{tag}", "0"], capture_output=True, text=True, timeout=60, cwd=root)
    assert r.returncode == 0 and r.stdout == "up\n", r.stderr
    assert not leftovers(f"tsx{tag}")
    p = subprocess.Popen([PY, "-c", code, f"tsy{tag}", "60"], stdout=subprocess.PIPE, text=True, cwd=root)
    try:
        assert p.stdout.readline() == "up\n"
        assert len(leftovers(f"tsy{tag}")) == 5
        p.terminate()
        assert p.wait(timeout=30) == 128 + 15
        assert not leftovers(f"tsy{tag}")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
        subprocess.run([PY, "-m", "turnscale.cluster.netns", "--cleanup", f"tsy{tag}"], timeout=60, cwd=root)

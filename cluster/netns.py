"""Fake hosts on one machine: one Linux network namespace per host, each with its own address on
a private bridge, per-host link bandwidth with ``tc`` (TBF), links that can be cut and restored.

    with Cluster(["learner", "a1", "a2"], rate_mbit=100) as c:
        p = c.spawn("learner", [sys.executable, "-m", "turnscale", "learner",
                                f"learner.host={c.addr('learner')}"])
        c.set_link("a1", False)      # cut a1 off; set_link("a1", True) restores it

Layout, all names built from ``prefix`` (default ``"ts"`` + 4 random hex digits; Linux
interface names are at most 15 characters, so the prefix is at most 10):

* namespace ``<prefix>-<i>`` per host (i = 1, 2, ... in the order given), ``lo`` up;
* a bridge ``<prefix>br`` in the root namespace, with **no address** (only the namespaces'
  addresses are ever used; the machine's routes and firewall are not touched);
* a veth pair per host: ``<prefix>v<i>`` (root side, a bridge port) and ``<prefix>p<i>``
  (inside the namespace, address ``10.X.Y.<i>/24``), the /24 chosen at random so that it
  overlaps no route or address of the machine.

Rate caps are TBF qdiscs on the egress of both ends of the host's veth (so they cap what the
host sends and what it receives).  A link is cut by setting the root-side veth down (the
namespace side loses its carrier); TCP connections over it survive a short cut.  This kernel
has no ``netem``: add latency, if needed, with a delay proxy.

Processes start inside a host with ``nsenter --net=/var/run/netns/<ns>`` (not ``ip netns
exec``, which remounts ``/sys`` and hides cgroups from the children), each in its own session
(process group), and are tracked.  ``close()`` (also ``__exit__``, ``atexit`` and SIGTERM when
nobody else handles it) kills the tracked process groups (TERM, then KILL after a bound), any
other process left inside the namespaces, then deletes veths, bridge and namespaces by name.
``python -m turnscale.cluster.netns --cleanup PREFIX`` does the same for a crashed run;
``leftovers(PREFIX)`` lists what is still there.

``net.bridge.bridge-nf-call-iptables=1`` (br_netfilter loaded) sends bridged traffic through
the machine's iptables FORWARD chain; a DROP policy there would block the cluster.  The module
does not change it; ``Cluster`` checks reachability once at start (a TCP connection from the
first host to the second) and raises ``ClusterError`` naming that sysctl if it fails.
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Mapping, Sequence

__all__ = ["Cluster", "ClusterError", "available", "leftovers", "cleanup"]

NETNS_DIR = "/var/run/netns"
_IFNAME_MAX = 15
_MAX_PREFIX = 10  # "<prefix>br", "<prefix>v<i>" with i up to 99 ... must fit in 15 characters
_MAX_HOSTS = 99
_KILL_GRACE_S = 5.0


class ClusterError(RuntimeError):
    """A cluster could not be built (the partly built one is torn down before this is raised)."""


def _ip(*args: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=20)
    if check and r.returncode != 0:
        raise ClusterError(f"tc {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


_available: tuple[bool, str] | None = None


def available() -> tuple[bool, str]:
    """``(True, "")`` when this process can build a cluster, else ``(False, why)``."""
    global _available
    if _available is not None:
        return _available
    if not sys.platform.startswith("linux"):
        _available = (False, "network namespaces need Linux")
    elif os.geteuid() != 0:
        _available = (False, "the test cluster needs root (network namespaces, bridges, tc)")
    else:
        missing = [t for t in ("ip", "nsenter", "tc") if shutil.which(t) is None]
        if missing:
            _available = (False, f"missing tools: {', '.join(missing)} (iproute2, util-linux)")
        else:
            probe = f"tsprobe{os.getpid() % 100000:05d}"
            r = _ip("netns", "add", probe, check=False)
            if r.returncode != 0:
                _available = (False, f"network namespaces unsupported here: {r.stderr.strip()}")
            else:
                _ip("netns", "del", probe, check=False)
                r = _ip("link", "add", probe, "type", "bridge", check=False)
                if r.returncode != 0:
                    _available = (False, f"cannot create a bridge: {r.stderr.strip()}")
                else:
                    _ip("link", "del", probe, check=False)
                    _available = (True, "")
    return _available


def _links() -> list[str]:
    r = _ip("-o", "link", "show", check=False)
    names = []
    for line in r.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def _netns() -> list[str]:
    r = _ip("netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _ours(name: str, prefix: str) -> bool:
    # "<prefix>-<i>", "<prefix>br", "<prefix>v<i>", "<prefix>p<i>": the prefix then one of - b v p
    return name.startswith(prefix) and len(name) > len(prefix) and name[len(prefix)] in "-bvp" and \
        (name[len(prefix) + 1:].isdigit() or name[len(prefix):] == "br")


def leftovers(prefix: str) -> list[str]:
    """Names of namespaces and links built with ``prefix`` that still exist."""
    return [f"netns {n}" for n in _netns() if _ours(n, prefix)] + \
        [f"link {n}" for n in _links() if _ours(n, prefix)]


def _ns_pids(ns: str) -> list[int]:
    r = _ip("netns", "pids", ns, check=False)
    return [int(x) for x in r.stdout.split() if x.isdigit()]


def _kill_pids(pids: Sequence[int], grace_s: float) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        if alive:
            time.sleep(0.05)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def cleanup(prefix: str, grace_s: float = _KILL_GRACE_S) -> list[str]:
    """Tear down everything named with ``prefix`` (processes inside its namespaces, links,
    namespaces), whoever built it.  Returns what is left (empty when all went)."""
    namespaces = [n for n in _netns() if _ours(n, prefix)]
    pids = [p for ns in namespaces for p in _ns_pids(ns)]
    if pids:
        _kill_pids(pids, grace_s)
    for name in _links():
        if _ours(name, prefix) and not name.endswith("br"):
            _ip("link", "del", name, check=False)
    for name in _links():
        if _ours(name, prefix):
            _ip("link", "del", name, check=False)
    for ns in namespaces:
        _ip("netns", "del", ns, check=False)
    return leftovers(prefix)


def _pick_subnet() -> ipaddress.IPv4Network:
    """A random 10.X.Y.0/24 that overlaps no route or address of the root namespace (nor one
    of another cluster's hosts: those live in their namespaces, but their bridges are here)."""
    taken: list[ipaddress.IPv4Network] = []
    for args in (("-4", "route", "show", "table", "all"), ("-4", "-o", "addr", "show")):
        for line in _ip(*args, check=False).stdout.split("\n"):
            for word in line.split():
                if "/" in word or word.count(".") == 3:
                    try:
                        taken.append(ipaddress.ip_network(word, strict=False))
                    except ValueError:
                        pass
    taken += _ns_subnets()
    rng = random.SystemRandom()
    for _ in range(1000):
        net = ipaddress.ip_network(f"10.{rng.randrange(1, 255)}.{rng.randrange(0, 256)}.0/24")
        if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
            return net
    raise ClusterError("no free 10.x.y.0/24 subnet")


def _ns_subnets() -> list[ipaddress.IPv4Network]:
    out = []
    for ns in _netns():
        r = _ip("-n", ns, "-4", "-o", "addr", "show", check=False)
        for line in r.stdout.splitlines():
            words = line.split()
            if "inet" in words:
                try:
                    out.append(ipaddress.ip_network(words[words.index("inet") + 1], strict=False))
                except (ValueError, IndexError):
                    pass
    return [n for n in out if not n.is_loopback]


_live: "set[Cluster]" = set()  # strong references: an unclosed cluster is torn down at exit, even if dropped
_hooks_installed = False
_hooks_lock = threading.Lock()


def _close_all() -> None:
    for c in list(_live):  # close() removes it
        try:
            c.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def _on_sigterm(signum, frame):  # noqa: ARG001
    _close_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise SystemExit(128 + signum)


def _install_hooks() -> None:
    global _hooks_installed
    with _hooks_lock:
        if _hooks_installed:
            return
        _hooks_installed = True
        atexit.register(_close_all)
        # SIGTERM kills without running atexit; take it over only where nobody else handles it
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _on_sigterm)


class Cluster:
    """Fake hosts ``hosts`` (names of your choosing), each a network namespace with its own
    address; a context manager whose exit always tears everything down."""

    def __init__(self, hosts: Sequence[str], *, rate_mbit: float | None = None, prefix: str | None = None,
                 kill_grace_s: float = _KILL_GRACE_S):
        ok, why = available()
        if not ok:
            raise ClusterError(why)
        hosts = list(hosts)
        if not hosts or len(set(hosts)) != len(hosts) or len(hosts) > _MAX_HOSTS:
            raise ValueError(f"hosts must be 1..{_MAX_HOSTS} distinct names, got {hosts}")
        self.prefix = prefix if prefix is not None else "ts" + os.urandom(2).hex()
        if not (1 <= len(self.prefix) <= _MAX_PREFIX) or not self.prefix.replace("_", "").isalnum():
            raise ValueError(f"prefix must be 1..{_MAX_PREFIX} letters/digits, got {self.prefix!r}")
        if leftovers(self.prefix):
            raise ClusterError(f"prefix {self.prefix!r} is in use: {leftovers(self.prefix)}")
        self.hosts = hosts
        self.bridge = f"{self.prefix}br"
        self._index = {h: i + 1 for i, h in enumerate(hosts)}
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self.kill_grace_s = kill_grace_s
        self._lock = threading.Lock()
        _install_hooks()
        _live.add(self)
        try:
            self.subnet = _pick_subnet()
            self._build(rate_mbit)
        except BaseException:
            self.close()
            raise

    # -- names -----------------------------------------------------------------------------
    def netns(self, host: str) -> str:
        return f"{self.prefix}-{self._index[host]}"

    def veth(self, host: str) -> tuple[str, str]:
        """(root-side, namespace-side) interface names of ``host``'s link."""
        i = self._index[host]
        return f"{self.prefix}v{i}", f"{self.prefix}p{i}"

    def addr(self, host: str) -> str:
        return str(self.subnet.network_address + self._index[host])

    def expose(self) -> str:
        """Give the bridge an address (``.254`` of the cluster's /24) so that processes of
        the root namespace (a test, ``slurmctld``, Slurm's client commands) reach every host
        and every host reaches them there; returns that address.  Opt-in: it adds one
        connected route for the cluster's own subnet, which goes away with the bridge in
        ``close()``.  Idempotent."""
        gw = str(self.subnet.network_address + 254)
        r = _ip("-4", "-o", "addr", "show", "dev", self.bridge, check=False)
        if gw not in r.stdout:
            _ip("addr", "add", f"{gw}/{self.subnet.prefixlen}", "dev", self.bridge)
        return gw

    def pids(self, host: str) -> list[int]:
        """Every process inside ``host``'s namespace."""
        return _ns_pids(self.netns(host))

    def kill_host(self, host: str, grace_s: float | None = None) -> None:
        """The host "dies": every process inside its namespace gets SIGTERM, then SIGKILL
        after ``grace_s`` (the namespace and its link stay; restart things with ``spawn``)."""
        _kill_pids(self.pids(host), self.kill_grace_s if grace_s is None else grace_s)

    # -- building --------------------------------------------------------------------------
    def _build(self, rate_mbit: float | None) -> None:
        _ip("link", "add", self.bridge, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        _ip("link", "set", self.bridge, "up")
        for h in self.hosts:
            ns = self.netns(h)
            outer, inner = self.veth(h)
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(h)}/{self.subnet.prefixlen}", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            if rate_mbit is not None:
                self.set_rate(h, rate_mbit)
        if len(self.hosts) >= 2:
            self._check_reachable(self.hosts[0], self.hosts[1])

    def _check_reachable(self, a: str, b: str, timeout_s: float = 10.0) -> None:
        """A TCP connection from ``a`` to ``b`` (plain Python on both ends: no ping needed)."""
        port = 20000 + random.randrange(20000)
        server = ("import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
                  f"s.bind(({self.addr(b)!r}, {port})); s.listen(1); s.settimeout({timeout_s}); "
                  "c,_=s.accept(); c.sendall(b'ok'); c.close()")
        client = ("import socket,sys,time\n"
                  f"end=time.monotonic()+{timeout_s}\n"
                  "while True:\n"
                  "    try:\n"
                  f"        c=socket.create_connection(({self.addr(b)!r}, {port}), timeout=1)\n"
                  "        sys.exit(0 if c.recv(2)==b'ok' else 1)\n"
                  "    except OSError:\n"
                  "        if time.monotonic()>end: sys.exit(1)\n"
                  "        time.sleep(0.05)\n")
        srv = self.spawn(b, [sys.executable, "-c", server], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            r = self.run(a, [sys.executable, "-c", client], timeout=timeout_s + 5)
            if r.returncode == 0:
                return
        finally:
            if srv.poll() is None:
                srv.kill()
            srv.wait(timeout=5)
        nf = ""
        try:
            with open("/proc/sys/net/bridge/bridge-nf-call-iptables") as f:
                if f.read().strip() == "1":
                    nf = " (net.bridge.bridge-nf-call-iptables=1: the machine's iptables FORWARD chain " \
                         "sees bridged traffic; allow it or set that sysctl to 0)"
        except OSError:
            pass
        raise ClusterError(f"{a} ({self.addr(a)}) cannot reach {b} ({self.addr(b)}) over {self.bridge}{nf}")

    # -- knobs -----------------------------------------------------------------------------
    def set_rate(self, host: str, mbit: float | None) -> None:
        """Cap ``host``'s link at ``mbit`` Mbit/s each way (TBF on both veth ends); None lifts it."""
        outer, inner = self.veth(host)
        ns = self.netns(host)
        for dev, pre in ((outer, ()), (inner, ("-n", ns))):
            if mbit is None:
                _tc(*pre, "qdisc", "del", "dev", dev, "root", check=False)
                continue
            if mbit <= 0:
                raise ValueError(f"rate must be > 0 Mbit/s, got {mbit}")
            rate_bps = int(mbit * 1e6)
            burst = max(32 * 1024, rate_bps // 8 // 250)  # at least one timer tick's worth
            _tc(*pre, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_bps}bit",
                "burst", str(burst), "latency", "100ms")

    def set_link(self, host: str, up: bool) -> None:
        """Cut (``up=False``) or restore ``host``'s link to the bridge."""
        outer, _ = self.veth(host)
        _ip("link", "set", outer, "up" if up else "down")

    # -- processes -------------------------------------------------------------------------
    def _argv(self, host: str, argv: Sequence[str]) -> list[str]:
        if self._closed:
            raise ClusterError("cluster is closed")
        return ["nsenter", f"--net={NETNS_DIR}/{self.netns(host)}", "--", *map(str, argv)]

    def spawn(self, host: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              stdout: Any = None, stderr: Any = None, cwd: Any = None) -> subprocess.Popen:
        """Start ``argv`` inside ``host`` in its own session (process group); tracked, so
        ``close()`` ends it.  ``env`` is the whole environment, as for ``Popen`` (None:
        this process's)."""
        proc = subprocess.Popen(self._argv(host, argv), env=None if env is None else dict(env), stdout=stdout,
                                stderr=stderr, cwd=cwd, start_new_session=True)
        with self._lock:
            self._procs.append(proc)
        return proc

    def run(self, host: str, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        """A short command inside ``host`` (``subprocess.run``; output captured as text and a
        30 s timeout unless given)."""
        kw.setdefault("timeout", 30)
        if "stdout" not in kw and "stderr" not in kw:
            kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self._argv(host, argv), **kw)

    @property
    def procs(self) -> list[subprocess.Popen]:
        with self._lock:
            return list(self._procs)

    # -- teardown --------------------------------------------------------------------------
    def close(self, grace_s: float | None = None) -> None:
        """Kill the tracked process groups (TERM, KILL after ``grace_s``, default the
        constructor's ``kill_grace_s``) and anything else left in the namespaces, delete veths,
        bridge and namespaces.  Idempotent."""
        if grace_s is None:
            grace_s = self.kill_grace_s
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs = list(self._procs)
        try:
            live = [p for p in procs if p.poll() is None]
            for p in live:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + grace_s
            for p in live:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            for p in procs:  # the group may outlive its leader
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                try:
                    p.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            cleanup(self.prefix, grace_s)
            _live.discard(self)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        hosts = ", ".join(f"{h}={self.addr(h)}" for h in self.hosts)
        return f"Cluster({self.prefix}: {hosts})"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m turnscale.cluster.netns", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cleanup", metavar="PREFIX", help="tear down namespaces, links and processes named PREFIX...")
    ap.add_argument("--list", metavar="PREFIX", help="list what is left with PREFIX")
    ap.add_argument("--check", action="store_true", help="say whether a cluster can be built here")
    args = ap.parse_args(argv)
    if args.check:
        ok, why = available()
        print("available" if ok else f"unavailable: {why}")
        return 0 if ok else 1
    if args.list:
        print("\n".join(leftovers(args.list)))
        return 0
    if args.cleanup:
        left = cleanup(args.cleanup)
        if left:
            print("left behind:\n" + "\n".join(left), file=sys.stderr)
            return 1
        return 0
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())

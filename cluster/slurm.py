"""A real Slurm on this machine for tests: one ``slurmctld`` and ``slurmd`` daemons, no munge.

Debian 12's ``slurm-wlm`` (22.05) with ``AuthType=auth/none``, ``CredType=cred/none``,
``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``, one-second scheduler
intervals, per-node spool folders, and node ``Features`` standing for actor pools (count-only
GRES does not register in this setup).  Without ``net`` nodes are declared on the loopback
address, one slurmd each with its own port (``NodeName=... Port=``): use one node there
(several slurmd on one address need Slurm's multiple-slurmd build); several nodes take
``net`` (below).  Everything lives
in one folder; commands (``sbatch``, ``squeue``, ``scancel``) get ``SLURM_CONF`` through ``env()``
(and jobs a ``TMPDIR`` inside the folder).

Several nodes (``net``: a ``cluster.netns.Cluster`` with one host per node name): each slurmd
runs inside its node's network namespace (``nsenter --net=``), declared at that host's
address, so the jobs it starts live there too (a learner job publishes its node's address);
``slurmctld`` and the client commands stay in the root namespace and are reached at the
bridge address (``Cluster.expose()``).  A node joins at run time with ``join_node``: a
dynamic node (``slurmd -Z --conf "CPUs=.. Features=.."``, which Slurm 22.05 accepts once
``MaxNodeCount`` is set: ``max_nodes``), registering at its namespace's address and taking jobs
of the default partition (``Nodes=ALL``).  A node declared with ``start=False`` stays DOWN
until ``start_node`` (also the way to bring a killed node back); ``kill_node`` kills
every process on the node at once (its slurmd and the jobs' processes), as a crashed host.

Teardown (``close``, also on failure): every job of this cluster is cancelled, the daemons
get SIGTERM then SIGKILL by pid, and any process still running whose command line names this
cluster's folder (the jobs' own processes: slurmstepd, the scripts and what they exec) is
killed by pid.  Needs root (the daemons run as ``SlurmUser=root``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence


def available() -> tuple[bool, str]:
    """(True, "") when a fake cluster can run here, else (False, why)."""
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "squeue", "scancel") if shutil.which(b) is None]
    if missing:
        return False, f"Slurm not installed ({', '.join(missing)} missing; apt-get install slurm-wlm)"
    if os.geteuid() != 0:
        return False, "the Slurm daemons need root"
    return True, ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Node:
    name: str
    features: tuple[str, ...] = ()
    cpus: int = 8
    start: bool = True  # False: declared, but its slurmd starts only with FakeSlurm.start_node


@dataclass
class FakeSlurm:
    """See the module docstring.  ``nodes``: one slurmd each."""

    folder: Path
    nodes: Sequence[Node]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    net: Any = None  # a cluster.netns.Cluster with a host per node: one slurmd per namespace
    max_nodes: int = 0  # > 0: MaxNodeCount, room for dynamic nodes (join_node)

    def __post_init__(self) -> None:
        self.folder = Path(self.folder).resolve()
        self.conf = self.folder / "slurm.conf"
        self.ctld_port = _free_port()
        self.node_ports = {n.name: _free_port() for n in self.nodes}
        if self.net is not None:
            missing = [n.name for n in self.nodes if n.name not in self.net.hosts]
            if missing:
                raise ValueError(f"nodes {missing} have no host in {self.net!r}")

    def env(self) -> dict[str, str]:
        """The environment for the daemons and client commands, and so (``sbatch`` exports it)
        for every job: ``SLURM_CONF``, and ``TMPDIR`` inside this cluster's folder, so what jobs
        put in the temp folder (``torchrun``'s ``torchelastic_*``) goes with the test's folder."""
        tmp = self.folder / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return {**os.environ, "SLURM_CONF": str(self.conf), "TMPDIR": str(tmp)}

    def write_conf(self) -> None:
        f = self.folder
        for d in ("state", "spool", "logs"):
            (f / d).mkdir(parents=True, exist_ok=True)
        for n in self.nodes:
            (f / "spool" / n.name).mkdir(exist_ok=True)
        host = socket.gethostname().split(".")[0]
        ctld = self.net.expose() if self.net is not None else "127.0.0.1"
        lines = [
            "ClusterName=tsfake", f"SlurmctldHost={host}({ctld})", f"SlurmctldPort={self.ctld_port}",
            "AuthType=auth/none", "CredType=cred/none", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none", "SlurmUser=root", "SlurmdUser=root", "MpiDefault=none",
            f"StateSaveLocation={f}/state", f"SlurmdSpoolDir={f}/spool/%n",
            f"SlurmctldPidFile={f}/slurmctld.pid", f"SlurmdPidFile={f}/slurmd-%n.pid",
            f"SlurmctldLogFile={f}/logs/slurmctld.log", f"SlurmdLogFile={f}/logs/slurmd-%n.log",
            "SchedulerType=sched/backfill", "SchedulerParameters=bf_interval=1,sched_interval=1",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "ReturnToService=2",
            "SlurmdParameters=config_overrides", "KillWait=30", "SlurmdTimeout=30", "InactiveLimit=0", "MinJobAge=5",
        ]
        for n in self.nodes:
            feats = f" Features={','.join(n.features)}" if n.features else ""
            addr = self.net.addr(n.name) if self.net is not None else "127.0.0.1"
            lines.append(f"NodeName={n.name} NodeAddr={addr} NodeHostname={host} Port={self.node_ports[n.name]} "
                         f"CPUs={n.cpus} RealMemory=4000{feats} State=UNKNOWN")
        if self.max_nodes:
            lines.append(f"MaxNodeCount={self.max_nodes}")
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def start(self, timeout_s: float = 60) -> None:
        self.write_conf()
        env = self.env()
        logs = self.folder / "logs"
        self.procs["slurmctld"] = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(self.conf)], env=env, stdin=subprocess.DEVNULL,
            stdout=open(logs / "slurmctld.out", "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        for n in self.nodes:
            if n.start:
                self._slurmd(n.name)
        self.wait_up([n.name for n in self.nodes if n.start], timeout_s)

    def _slurmd(self, name: str) -> None:
        argv = ["slurmd", "-D", "-N", name, "-f", str(self.conf)]
        out = open(self.folder / "logs" / f"slurmd-{name}.out", "ab")
        if self.net is not None:  # inside the node's namespace; nsenter execs, so the pid is slurmd's
            self.procs[f"slurmd-{name}"] = self.net.spawn(name, argv, env=self.env(), stdout=out, stderr=subprocess.STDOUT)
        else:
            self.procs[f"slurmd-{name}"] = subprocess.Popen(argv, env=self.env(), stdin=subprocess.DEVNULL, stdout=out,
                                                           stderr=subprocess.STDOUT, start_new_session=True)

    def wait_up(self, names: Sequence[str], timeout_s: float = 60) -> None:
        """Until every node in ``names`` is usable (idle, mix or alloc)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None and name.removeprefix("slurmd-") in (*names, "slurmctld"):
                    raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.tail(name)}")
            states = self.node_states()
            if all(states.get(n) in ("idle", "mix", "alloc") for n in names):
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm nodes {list(names)} not up after {timeout_s:.0f}s:\n{self.run(['sinfo', '-N', '-l'])}")

    def start_node(self, name: str, timeout_s: float = 60) -> None:
        """Start a node's slurmd (one declared ``start=False``, or one killed before): it
        registers and, with ``ReturnToService=2``, takes jobs once up."""
        self._slurmd(name)
        self.wait_up([name], timeout_s)

    def join_node(self, node: Node, timeout_s: float = 60) -> None:
        """A dynamic node joins the running cluster (``slurmd -Z``; needs ``net`` with a host
        named ``node.name`` and ``max_nodes``): once it is up, jobs asking for its features run
        there."""
        if self.net is None or not self.max_nodes:
            raise RuntimeError("join_node needs a FakeSlurm with net= and max_nodes > 0")
        (self.folder / "spool" / node.name).mkdir(parents=True, exist_ok=True)
        spec = f"CPUs={node.cpus} RealMemory=4000" + (f" Features={','.join(node.features)}" if node.features else "")
        argv = ["slurmd", "-D", "-Z", "--conf", spec, "-N", node.name, "-f", str(self.conf)]
        out = open(self.folder / "logs" / f"slurmd-{node.name}.out", "ab")
        self.procs[f"slurmd-{node.name}"] = self.net.spawn(node.name, argv, env=self.env(), stdout=out,
                                                          stderr=subprocess.STDOUT)
        self.wait_up([node.name], timeout_s)

    def kill_node(self, name: str) -> None:
        """The node crashes: SIGKILL to every process on it (needs ``net``: its slurmd and the
        jobs' processes, all inside its namespace).  Slurm notices when the node stops
        answering (``SlurmdTimeout``) and ends its jobs as NODE_FAIL."""
        if self.net is None:
            raise RuntimeError("kill_node needs a FakeSlurm with net= (one namespace per node)")
        self.net.kill_host(name, grace_s=0)

    def node_states(self) -> dict[str, str]:
        """Node name -> compact Slurm state (``idle``, ``alloc``, ``down*`` ...)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"])
        return {w[0]: w[1] for w in (line.split() for line in out.splitlines()) if len(w) == 2}

    def run(self, cmd: Sequence[str], timeout_s: float = 30) -> str:
        r = subprocess.run(list(cmd), env=self.env(), capture_output=True, text=True, timeout=timeout_s)
        return r.stdout + r.stderr

    def idle_nodes(self) -> int:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"])
        return sum(1 for line in out.splitlines() if line.split()[-1:] in (["idle"], ["mix"], ["alloc"]))

    def jobs(self) -> list[tuple[str, str, str]]:
        """(job id, name, state) of every job in the queue."""
        out = self.run(["squeue", "-h", "-o", "%i %j %T"])
        return [tuple(line.split()[:3]) for line in out.splitlines() if len(line.split()) >= 3]  # type: ignore[misc]

    def tail(self, name: str, lines: int = 30) -> str:
        p = self.folder / "logs" / f"{name}.out"
        try:
            return "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self, grace_s: float = 10) -> None:
        try:
            if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
                self.run(["scancel", "--full", "--user=root"], timeout_s=20)
                deadline = time.monotonic() + grace_s
                while self.jobs() and time.monotonic() < deadline:
                    time.sleep(0.5)
        except (OSError, subprocess.SubprocessError):
            pass
        for p in self.procs.values():
            _stop(p.pid, grace_s)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for pid in self.stray_pids():
            _stop(pid, grace_s)

    def stray_pids(self) -> list[int]:
        """Processes whose command line or environment names this cluster's folder (its jobs)."""
        me, mark = os.getpid(), str(self.folder).encode()
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == me:
                continue
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read()
                with open(f"/proc/{d}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            if mark in cmd or mark in env:
                out.append(int(d))
        return out


def _stop(pid: int, grace_s: float) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            pass
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass

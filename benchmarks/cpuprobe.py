"""CPU time of processes and of the whole machine, read from ``/proc`` (Linux), so a
benchmark can say how busy each role was over a window.

``sample(roles)`` takes ``{role: [pid, ...]}`` and returns a ``CpuSample``: per role the
sum of user + system CPU seconds of its processes and their descendants (all threads; a
process that has exited counts 0 from then on), and the machine's busy CPU seconds (every process,
other sessions' included: ``/proc/stat`` minus idle and iowait).  ``cores_between``
turns two samples into cores used per role (CPU seconds / wall seconds); on an ``n``-core
machine ``machine`` <= n, and ``machine`` minus the roles' sum is what everything else
on the box took.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu_s(pid: int, *, reaped_children: bool = False) -> float:
    """User + system CPU seconds of process ``pid`` (its threads included), plus with
    ``reaped_children`` those of its children that exited and were waited for; 0 when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return 0.0
    fields = data[data.rindex(b")") + 2:].split()  # after "pid (comm) ": state is field 0
    ticks = int(fields[11]) + int(fields[12])
    if reaped_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _TICK


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids of every process now running."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        ppid = int(data[data.rindex(b")") + 2:].split()[1])
        out.setdefault(ppid, []).append(int(name))
    return out


def tree_cpu_s(pids: Sequence[int], children: Mapping[int, list[int]] | None = None) -> float:
    """CPU seconds of ``pids`` and all their descendants, live or exited and waited for
    (a child that exits moves its time into its parent's ``cutime``, so the sum does not
    drop when it goes; one not yet waited for is a zombie and still counts itself)."""
    kids = _children() if children is None else children
    total, todo, seen = 0.0, list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += proc_cpu_s(pid, reaped_children=True)
        todo.extend(kids.get(pid, ()))
    return total


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (all cores, all processes)."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    total = sum(parts[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return (total - idle) / _TICK


@dataclass(frozen=True)
class CpuSample:
    t: float
    """Wall clock (``time.time()``), comparable with the learner's metric records."""
    roles: Mapping[str, float] = field(default_factory=dict)
    """CPU seconds per role."""
    machine: float = 0.0
    """Busy CPU seconds of the whole machine."""


def sample(roles: Mapping[str, Sequence[int]], *, descendants: bool = True) -> CpuSample:
    """``descendants=False``: only the listed processes (no walk over every ``/proc`` entry,
    ~100x cheaper: for processes known to start none, sampled at short notice)."""
    kids = _children() if descendants else {}
    return CpuSample(time.time(), {r: tree_cpu_s(pids, kids) for r, pids in roles.items()}, machine_busy_s())


def cores_between(samples: Sequence[CpuSample], t0: float, t1: float) -> dict[str, float]:
    """Cores used per role (and ``machine``) between the last sample at or before ``t0`` and
    the first at or after ``t1`` (the nearest ones when the samples do not reach that far).
    Empty with fewer than two samples or no time between them."""
    if len(samples) < 2:
        return {}
    before = [s for s in samples if s.t <= t0]
    after = [s for s in samples if s.t >= t1]
    a = before[-1] if before else samples[0]
    b = after[0] if after else samples[-1]
    dt = b.t - a.t
    if dt <= 0:
        return {}
    out = {r: max(0.0, b.roles.get(r, 0.0) - a.roles.get(r, 0.0)) / dt for r in b.roles}
    out["machine"] = max(0.0, b.machine - a.machine) / dt
    return out

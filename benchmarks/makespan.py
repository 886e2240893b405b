"""Ideal makespans of a rollout workload: lock-step vs. work-conserving (pure functions).

The e2e benchmark measures asynchronous against synchronous training; this module says
what perfect overlap *could* give on the very episode costs the run sampled, so the
achieved speed-up can be reported as a fraction of the ideal one.

Model.  A workload is the sequence of groups the learner trained on, in training order,
each with a duration (the wall time of its slowest episode: a group is done when all its
episodes are).  ``slots`` groups can run at once (actors x leases per actor).  Optionally
each training step costs ``train_s`` seconds on the learner.

* Lock-step (AgentGym-RL, ``max_staleness = 0``): step ``i`` takes groups
  ``[i*B, (i+1)*B)``, list-schedules them on the slots (each group, in order, goes to the
  earliest-free slot), waits for the last one (barrier), then trains for ``train_s``
  while every slot idles.
* Work-conserving (perfect asynchrony), in steady state: no slot ever idles and
  training overlaps rollouts, so the time is the later of the total rollout work spread
  over the slots (``sum(durations) / slots``) and the training time
  (``steps * train_s``: the learner is the bottleneck when that is larger).  No drain
  tail and no exposed last training step: the benchmark's rates run from the end of one
  optimizer step to the end of another, while more groups are in flight.

The ratio is what removing the barrier can buy on these costs: >= 1, and the measured
speed-up over it is the asynchronous system's efficiency.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence


def list_schedule_makespan(durations: Sequence[float], slots: int) -> float:
    """Makespan of greedy list scheduling: each job, in order, starts on the earliest-free
    of ``slots`` identical machines.  0 for no jobs."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    for d in durations:
        if not d >= 0 or math.isinf(d):
            raise ValueError(f"durations must be finite and >= 0, got {d}")
    free = [0.0] * min(slots, max(1, len(durations)))
    for d in durations:
        t = heapq.heappop(free)
        heapq.heappush(free, t + d)
    return max(free) if len(durations) else 0.0


def lockstep_makespan(durations: Sequence[float], slots: int, groups_per_step: int, train_s: float = 0.0) -> float:
    """Lock-step: one barrier per ``groups_per_step`` groups, then ``train_s`` of training.
    A trailing partial step counts as a step."""
    if groups_per_step < 1:
        raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
    total = 0.0
    for i in range(0, len(durations), groups_per_step):
        total += list_schedule_makespan(durations[i : i + groups_per_step], slots) + train_s
    return total


def work_conserving_makespan(durations: Sequence[float], slots: int, groups_per_step: int, train_s: float = 0.0) -> float:
    """No barrier, no idle slot, training overlapped (steady state, see the module docstring)."""
    if groups_per_step < 1 or slots < 1:
        raise ValueError(f"groups_per_step and slots must be >= 1, got {groups_per_step}, {slots}")
    for d in durations:
        if not d >= 0 or math.isinf(d):
            raise ValueError(f"durations must be finite and >= 0, got {d}")
    steps = math.ceil(len(durations) / groups_per_step)
    return max(float(sum(durations)) / slots, steps * train_s)


def ideal_speedup(durations: Sequence[float], slots: int, groups_per_step: int, train_s: float = 0.0) -> float:
    """Lock-step makespan over work-conserving makespan; 1.0 for an empty workload.
    Always >= 1: every lock-step step lasts at least its work over the slots, plus its
    training."""
    ws = work_conserving_makespan(durations, slots, groups_per_step, train_s)
    if ws <= 0:
        return 1.0
    return lockstep_makespan(durations, slots, groups_per_step, train_s) / ws

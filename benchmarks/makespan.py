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
* Work-conserving (perfect asynchrony): all groups, in order, go to the earliest-free
  slot with no barrier; training overlaps with rollouts, so the makespan is the later of
  the rollout makespan and the training time (``steps * train_s``: the learner is the
  bottleneck when that is larger).  Steady state: the last step's training, which can
  only start after its groups are in, is not counted, as the benchmark's rates run from
  the end of one step to the end of another.

Both use the same greedy rule, so the ratio isolates the cost of the barrier.
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
    """No barrier: groups flow onto free slots; training overlaps rollouts (steady state,
    see the module docstring)."""
    if groups_per_step < 1:
        raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
    steps = math.ceil(len(durations) / groups_per_step)
    return max(list_schedule_makespan(durations, slots), steps * train_s)


def ideal_speedup(durations: Sequence[float], slots: int, groups_per_step: int, train_s: float = 0.0) -> float:
    """Lock-step makespan over work-conserving makespan; 1.0 for an empty workload.
    Always >= 1: greedy list scheduling is monotone in the slots' free times and the
    barrier only delays them, and lock-step also pays every step's training."""
    ws = work_conserving_makespan(durations, slots, groups_per_step, train_s)
    if ws <= 0:
        return 1.0
    return lockstep_makespan(durations, slots, groups_per_step, train_s) / ws

"""The task stream of one env: which ``data_idx`` the learner hands out next.

A split spec (``env.tasks.<split>``) is a range ``"start:stop"``, a comma list ``"3,5,9"``
or the path of a JSON file holding AgentGym-RL's item list or a plain list of ints; the one
parser is ``conf.tasks`` (eval uses it too).  ``parse_task_spec`` turns a spec into ``Task``
records (bad specs raise ``TaskSpecError`` naming the spec and what to fix).

Ordering contract of ``TaskStream.next``:

1. tasks given back with ``reissue`` (expired leases, failed groups, leases in flight at a
   checkpoint) come first, oldest first;
2. otherwise the epoch's permutation, ``numpy.random.default_rng([seed, epoch])``, read
   from ``position``; at the end of a permutation the epoch advances and position resets.

The state (``TaskCursor`` plus the re-issue queue) is plain data for checkpoints;
``TaskStream.from_state`` continues exactly where the saved stream stopped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from turnscale.conf import tasks as conf_tasks
from turnscale.conf.tasks import TaskSpecError
from turnscale.protocol.messages import Task

__all__ = ["TaskCursor", "TaskSpecError", "TaskStream", "parse_task_spec"]


@dataclass(frozen=True, slots=True)
class TaskCursor:
    """Where the stream stands: ``position`` within epoch ``epoch``'s permutation."""

    epoch: int = 0
    position: int = 0


def parse_task_spec(spec: str, env: str, split: str = "train") -> list[Task]:
    """A task spec (``conf.tasks``) -> tasks of ``env`` (in spec/file order)."""
    return [Task(env=env, data_idx=i, split=split, task_id=tid) for i, tid in conf_tasks.parse_task_spec(spec, env, split)]


class TaskStream:
    """Endless, epoch-shuffled stream of one split's tasks (see the module docstring)."""

    def __init__(self, tasks: Sequence[Task], *, seed: int = 0, cursor: TaskCursor = TaskCursor(),
                 reissued: Iterable[Task] = ()) -> None:
        if not tasks:
            raise TaskSpecError("a task stream needs at least one task")
        self.tasks = list(tasks)
        self.seed = seed
        self.cursor = cursor
        self._reissued: deque[Task] = deque(reissued)
        self._perm_epoch = -1
        self._perm: np.ndarray = np.empty(0, dtype=np.int64)
        if not 0 <= cursor.position <= len(self.tasks):
            raise TaskSpecError(f"cursor position {cursor.position} outside [0, {len(self.tasks)}]")

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.tasks))
            self._perm_epoch = epoch
        return self._perm

    def next(self) -> Task:
        """The next task (re-issued ones first)."""
        if self._reissued:
            return self._reissued.popleft()
        epoch, pos = self.cursor.epoch, self.cursor.position
        if pos >= len(self.tasks):
            epoch, pos = epoch + 1, 0
        task = self.tasks[int(self._permutation(epoch)[pos])]
        self.cursor = TaskCursor(epoch, pos + 1)
        return task

    def reissue(self, task: Task) -> None:
        """Give a task back; it is handed out again before any new one."""
        self._reissued.append(task)

    @property
    def pending_reissue(self) -> list[Task]:
        return list(self._reissued)

    def state(self, extra_reissue: Iterable[Task] = ()) -> dict[str, Any]:
        """Checkpointable plain data; ``extra_reissue`` (tasks of leases in flight) is queued after the current re-issue queue."""
        queue = [*self._reissued, *extra_reissue]
        return {
            "epoch": self.cursor.epoch,
            "position": self.cursor.position,
            "seed": self.seed,
            "num_tasks": len(self.tasks),
            "reissue": [[t.env, t.data_idx, t.split, t.task_id] for t in queue],
        }

    @classmethod
    def from_state(cls, tasks: Sequence[Task], state: dict[str, Any]) -> "TaskStream":
        if state.get("num_tasks") != len(tasks):
            raise TaskSpecError(f"checkpoint's task stream had {state.get('num_tasks')} tasks, the config gives {len(tasks)}; "
                                "resume with the same env.tasks")
        reissued = [Task(env=e, data_idx=int(i), split=s, task_id=tid) for e, i, s, tid in state.get("reissue", [])]
        return cls(tasks, seed=int(state["seed"]), cursor=TaskCursor(int(state["epoch"]), int(state["position"])), reissued=reissued)

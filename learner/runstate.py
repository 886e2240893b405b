"""The learner run's state, with one owner (and one writer) per piece.

``RunState`` (held by ``learner.service.LearnerService``) is what a run *is* beyond the
model: which step it reached, which policy version it published, which learner process
this is.  Everything else reads it; nothing keeps a copy.

============================  ==========================================================
state                         owner (the only writer)
============================  ==========================================================
``step``                      ``RunState.advance``, called by the service's train loop as
                              soon as a step the trainer took returns (``load`` on resume).
                              The trainer's own ``step`` counts its optimizer steps (its
                              state, saved with the optimizer); resume checks both agree.
``turn_limit``                not stored: ``schedule.limit_at(step)``, so it moves exactly
                              when ``step`` does (before the step's publication).
``version``                   ``RunState.publish``, called by the service once the weights
                              of that version are pullable (``load`` on resume).
``run_id``                    made at the first start, kept across resumes (``load``).
``incarnation``               made at every start, never persisted.
``trained_groups``            ``RunState.advance`` (groups the step trained).
task cursor, leases,          ``learner.leases.LeaseManager`` (it owns the ``TaskStream``);
admission counter             it *reads* ``version`` and ``turn_limit`` from this object
                              (``LeaseManager.policy``), nobody pushes them into it.
============================  ==========================================================

Checkpoints: ``state()`` is the run's part of the checkpoint's ``extra`` (the service adds
the lease manager's ``leases`` entry); the trainer saves model, optimizer and RNG state.
``load`` accepts checkpoints written before schema 3, which also stored a ``turn_limit``
(ignored: it follows from the step and the schedule).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol


class ScheduleLike(Protocol):
    def limit_at(self, step: int) -> int: ...


def _new_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass
class RunState:
    """See the module docstring for who writes what."""

    schedule: ScheduleLike
    step: int = 0
    """Optimizer steps the run has completed (written by ``advance`` and ``load`` only)."""
    version: int = 0
    """Latest policy version whose weights are published (``publish`` and ``load`` only)."""
    trained_groups: int = 0
    """Groups trained so far, over the whole run."""
    run_id: str = field(default_factory=_new_id)
    """Names the run; kept across resumes."""
    incarnation: str = field(default_factory=_new_id)
    """Names this learner process; new on every start (sent in every announcement)."""

    @property
    def turn_limit(self) -> int:
        """Turn limit for leases issued now: the schedule's limit at ``step``."""
        return int(self.schedule.limit_at(self.step))

    def advance(self, step: int, groups: int) -> None:
        """The trainer took a step: the run is now at ``step``, ``groups`` more were trained."""
        if step <= self.step:
            raise ValueError(f"step {step} does not advance the run (at step {self.step})")
        self.step = step
        self.trained_groups += groups

    def publish(self, version: int) -> None:
        """The weights of ``version`` can be pulled from now on."""
        self.version = version

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """The run's part of a checkpoint's ``extra`` (JSON-able)."""
        return {"step": self.step, "version": self.version, "run_id": self.run_id, "trained_groups": self.trained_groups}

    def load(self, extra: Mapping[str, Any], *, trainer_step: int) -> None:
        """Continue from a checkpoint's ``extra``; ``trainer_step`` is the step the trainer
        restored from the same checkpoint (they must agree)."""
        if int(extra["step"]) != trainer_step:
            raise RuntimeError(f"checkpoint says step {extra['step']} but the trainer restored step {trainer_step}")
        self.step = trainer_step
        self.version = int(extra["version"])
        self.run_id = str(extra.get("run_id", self.run_id))
        self.trained_groups = int(extra.get("trained_groups", 0))

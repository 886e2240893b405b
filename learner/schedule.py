"""ScalingInter-RL turn-limit schedule, keyed to the learner's optimizer step.

Stage ``i`` (limit ``turns[i]``) is in force while the number of COMPLETED optimizer steps
``s`` satisfies ``i * every <= s < (i + 1) * every``; the last stage lasts forever.  A
lease issued after ``s`` steps carries ``limit_at(s)``.  The stage is a pure function of
the step, and a checkpoint stores the step it was taken at, so resuming at any step —
including exactly on a boundary — continues in the same stage and visits every later
stage.  (AgentGym-RL counts from the resumed step off by one and can skip a stage.)
``state_dict`` records turns, every and the stage so a resume under a changed schedule
is detected instead of silently jumping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ScheduleMismatch(ValueError):
    """A checkpoint's schedule differs from the configured one."""


@dataclass(frozen=True)
class TurnSchedule:
    turns: list[int]
    """Turn limit of each stage, in order (one entry: a fixed limit)."""
    every: int
    """Optimizer steps per stage."""

    def __post_init__(self) -> None:
        if not self.turns or any(int(t) <= 0 for t in self.turns):
            raise ValueError(f"schedule.turns must be a non-empty list of positive ints, got {self.turns}")
        if self.every <= 0:
            raise ValueError(f"schedule.every must be > 0, got {self.every}")
        object.__setattr__(self, "turns", [int(t) for t in self.turns])

    @classmethod
    def from_config(cls, cfg: Any) -> "TurnSchedule":
        """From ``conf.schema.ScheduleConfig``."""
        return cls(turns=list(cfg.turns), every=int(cfg.every))

    def stage_at(self, step: int) -> int:
        """Stage index in force after ``step`` completed optimizer steps."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return min(step // self.every, len(self.turns) - 1)

    def limit_at(self, step: int) -> int:
        """Turn limit in force after ``step`` completed optimizer steps."""
        return self.turns[self.stage_at(step)]

    def next_boundary(self, step: int) -> int | None:
        """First step > ``step`` at which the limit changes; None in the last stage."""
        stage = self.stage_at(step)
        return None if stage == len(self.turns) - 1 else (stage + 1) * self.every

    def state_dict(self, step: int) -> dict[str, Any]:
        """What a checkpoint taken after ``step`` steps stores (JSON-able)."""
        return {"turns": list(self.turns), "every": self.every, "step": step, "stage": self.stage_at(step)}

    def check_resume(self, state: dict[str, Any] | None, step: int) -> int:
        """Verify a checkpoint's schedule state against this schedule at ``step``; returns
        the stage.  Raises ``ScheduleMismatch`` if turns/every changed or the stored stage
        is not the one this step implies (a corrupt or hand-edited checkpoint).  A
        checkpoint without schedule state (``None``) resumes at ``stage_at(step)``."""
        if state is None:
            return self.stage_at(step)
        if list(state.get("turns", [])) != self.turns or int(state.get("every", -1)) != self.every:
            raise ScheduleMismatch(
                f"checkpoint schedule turns={state.get('turns')} every={state.get('every')} differs from the "
                f"configured turns={self.turns} every={self.every}; resume with the checkpoint's schedule "
                "(schedule.turns=... schedule.every=...) or start a new run"
            )
        if int(state.get("step", step)) != step or int(state.get("stage", -1)) != self.stage_at(step):
            raise ScheduleMismatch(
                f"checkpoint says step {state.get('step')} stage {state.get('stage')}, but step {step} is stage {self.stage_at(step)}"
            )
        return self.stage_at(step)

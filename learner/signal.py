"""Is there anything for RL to learn from?  A warning when almost every group is degenerate.

GRPO, RLOO and REINFORCE++ learn from reward differences *inside* a group: a group whose
episodes all got the same reward has zero advantage and teaches nothing.  When the warm start
is too weak for the chosen levels (every episode fails), or the tasks are too easy (every
episode succeeds), training runs, the loss moves, and nothing is learned — and nothing told
the user why.  ``SignalWatch`` looks at the last ``window`` trained groups; once at least
``window`` have been seen and more than ``threshold`` of them had equal rewards it returns a
warning naming the cause (all failing vs all succeeding) and the knobs that change it.  It
warns again only after another full window, so a long run without signal says so every
``window`` groups, not every step.

Pure logic, no I/O: the learner's service feeds it each trained group's rewards and logs what
it returns; ``fraction`` is also a metric (``rollout/equal_reward_frac``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

EQUAL_ATOL = 1e-6


class SignalWatch:
    """Fraction of degenerate groups (all rewards equal) over the last ``window`` groups."""

    def __init__(self, window: int = 64, threshold: float = 0.9) -> None:
        if window < 1 or not 0.0 < threshold <= 1.0:
            raise ValueError("SignalWatch needs window >= 1 and 0 < threshold <= 1")
        self.window = window
        self.threshold = threshold
        self._kinds: deque[str] = deque(maxlen=window)  # "fail" | "success" | "mixed" per group
        self._since_warning = 0  # groups seen since the last warning (or since the start)

    def observe(self, rewards: Sequence[float], successes: Sequence[bool]) -> str | None:
        """Record one trained group (its episodes' rewards and success flags); a warning when
        the window has no signal."""
        if not rewards:
            return None
        if max(rewards) - min(rewards) > EQUAL_ATOL:
            kind = "mixed"
        else:
            kind = "success" if successes and all(successes) else "fail"
        self._kinds.append(kind)
        self._since_warning += 1
        if self._since_warning < self.window or self.fraction <= self.threshold:
            return None
        self._since_warning = 0
        return self._message()

    @property
    def fraction(self) -> float:
        """Degenerate groups / groups in the window (0.0 before any group)."""
        if not self._kinds:
            return 0.0
        return sum(k != "mixed" for k in self._kinds) / len(self._kinds)

    def _message(self) -> str:
        n = len(self._kinds)
        fail = sum(k == "fail" for k in self._kinds)
        success = sum(k == "success" for k in self._kinds)
        head = (f"no learning signal: {self.fraction:.0%} of the last {n} groups had equal rewards "
                f"(all failed: {fail}, all succeeded: {success}), so their advantages are zero. ")
        if fail >= success:
            return head + ("The policy almost never succeeds on these tasks: warm-start longer (run.warm_start.steps, "
                           "run.warm_start.episodes), raise the turn limit (schedule.turns), raise algo.group_size "
                           "so that a rare success lands in a group, or choose easier tasks (env.options.levels).")
        return head + ("The policy almost always succeeds on these tasks: choose harder tasks (env.options.levels), "
                       "lower the turn limit (schedule.turns), or stop training: there is little left to learn.")

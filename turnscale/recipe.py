"""Fit ``turnscale run``'s recipe to the chosen level mix, and say when RL will have no signal.

The default run was calibrated on the BabyAI GoTo mix; a user's first change is another
``env.options.levels``.  Levels differ by how many turns they need (GoToRedBall: 1-3 actions;
KeyInBox: ~12), so one fixed recipe (oracle episodes capped at 8 turns, turn limits
[3, 5, 8], evaluation within 3 turns, 20 SFT steps) either drops most warm-start data or
gives RL groups that always fail: every reward equal, zero advantage, nothing learned.

``run.adapt`` makes the launcher:

1. **survey** the mix: the oracle plays the warm-up tasks with a generous cap
   (``run.adapt_max_turns``), giving per level the share it solves and the turns it needs;
   the same plays become the warm-start conversations (nothing is played twice);
2. **fit** the turn limits to what the levels need (``fit``): the longest stage covers the
   75th percentile of the oracle's turns on the longest level, the first stage its median, the
   stages between are geometric steps; the held-out evaluation uses the longest stage, and
   the context budget grows to hold it (``fit_context``, measured with the model's
   tokenizer; capped by the model's positions, which then cap the turn limits).  A mix
   the configured schedule already covers keeps it unchanged (the calibrated default stays as
   it is);
3. **warm-start until there is signal**: after each SFT round the launcher measures success
   per level on a probe of *training* tasks (never the held-out ones) and predicts the share
   of GRPO groups with mixed rewards, ``1 - p^G - (1 - p)^G`` per level (``mixed_fraction``);
   below ``run.warm_start.min_mixed`` another round of SFT follows, up to
   ``run.warm_start.rounds``; ``advice`` says what happened and what to change.

Pure logic apart from ``survey`` (which plays the oracle in process); the launcher does the I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

PERCENTILE = 0.75
"""The longest stage covers this share of the oracle's solved episodes on the longest level
(the long tail of a level costs context and compute out of proportion: KeyInBox's oracle
needs <= 11-16 turns on three quarters of its tasks, 24 on nine tenths)."""
TOKENS_PERCENTILE = 0.9
"""Tokens per turn are budgeted at this share of the warm-start conversations."""


@dataclass(frozen=True)
class LevelSurvey:
    """The oracle's play of one level's warm-up tasks."""

    level: str
    played: int
    turns: tuple[int, ...]
    """Turns of each solved episode (sorted)."""

    @property
    def solved(self) -> int:
        return len(self.turns)

    @property
    def solve_rate(self) -> float:
        return self.solved / self.played if self.played else 0.0

    def quantile(self, q: float) -> int:
        """The ``q`` quantile of the solved episodes' turns (nearest rank; 0 when none)."""
        if not self.turns:
            return 0
        return self.turns[min(len(self.turns) - 1, max(0, math.ceil(q * len(self.turns)) - 1))]


def survey_runs(runs: Iterable[tuple]) -> list[LevelSurvey]:
    """Per-level surveys of oracle runs ``(data_idx, steps, success, return, category)``
    (``warmstart.oracle_runs``), in the order levels first appear."""
    played: dict[str, int] = {}
    turns: dict[str, list[int]] = {}
    for _, steps, success, _, level in runs:
        played[level] = played.get(level, 0) + 1
        turns.setdefault(level, [])
        if success and steps:
            turns[level].append(len(steps))
    return [LevelSurvey(lvl, played[lvl], tuple(sorted(turns[lvl]))) for lvl in played]


@dataclass(frozen=True)
class Fit:
    """The turn limits fitted to a mix (``fit``)."""

    horizon: int
    """Turns the longest level needs (``PERCENTILE`` of its oracle episodes)."""
    schedule: tuple[int, ...]
    eval_turns: int
    max_turns: int
    """Oracle episodes longer than this are left out of the warm start."""
    changed: bool
    notes: tuple[str, ...] = field(default=())


def stretch(turns: Sequence[int], first: int, last: int) -> tuple[int, ...]:
    """``len(turns)`` strictly increasing turn limits from ``first`` (lowered when there is no
    room) to ``last``, geometric steps between (``[3, 5, 8]`` stretched to 5..16 -> ``(5, 9, 16)``)."""
    n = len(turns)
    if n == 1:
        return (last,)
    first = max(1, min(first, last - (n - 1)))  # room for n strictly increasing limits
    out: list[int] = []
    for k in range(n):
        v = round(first * (last / first) ** (k / (n - 1)))
        out.append(max(v, out[-1] + 1) if out else v)
    out[-1] = last
    return tuple(out)


def fit(surveys: Sequence[LevelSurvey], schedule: Sequence[int], eval_turns: int, max_turns: int, cap: int) -> Fit:
    """Turn limits for the surveyed mix.  Never shortens what is configured: a mix whose
    longest level fits in the configured last stage keeps schedule, ``eval_turns`` and
    ``max_turns`` as they are.  Levels the oracle rarely solves within ``cap`` are named
    in ``notes`` (drop them, or raise ``run.adapt_max_turns``)."""
    notes = [f"{s.level}: the oracle solves only {s.solved}/{s.played} warm-up tasks within {cap} turns; "
             f"RL gets little warm-start data for it (drop the level or raise run.adapt_max_turns)"
             for s in surveys if s.played and s.solve_rate < 0.5]
    solved = [s for s in surveys if s.turns]
    if not solved:
        return Fit(0, tuple(schedule), eval_turns, max_turns, False, tuple(notes) + ("the oracle solved no warm-up task",))
    longest = max(solved, key=lambda s: s.quantile(PERCENTILE))
    horizon = min(cap, longest.quantile(PERCENTILE))
    if horizon <= max(schedule):
        return Fit(horizon, tuple(schedule), eval_turns, max(max_turns, horizon), False, tuple(notes))
    first = max(schedule[0], longest.quantile(0.5))
    new = stretch(schedule, first, horizon)
    notes.append(f"{longest.level} needs {horizon} turns ({PERCENTILE:.0%} of oracle episodes): turn limits "
                 f"{list(schedule)} -> {list(new)}, evaluation within {horizon} turns")
    return Fit(horizon, new, horizon, max(max_turns, horizon), True, tuple(notes))


CONTEXT_MARGIN = 1.25
"""Sampled turns run longer than the oracle's (an action may use all of ``max_new_tokens``)."""
CONTEXT_ROUND = 256


@dataclass(frozen=True)
class ContextFit:
    """The context budget for the fitted horizon (``fit_context``)."""

    tokens: int
    """``sampling.max_context_tokens`` to use."""
    horizon: int
    """The longest turn limit that fits in ``tokens`` (the fitted horizon unless capped)."""
    per_turn: float
    first_prompt: int
    note: str = ""


def fit_context(lengths: Sequence[tuple[int, int, int]], horizon: int, configured: int, model_max: int) -> ContextFit:
    """Context tokens for episodes of ``horizon`` turns, from the warm-start conversations'
    ``(first prompt tokens, total tokens, turns)``: the longest first prompt plus ``horizon``
    times the ``TOKENS_PERCENTILE`` tokens per turn, with ``CONTEXT_MARGIN``, rounded up.  Never
    below ``configured``; at most ``model_max`` (the model's positions), in which case the
    horizon is lowered to what fits and the note says so.  An episode that runs out of
    context ends with ``finish=context_limit``, unsolved: a turn limit the context cannot hold
    only adds failures."""
    rows = [(i, t, n) for i, t, n in lengths if n > 0 and t > i]
    if not rows:
        return ContextFit(configured, horizon, 0.0, 0)
    per = sorted((t - i) / n for i, t, n in rows)
    per_turn = per[min(len(per) - 1, math.ceil(TOKENS_PERCENTILE * len(per)) - 1)] * CONTEXT_MARGIN
    first = max(i for i, _, _ in rows)
    need = first + horizon * per_turn
    tokens = max(configured, min(model_max, CONTEXT_ROUND * math.ceil(need / CONTEXT_ROUND)))
    fits = max(1, int((tokens - first) // per_turn))
    if fits >= horizon:
        note = "" if tokens == configured else (f"{horizon} turns of ~{per_turn:.0f} tokens need ~{need:.0f} tokens: "
                                                f"sampling.max_context_tokens {configured} -> {tokens}")
        return ContextFit(tokens, horizon, per_turn, first, note)
    return ContextFit(tokens, fits, per_turn, first,
                      f"{horizon} turns of ~{per_turn:.0f} tokens need ~{need:.0f} tokens, more than the model's {model_max} "
                      f"positions: turn limits capped at {fits} (a model with more positions would allow more)")


def round_steps(steps: int, round_: int) -> int:
    """SFT steps of warm-start round ``round_`` (1-based): ``steps`` doubled each round, so
    round k ends at ``steps * (2**k - 1)`` cumulative steps.  A round that did not give RL
    signal needs a real change in the policy, not the same small nudge again (three equal
    rounds of 20 left mix C's probe at 0)."""
    if steps < 0 or round_ < 1:
        raise ValueError(f"round_steps: steps must be >= 0 and round_ >= 1, got {steps}, {round_}")
    return steps * 2 ** (round_ - 1)


def mixed_fraction(p: float, group_size: int) -> float:
    """Probability that a group of ``group_size`` independent episodes with success
    probability ``p`` has both a success and a failure (non-zero GRPO advantage)."""
    p = min(max(p, 0.0), 1.0)
    return 1.0 - p ** group_size - (1.0 - p) ** group_size


def predicted_mixed(success: dict[str, float], group_size: int) -> float:
    """Mean ``mixed_fraction`` over levels (each level weighs the same, as in the task mix)."""
    if not success:
        return 0.0
    return sum(mixed_fraction(p, group_size) for p in success.values()) / len(success)


@dataclass(frozen=True)
class Advice:
    verdict: str
    """``enough``: RL has signal; ``more_sft``: another round would help; ``warn``: none left."""
    message: str


def advice(success: dict[str, float], group_size: int, min_mixed: float, rounds_left: int) -> Advice:
    """What the launcher does after a warm-start round with per-level probe ``success``."""
    mixed = predicted_mixed(success, group_size)
    solved = bool(success) and all(p >= 0.95 for p in success.values())
    if mixed >= min_mixed:
        return Advice("enough", f"predicted {mixed:.0%} of groups with mixed rewards (>= {min_mixed:.0%}): RL has signal")
    if rounds_left > 0 and not solved:
        return Advice("more_sft", f"predicted {mixed:.0%} of groups with mixed rewards (< {min_mixed:.0%}): another SFT round")
    dead = sorted(lvl for lvl, p in success.items() if mixed_fraction(p, group_size) < 0.1)
    if solved:
        cause = "the warm start already solves almost every task: make the mix harder or evaluate within fewer turns"
    else:
        cause = ("the warm start rarely succeeds: raise run.warm_start.rounds/steps/episodes, algo.group_size, "
                 "or the turn limits (schedule.turns), or drop levels it cannot do")
    return Advice("warn", f"WARNING: only {mixed:.0%} of GRPO groups are predicted to have mixed rewards; "
                          f"{cause}" + (f" (near-zero signal on: {', '.join(dead)})" if dead else ""))


def survey_lines(surveys: Sequence[LevelSurvey]) -> list[str]:
    """One readable line per level."""
    return [f"{s.level}: oracle solves {s.solved}/{s.played}, turns median {s.quantile(0.5)}, "
            f"p75 {s.quantile(0.75)}, p90 {s.quantile(0.9)}, max {s.turns[-1] if s.turns else 0}" for s in surveys]

"""An expert for BabyAI that speaks the env's high-level actions (tests, SFT warm starts).

How it decides: minigrid's ``BabyAIBot`` is attached to the live instance and kept in sync
with every primitive the env executes (``BabyAIEnv.on_primitive``).  To choose the next
high-level action the oracle copies (env, bot), lets the copy play primitives until its
first interaction (pickup / drop / toggle) or the mission's end, then picks, in order:

1. the high-level action that performs that interaction on the same cell (``pickup <obj>
   <k>``, ``toggle and go through <door> <k>`` when the bot walks through next, ``toggle``,
   ``drop``) or reaches the object the mission ends facing (``go to <obj> <k>``), even if
   its path differs from the bot's;
2. ``go to <obj> <k>`` facing the door or box the bot will toggle next;
3. otherwise the movement action (``go to ...``, ``go through ...``, ``move forward``,
   ``turn ...``) whose primitives are the longest prefix of the bot's own path.

A jump (1, 2) is taken only if a copy of the bot, fed the jump's primitives, agrees with
each interaction when it happens; so the live bot never sees a deviation to undo.

So sequences are short (an object in view is one action away) and deterministic (same
task -> same actions).  The bot cannot solve every level (minigrid documents
PutNextS7N4Carrying and KeyInBox as failures); when it gives up a small script takes over
for those two mission shapes.  Known unsolvable: minigrid 3.2's strict ``Debug`` levels
verify the second ``open`` of an ``after you``/``before`` pair against the same toggle, so
e.g. OpenDoorsOrderN4Debug seed 0 fails for every agent.

Bounded: minigrid's bot can loop forever on some layouts (UnlockToUnlock seed 48, task
1948: ``replan`` keeps pushing subgoals; 24 of the level's first 64 seeds do).  The bot's
subgoal stack is a ``BoundedStack``: a push beyond ``MAX_SUBGOALS`` subgoals raises
``BotGaveUp``, which counts as the bot giving up (the script takes over).  The bound is a
count, not a clock, so the expert stays deterministic on a loaded machine; the server's call
deadline (``envhub.workers``) remains the backstop for anything else.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

from turnscale.envhub.babyai_prims import DONE, DROP, FORWARD, LEFT, PICKUP, RIGHT, TOGGLE, quiet_stdout

_VEC = ((1, 0), (0, 1), (-1, 0), (0, -1))  # minigrid DIR_TO_VEC
MAX_SUBGOALS = 256
"""Deeper bot subgoal stacks than this only happen when the bot loops (a sane plan needs < 20)."""


class BotGaveUp(Exception):
    """The bot's plan grew past ``MAX_SUBGOALS`` (it was looping)."""


class BoundedStack(list):
    """The bot's subgoal stack; a push past ``MAX_SUBGOALS`` raises ``BotGaveUp``.  Copies
    (the oracle's look-ahead deep-copies the bot) stay bounded."""

    def append(self, item) -> None:
        if len(self) >= MAX_SUBGOALS:
            raise BotGaveUp(f"bot plan exceeded {MAX_SUBGOALS} subgoals")
        super().append(item)

    def __deepcopy__(self, memo):
        out = BoundedStack()
        memo[id(self)] = out
        out.extend(copy.deepcopy(x, memo) for x in self)
        return out
MOVES = (LEFT, RIGHT, FORWARD)


@dataclass(frozen=True)
class Plan:
    """The bot copy's path from the current state: ``states[0]`` is now, each later entry
    after one movement primitive; ``event`` is what happens at ``states[-1]``."""

    states: tuple[tuple[tuple[int, int], int], ...]
    event: str
    """``pickup`` | ``drop`` | ``toggle`` | ``success`` | ``stuck``."""
    target: tuple[int, int] | None
    """The cell faced at ``states[-1]``."""
    walks_through: bool
    """After a toggle the bot moves forward next."""
    prims: tuple[int, ...] = ()
    """The bot's movement primitives from ``states[0]`` to ``states[-1]``."""


class BabyAIOracle:
    """The expert for one live ``BabyAIEnv`` episode; create it right after ``reset``."""

    def __init__(self, env: BabyAIEnv, horizon: int = 512) -> None:
        from minigrid.utils.baby_ai_bot import BabyAIBot

        self.env = env
        self.horizon = horizon
        self.failed = ""
        self._queue: list[str] = []
        self._explore = 0
        self.bot = BabyAIBot(env.unwrapped)
        self.bot.stack = BoundedStack(self.bot.stack)
        self.suggest = self._replan(self.bot, None)
        env.on_primitive = self._observe

    def _replan(self, bot, action):
        try:
            with quiet_stdout():
                return int(bot.replan(action))
        except Exception as exc:  # the bot gives up (e.g. DisappearedBoxError, BotGaveUp)
            if bot is self.bot or isinstance(exc, BotGaveUp):  # a copy failing only rules out that plan
                self.failed = f"{type(exc).__name__}: {exc}"
            return None

    def _observe(self, prim: int) -> None:
        if not self.failed:
            self.suggest = self._replan(self.bot, prim)

    def _state(self, u) -> tuple[tuple[int, int], int]:
        return (int(u.agent_pos[0]), int(u.agent_pos[1])), int(u.agent_dir)

    def plan(self) -> Plan:
        """Roll a copy of (env, bot) forward to the bot's next interaction or the end."""
        u = self.env.unwrapped
        if self.failed or self.suggest is None:
            return Plan((self._state(u),), "stuck", None, False)
        u2, bot2 = copy.deepcopy((u, self.bot))
        self._plan_bot = bot2
        states = [self._state(u2)]
        prims: list[int] = []
        act = self.suggest
        for _ in range(self.horizon):
            pos, d = states[-1]
            front = (pos[0] + _VEC[d][0], pos[1] + _VEC[d][1])
            if act in (PICKUP, DROP, TOGGLE):
                walks = False
                if act == TOGGLE:
                    _, r, term, _, _ = u2.step(act)
                    walks = not term and self._replan(bot2, act) == FORWARD
                return Plan(tuple(states), {PICKUP: "pickup", DROP: "drop", TOGGLE: "toggle"}[act], front, walks, tuple(prims))
            if act not in MOVES and act != DONE:
                break
            _, r, term, trunc, _ = u2.step(act)
            if act != DONE:
                states.append(self._state(u2))
                prims.append(act)
            if term and r > 0:
                pos, d = states[-1]
                return Plan(tuple(states), "success", (pos[0] + _VEC[d][0], pos[1] + _VEC[d][1]), False, tuple(prims))
            if term or trunc:
                break
            act = self._replan(bot2, act)
            if act is None:
                break
        return Plan(tuple(states), "stuck", None, False, tuple(prims))

    def next_action(self) -> str:
        """The expert's next high-level action for the live instance (always an available one)."""
        env = self.env
        if self.failed:
            return self._scripted()
        plan = self.plan()
        if self.failed:
            return self._scripted()
        by_pos = {o.abs_pos: o for o in env.view.objects}
        target = by_pos.get(plan.target) if plan.target is not None else None
        here = len(plan.states) == 1
        pick, expect = None, None
        if plan.event == "pickup" and target is not None:
            pick = f"pickup {target.name} {target.k}"
        elif plan.event == "drop" and here:
            pick = "drop"
        elif plan.event == "toggle" and target is not None:
            through = f"toggle and go through {target.name} {target.k}"
            if target.kind == "door" and plan.walks_through and through in env.actions:
                pick = through
            elif here:
                pick = "toggle"
            else:
                pick, expect = f"go to {target.name} {target.k}", TOGGLE
        elif plan.event == "success" and target is not None:
            pick, expect = f"go to {target.name} {target.k}", "success"
        if pick is not None and pick in env.actions:
            for share in (True, False):
                if self._accepts(env.actions[pick], share, expect):
                    if share:
                        self._share_knowledge(self.bot)
                    return pick
        return self._follow(plan)

    def _scripted(self) -> str:
        """After the bot gave up: a small script for the two mission shapes it cannot do
        (KeyInBox: the key is in a box; PutNext while already carrying)."""
        env, acts = self.env, self.env.actions
        if self._queue:
            nxt = self._queue.pop(0)
            if nxt in acts:
                return nxt
            self._queue.clear()
        seen = env.view.objects
        carrying = env.view.carrying
        m = re.match(r"put the (\w+ \w+) next to the (\w+ \w+)", env.mission)
        if m and carrying is not None and f"{carrying.color} {carrying.type}" == m.group(1):
            for o in seen:
                if o.name == m.group(2) and f"go to {o.name} {o.k}" in acts:
                    self._queue = ["turn left", "move forward", "turn right", "drop"]
                    return f"go to {o.name} {o.k}"
        if carrying is not None and carrying.type == "key":
            for o in seen:
                if o.kind == "door" and o.color == carrying.color and o.name.split()[1] in ("locked", "closed"):
                    through = f"toggle and go through {o.name} {o.k}"
                    return through if through in acts else f"go to {o.name} {o.k}"
        elif carrying is None:
            for kind in ("key", "box"):
                for o in seen:
                    if o.kind != kind:
                        continue
                    if kind == "key" and f"pickup {o.name} {o.k}" in acts:
                        return f"pickup {o.name} {o.k}"
                    if kind == "box":
                        if env.view.front_cell is not None and env.view.front_cell.type == "box":
                            return "toggle"
                        if f"go to {o.name} {o.k}" in acts:
                            return f"go to {o.name} {o.k}"
        self._explore += 1
        if self._explore % 4 and "move forward" in acts:
            return "move forward"
        return "turn left"

    def _share_knowledge(self, bot) -> None:
        """Give ``bot`` what the plan's copy saw and drop its exploratory subgoals (so a jump
        past its exploration is not mistaken for a deviation)."""
        bot.vis_mask |= self._plan_bot.vis_mask
        if bot.stack and bot.stack[-1].is_exploratory():
            suggest = self._replan(bot, None)
            if bot is self.bot:
                self.suggest = suggest

    def _accepts(self, prims: list[int], share: bool, expect: int | str | None = None) -> bool:
        """Would the bot agree with every interaction of ``prims`` at the moment it happens
        (and, with ``expect``, end up suggesting that primitive or have completed the mission)?
        Checked on a copy; the live bot then goes through the same (deterministic) replans."""
        u2, bot2 = copy.deepcopy((self.env.unwrapped, self.bot))
        failed, suggest = self.failed, self.suggest
        try:
            if share:
                bot2.vis_mask |= self._plan_bot.vis_mask
                if bot2.stack and bot2.stack[-1].is_exploratory():
                    suggest = self._replan(bot2, None)
            for p in prims:
                if p in (PICKUP, DROP, TOGGLE) and suggest != p:
                    return False
                if p == FORWARD and prims[-2:] == [TOGGLE, FORWARD] and suggest != FORWARD:
                    return False
                _, r, term, trunc, _ = u2.step(p)
                if term or trunc:
                    return bool(r > 0) or expect is None
                suggest = self._replan(bot2, p)
                if suggest is None:
                    return False
            return expect is None or suggest == expect
        finally:
            self.failed = failed

    def _follow(self, plan: Plan) -> str:
        """The movement action whose primitives are the longest prefix of the bot's own path
        (the same cells, so the bot sees what it planned to see and keeps its plan)."""
        best, best_len = None, 0
        for text, prims in self.env.actions.items():
            n = len(prims)
            if n > best_len and all(p in MOVES for p in prims) and tuple(prims) == plan.prims[:n]:
                best, best_len = text, n
        if best is not None:
            return best
        first = self.suggest
        return {LEFT: "turn left", RIGHT: "turn right"}.get(first, "move forward" if "move forward" in self.env.actions else "turn left")

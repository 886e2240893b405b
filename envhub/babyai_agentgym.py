"""AgentGym's BabyAI text, byte for byte: the view description, the available-action map and
the error texts that ``agentenv-babyai``'s ``BabyAI.postprocess_obs`` / ``step`` produce.

This is a statement of their rules in our own code (``envhub.babyai``'s cleaner rendering is
the ``text: clean`` option).  Their rules, which the clean text changes on purpose:

* **Objects** are the cells of the encoded 7x7 view (``obs["image"]``; unseen cells are type 0)
  of type door / key / ball / box / goal / lava / wall, except the agent's own cell, sorted
  by Manhattan distance (stable over the scan: far row first, left to right).  Walls are
  objects too (they count for "you can see several objects" and block paths) but are not
  described.  Each described object is ``There is a <name> <k> <where>.  `` (two spaces),
  numbered per name over *all* objects.
* **Barriers**: wall and box cells straight ahead; ``You are facing a <wall|box> <n> steps
  away. `` names the nearest by type only.
* **Paths** (``find_path``): breadth-first over (position, direction) from the agent, moves
  tried forward, left, right; a position is blocked when outside the view's x/y ranges (their
  formula, which includes the column behind the agent) or when an object whose name contains
  wall, box, lava, ball or key is on it (doors, open or not, and the goal never block);
  states are marked visited when taken from the queue, so a state can be queued twice and its
  parent is the last one that queued it.  ``arrive``: stand on the target; else face it.
* **Actions** (dict order): ``turn left``, ``turn right``, ``move forward`` (no barrier or the
  nearest farther than 1), ``pickup <name> <k>`` (when not carrying; key/ball/box/lava with a
  path, numbered over reachable objects only), ``drop``, door actions (``go through <c> open
  door <k>``, ``toggle and go through <c> closed|locked door <k>`` — locked only with the key of
  its color — and ``toggle`` when already facing a closed/locked door), ``go to goal``, ``go to
  <name> <k>`` (doors too, numbered over reachable objects), ``check available actions``.
* **Mission**: ``then`` and ``after you`` are replaced by ``and`` (substring replacement).

Pure functions of the unwrapped minigrid env and its last encoded observation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

_TYPES = ("unseen", "empty", "wall", "floor", "door", "key", "ball", "box", "goal", "lava", "agent")
_COLORS = ("red", "green", "blue", "purple", "yellow", "grey")
_STATES = ("open", "closed", "locked")
_DIRS = ((1, 0), (0, 1), (-1, 0), (0, -1))  # minigrid's DIR_TO_VEC: right, down, left, up
_OBJECT_TYPES = ("door", "key", "ball", "box", "goal", "lava", "wall")
_BLOCKING = ("wall", "box", "lava", "ball", "key")
CHECK = "check available actions"


def agentgym_mission(mission: str) -> str:
    """AgentGym's goal text: ``then`` and ``after you`` become ``and`` (substring replacement)."""
    if "then" in mission:
        mission = mission.replace("then", "and")
    if "after you" in mission:
        mission = mission.replace("after you", "and")
    return mission


@dataclass(frozen=True)
class Seen:
    name: str
    """``red ball``, ``grey wall``, ``blue locked door``."""
    pos: tuple[int, int]
    """World position."""
    dis: int
    """Manhattan distance from the agent."""


@dataclass(frozen=True)
class Scene:
    """What AgentGym computes from one observation."""

    description: str
    actions: dict[str, list[int]]
    """Available action text -> minigrid primitives, in AgentGym's order."""
    errors: dict[str, str]
    """Unavailable action text -> AgentGym's explanation."""


def _ranges(pos: tuple[int, int], f: tuple[int, int], r: tuple[int, int], vs: int) -> tuple[range, range]:
    top = (pos[0] + f[0] * (vs - 1) - r[0] * (vs // 2), pos[1] + f[1] * (vs - 1) - r[1] * (vs // 2))
    border = (top[0] + vs * (r[0] - f[0]), top[1] + vs * (r[1] - f[1]))
    xr = range(border[0], top[0] + 1) if border[0] < top[0] else range(top[0], border[0])
    yr = range(border[1], top[1] + 1) if border[1] < top[1] else range(top[1], border[1])
    return xr, yr


def find_path(start: tuple[int, int], d0: int, goal: tuple[int, int], blocked: set[tuple[int, int]],
              xr: range, yr: range, *, arrive: bool) -> list[int] | None:
    """AgentGym's breadth-first search (see the module docstring); None when unreachable."""
    parent: dict[tuple[tuple[int, int], int], tuple[tuple[tuple[int, int], int], int]] = {}
    visited: set[tuple[tuple[int, int], int]] = set()
    queue = deque([(start, d0)])
    while queue:
        state = queue.popleft()
        visited.add(state)
        pos, d = state
        dv = _DIRS[d]
        if (pos == goal) if arrive else ((goal[0] - pos[0], goal[1] - pos[1]) == dv):
            path: list[int] = []
            while state != (start, d0):
                state, act = parent[state]
                path.append(act)
            return path[::-1]
        for act in (2, 0, 1):
            if act == 2:
                new = ((pos[0] + dv[0], pos[1] + dv[1]), d)
            else:
                new = (pos, (d - 1) % 4 if act == 0 else (d + 1) % 4)
            if new[0][0] not in xr or new[0][1] not in yr or new in visited or new[0] in blocked:
                continue
            queue.append(new)
            parent[new] = (state, act)
    return None


def scene(u: Any, image: Any) -> Scene:
    """AgentGym's description and action map for the unwrapped env ``u`` and its last encoded
    observation ``image`` (``obs["image"]``)."""
    vs = u.agent_view_size
    pos = (int(u.agent_pos[0]), int(u.agent_pos[1]))
    d = int(u.agent_dir)
    f, r = _DIRS[d], _DIRS[(d + 1) % 4]
    top = (pos[0] + f[0] * (vs - 1) - r[0] * (vs // 2), pos[1] + f[1] * (vs - 1) - r[1] * (vs // 2))
    xr, yr = _ranges(pos, f, r, vs)
    codes = image.tolist()
    objs: list[Seen] = []
    barriers: list[tuple[str, int]] = []
    for j in range(vs):
        for i in range(vs):
            ax, ay = top[0] - f[0] * j + r[0] * i, top[1] - f[1] * j + r[1] * i
            dist = abs(pos[0] - ax) + abs(pos[1] - ay)
            if ax < 0 or ay < 0 or dist == 0:
                continue
            t, c, s = codes[i][j]
            kind, color = _TYPES[t], _COLORS[c]
            if kind in _OBJECT_TYPES:
                name = f"{color} {_STATES[s]} door" if kind == "door" else f"{color} {kind}"
                objs.append(Seen(name, (ax, ay), dist))
            if kind in ("box", "wall"):
                rel = (ax - pos[0], ay - pos[1])
                if f[0] * rel[1] - f[1] * rel[0] == 0:
                    barriers.append((kind, f[0] * rel[0] + f[1] * rel[1]))
    objs.sort(key=lambda o: o.dis)
    barriers.sort(key=lambda b: b[1])
    carrying = u.carrying
    text = _describe(objs, barriers, carrying, pos, f, r)
    actions, errors = _actions(objs, barriers, carrying, pos, d, xr, yr)
    return Scene(text, actions, errors)


def _describe(objs: list[Seen], barriers: list[tuple[str, int]], carrying: Any, pos: tuple[int, int],
              f: tuple[int, int], r: tuple[int, int]) -> str:
    if objs:
        out = "In front of you in this room, you can see several objects: "
        counts: dict[str, int] = {}
        for o in objs:
            if "wall" in o.name:
                continue
            rel = (o.pos[0] - pos[0], o.pos[1] - pos[1])
            front, right = f[0] * rel[0] + f[1] * rel[1], r[0] * rel[0] + r[1] * rel[1]
            if right == 0:
                where = f"right in front of you {front} steps away. "
            elif right > 0:
                where = f"{front} steps in front of you and {right} steps to your right. "
            else:
                where = f"{front} steps in front of you and {-right} steps to your left. "
            counts[o.name] = counts.get(o.name, 0) + 1
            out += f"There is a {o.name} {counts[o.name]} {where} "
    else:
        out = "You cannot see any objects within sight."
    out += "The room has walls around you. "
    if barriers:
        out += f"You are facing a {barriers[0][0]} {barriers[0][1]} steps away. "
    if carrying is not None:
        out += f"You are carrying a {carrying.color} {carrying.type}."
    else:
        out += "You are not carrying anything."
    return out


def _actions(objs: list[Seen], barriers: list[tuple[str, int]], carrying: Any, pos: tuple[int, int], d: int,
             xr: range, yr: range) -> tuple[dict[str, list[int]], dict[str, str]]:
    blocked = {o.pos for o in objs if any(b in o.name for b in _BLOCKING)}

    def path(goal: tuple[int, int], arrive: bool) -> list[int] | None:
        return find_path(pos, d, goal, blocked, xr, yr, arrive=arrive)

    ok: dict[str, list[int]] = {"turn left": [0], "turn right": [1]}
    why: dict[str, str] = {}
    if not barriers or barriers[0][1] > 1:
        ok["move forward"] = [2]
    else:
        why["move forward"] = "There is a barrier in front of you, you can't move forward."
    if carrying is None:
        count: dict[str, int] = {}
        for o in objs:
            if "wall" in o.name or "door" in o.name or "goal" in o.name:
                continue
            p = path(o.pos, False)
            first = f"pickup {o.name} 1"
            if p is not None:
                if first not in ok:
                    count[o.name] = 1
                    ok[first] = p + [3]
                else:
                    count[o.name] += 1
                    ok[f"pickup {o.name} {count[o.name]}"] = p + [3]
            elif first not in ok:
                why[first] = f"You cannot pickup {o.name} 1, as there is no path leading to it."
            else:
                k = count[o.name] + 1
                why[f"pickup {o.name} {k}"] = f"You cannot pickup {o.name} {k}, as there is no path leading to it."
    if carrying is not None:
        ahead = (pos[0] + _DIRS[d][0], pos[1] + _DIRS[d][1])
        if any(o.pos == ahead and any(b in o.name for b in _BLOCKING) for o in objs):
            why["drop"] = "You cannot drop the object, as there is already an object in front of you."
        else:
            ok["drop"] = [4]
    else:
        why["drop"] = "You cannot drop the object, as you are not carrying anything."
    doors: dict[str, int] = {}
    for o in objs:
        if "door" in o.name:
            doors[o.name] = doors.get(o.name, 0) + 1
        k = doors.get(o.name, 0)
        if "open door" in o.name:
            p = path(o.pos, True)
            if p is not None:
                ok[f"go through {o.name} {k}"] = p
            else:
                why[f"go through {o.name} {k}"] = f"You cannot go through {o.name} {k}, as there is no path leading to it."
        if "closed door" in o.name:
            p = path(o.pos, False)
            act = f"toggle and go through {o.name} {k}"
            if p is not None:
                ok[act] = p + [5, 2]
            else:
                why[act] = f"You cannot toggle and go through {o.name} {doors}, as there is no path leading to it."
            if p == []:
                ok["toggle"] = [5]
            why[f"go through {o.name} {k}"] = f"You cannot go through {o.name} {k}, as it is closed. You should toggle it first."
        if "locked door" in o.name:
            act = f"toggle and go through {o.name} {k}"
            if carrying is None or carrying.type != "key":
                why[act] = f"You cannot toggle and go through {o.name} {k}, as you are not carrying a key."
                continue
            if carrying.color != o.name.split(" ")[0]:
                why[act] = f"You cannot toggle and go through {o.name} {k}, as the color of the key you are carrying does not match the color of door."
                continue
            p = path(o.pos, False)
            if p is not None:
                ok[act] = p + [5, 2]
            else:
                why[act] = f"You cannot toggle and go through {o.name} {doors}, as there is no path leading to it."
            if p == []:
                ok["toggle"] = [5]
    for o in objs:
        if "goal" not in o.name:
            continue
        p = path(o.pos, True)
        if p is not None:
            ok["go to goal"] = p
        else:
            why["go to goal"] = "You cannot go to the goal, as there is no path leading to it."
    goto: dict[str, int] = {}
    for o in objs:
        if "wall" in o.name or "goal" in o.name:
            continue
        p = path(o.pos, False)
        first = f"go to {o.name} 1"
        if p is not None:
            if first not in ok:
                ok[first] = p
                goto[o.name] = 1
            else:
                goto[o.name] += 1
                ok[f"go to {o.name} {goto[o.name]}"] = p
        elif first not in ok:
            why[first] = f"You cannot go to {o.name} 1, as there is no path leading to it."
        else:
            k = goto[o.name] + 1
            why[f"go to {o.name} {k}"] = f"You cannot go to {o.name} {k}, as there is no path leading to it."
    ok[CHECK] = []
    return ok, why


def format_actions(actions: dict[str, list[int]]) -> str:
    """AgentGym's suffix: ``\\nAvailable actions: ["a", "b"]``."""
    return "\nAvailable actions: [" + ", ".join(f'"{a}"' for a in actions) + "]"

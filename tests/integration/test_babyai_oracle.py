"""The BabyAI oracle solves the 40 levels' seed-0 tasks with short, repeatable high-level actions."""

from __future__ import annotations

import pytest

pytest.importorskip("minigrid")

from turnscale.envhub.babyai import LEVELS, BabyAIEnv
from turnscale.envhub.babyai import oracle_episode, play_oracle
from turnscale.envhub.babyai_oracle import BabyAIOracle


@pytest.mark.slow
def test_oracle_solves_at_least_95_percent_of_seed0_tasks():
    runs = [play_oracle(idx, max_turns=128) for idx in range(40)]
    solved = [r.level for r in runs if r.success]
    failed = [r.level for r in runs if not r.success]
    assert len(solved) >= 38, f"oracle failed on {failed}"
    assert all(r.reward > 0 for r in runs if r.success)


def test_oracle_on_easy_levels_is_short_and_deterministic():
    names = ("GoToRedBallGrey", "GoToRedBall", "GoToRedBallNoDists", "GoToObjS6", "GoToLocalS8N7", "PickupLoc", "PickupDistDebug", "GoToDoor", "OpenRedDoor")
    easy = [LEVELS.index(f"BabyAI-{n}-v0") for n in names]
    for idx in easy:
        first = oracle_episode(idx, max_turns=20)
        assert oracle_episode(idx, max_turns=20) == first
        assert 1 <= len(first) <= 3, (LEVELS[idx], [a for _, a in first])
        assert first[0][0].startswith("Your goal: ")
        assert play_oracle(idx, 20).success


def test_a_fumbling_demonstrator_is_repeatable_longer_and_still_mostly_solves():
    """``play_oracle(action_noise=p)``: at a share p of turns a random available action, the
    oracle replanning from where it lands; the same task gives the same episode."""
    ids = [LEVELS.index(f"BabyAI-{n}-v0") + 40 * seed for n in ("GoToRedBall", "GoToObjS6", "OpenRedDoor", "PickupLoc")
           for seed in range(6)]
    clean = [play_oracle(i, 8) for i in ids]
    noisy = [play_oracle(i, 8, action_noise=0.5) for i in ids]
    assert [play_oracle(i, 8, action_noise=0.5) for i in ids[:6]] == noisy[:6]
    assert [play_oracle(i, 8, action_noise=0.0) for i in ids[:6]] == clean[:6]
    assert sum(len(r.steps) for r in noisy) > 1.3 * sum(len(r.steps) for r in clean)
    assert sum(r.success for r in noisy) >= 0.75 * len(ids)
    with pytest.raises(ValueError, match="action_noise"):
        play_oracle(ids[0], 8, action_noise=1.0)


def test_only_babyai_has_a_fumbling_demonstrator():
    from turnscale.warmstart import oracle_runs

    with pytest.raises(ValueError, match="action_noise is BabyAI's only"):
        list(oracle_runs("web", [0], max_turns=8, action_noise=0.3))


def test_oracle_actions_are_always_available_actions():
    for idx in (5, 17, 23, 37, 45):
        env = BabyAIEnv()
        env.reset(idx)
        oracle = BabyAIOracle(env)
        for _ in range(30):
            action = oracle.next_action()
            assert action in env.actions
            if env.step(action).done:
                break


def test_oracle_follows_a_live_instance_across_episodes():
    env = BabyAIEnv()
    for idx in (1, 41, 81):
        env.reset(idx)
        oracle = BabyAIOracle(env)
        for _ in range(10):
            out = env.step(oracle.next_action())
            if out.done:
                break
        assert out.done and out.info["success"]


def test_oracle_gives_up_on_a_looping_bot_instead_of_hanging():
    """Task 1948 (UnlockToUnlock seed 48): minigrid's bot pushes subgoals forever; the bounded
    stack makes the oracle hand over to its script, the same way on every run."""
    first = play_oracle(1948, max_turns=6)
    assert [a for _, a in first.steps] == [a for _, a in play_oracle(1948, max_turns=6).steps]
    env = BabyAIEnv()
    env.reset(1948)
    oracle = BabyAIOracle(env)
    assert oracle.next_action() in env.actions
    assert "BotGaveUp" in oracle.failed

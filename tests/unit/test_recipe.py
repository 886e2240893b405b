"""turnscale/recipe.py: survey, turn-limit fit, signal prediction and advice (pure logic)."""

import pytest

from turnscale import recipe
from turnscale.recipe import LevelSurvey


def runs(level, turns, unsolved=0):
    out = [(i, [("obs", "act")] * t, True, 1.0, level) for i, t in enumerate(turns)]
    return out + [(100 + i, [("obs", "act")] * 3, False, 0.0, level) for i in range(unsolved)]


def test_survey_counts_played_and_solved_turns_per_level_in_first_seen_order():
    s = recipe.survey_runs(runs("B", [4, 2]) + runs("A", [1], unsolved=3))
    assert [x.level for x in s] == ["B", "A"]
    assert s[0].turns == (2, 4) and s[0].played == 2 and s[0].solve_rate == 1.0
    assert s[1].solved == 1 and s[1].played == 4 and s[1].solve_rate == 0.25


def test_quantile_is_nearest_rank_and_zero_without_solved_episodes():
    s = LevelSurvey("L", 10, tuple(range(1, 11)))
    assert s.quantile(0.5) == 5 and s.quantile(0.9) == 9 and s.quantile(1.0) == 10
    assert LevelSurvey("L", 3, ()).quantile(0.9) == 0


def test_stretch_is_geometric_from_first_to_last_and_strictly_increasing():
    assert recipe.stretch([3, 5, 8], 5, 16) == (5, 9, 16)
    assert recipe.stretch([10], 3, 12) == (12,)
    out = recipe.stretch([1, 2, 3, 4], 3, 4)
    assert list(out) == sorted(set(out)) and len(out) == 4 and out[-1] == 4


def test_a_mix_the_schedule_covers_keeps_the_calibrated_turn_limits():
    s = [LevelSurvey("GoTo", 20, (1, 2, 2, 3, 3, 4)), LevelSurvey("GoToObj", 20, (1, 1, 2))]
    f = recipe.fit(s, [3, 5, 8], eval_turns=3, max_turns=8, cap=32)
    assert not f.changed and f.schedule == (3, 5, 8) and f.eval_turns == 3 and f.max_turns == 8


def test_a_long_mix_stretches_the_schedule_to_what_its_longest_level_needs():
    s = [LevelSurvey("Short", 10, (2,) * 10), LevelSurvey("Long", 10, (4, 5, 5, 6, 7, 9, 12, 14, 16, 30))]
    f = recipe.fit(s, [3, 5, 8], eval_turns=3, max_turns=8, cap=32)
    assert f.changed and f.horizon == 14  # the long level's 75th percentile
    assert f.schedule == (7, 10, 14)  # first stage: the long level's median (7)
    assert f.eval_turns == 14 and f.max_turns == 14
    assert any("Long needs 14 turns" in n for n in f.notes)


def test_the_fit_never_exceeds_the_cap_and_names_levels_the_oracle_rarely_solves():
    s = [LevelSurvey("Hard", 10, (40, 50)), LevelSurvey("Easy", 10, (3,) * 10)]
    f = recipe.fit(s, [3, 5, 8], eval_turns=3, max_turns=8, cap=32)
    assert f.horizon == 32 and max(f.schedule) == 32
    assert any(n.startswith("Hard: the oracle solves only 2/10") for n in f.notes)


def test_no_solved_warm_up_task_leaves_the_config_alone_and_says_so():
    f = recipe.fit([LevelSurvey("X", 5, ())], [3, 5], eval_turns=3, max_turns=8, cap=32)
    assert not f.changed and f.schedule == (3, 5) and "the oracle solved no warm-up task" in f.notes


@pytest.mark.parametrize("p,g,want", [(0.0, 8, 0.0), (1.0, 8, 0.0), (0.5, 2, 0.5), (0.1, 8, 1 - 0.1 ** 8 - 0.9 ** 8)])
def test_mixed_fraction_is_the_chance_a_group_has_a_success_and_a_failure(p, g, want):
    assert recipe.mixed_fraction(p, g) == pytest.approx(want)


def test_predicted_mixed_weighs_levels_equally():
    assert recipe.predicted_mixed({"a": 0.0, "b": 0.5}, 2) == pytest.approx(0.25)
    assert recipe.predicted_mixed({}, 8) == 0.0


def test_advice_stops_when_groups_will_have_signal():
    assert recipe.advice({"a": 0.2, "b": 0.3}, 8, 0.3, rounds_left=2).verdict == "enough"


def test_advice_asks_for_another_round_while_rounds_are_left():
    assert recipe.advice({"a": 0.0, "b": 0.01}, 8, 0.3, rounds_left=1).verdict == "more_sft"


def test_advice_warns_with_what_to_change_and_the_dead_levels_when_no_round_is_left():
    a = recipe.advice({"BabyAI-KeyInBox-v0": 0.0, "BabyAI-Pickup-v0": 0.02}, 8, 0.3, rounds_left=0)
    assert a.verdict == "warn" and a.message.startswith("WARNING")
    assert "run.warm_start.rounds" in a.message and "BabyAI-KeyInBox-v0" in a.message


def test_advice_on_a_mix_already_solved_says_it_is_too_easy_instead_of_more_sft():
    a = recipe.advice({"a": 1.0, "b": 0.99}, 8, 0.3, rounds_left=3)
    assert a.verdict == "warn" and "already solves" in a.message


def test_context_fits_the_horizon_from_the_longest_first_prompt_and_tokens_per_turn():
    lengths = [(200, 200 + 10 * 100, 10), (180, 180 + 5 * 80, 5)]  # 100 and 80 tokens per turn
    c = recipe.fit_context(lengths, horizon=24, configured=2048, model_max=4096)
    # 200 + 24 * 100 * 1.25 = 3200 -> 3328 (multiple of 256)
    assert c.tokens == 3328 and c.horizon == 24 and c.first_prompt == 200
    assert "sampling.max_context_tokens 2048 -> 3328" in c.note


def test_context_is_never_lowered_below_the_configured_budget():
    c = recipe.fit_context([(100, 400, 3)], horizon=8, configured=2048, model_max=4096)
    assert c.tokens == 2048 and c.horizon == 8 and c.note == ""


def test_a_horizon_beyond_the_models_positions_is_capped_to_what_fits_and_said():
    c = recipe.fit_context([(200, 1200, 10)], horizon=40, configured=2048, model_max=4096)
    assert c.tokens == 4096 and c.horizon == int((4096 - 200) // 125)
    assert "turn limits capped at" in c.note


def test_no_usable_conversation_keeps_the_configured_context():
    c = recipe.fit_context([(10, 10, 0)], horizon=12, configured=2048, model_max=4096)
    assert c.tokens == 2048 and c.horizon == 12


def test_each_warm_start_round_trains_twice_the_steps_of_the_one_before():
    assert [recipe.round_steps(20, k) for k in (1, 2, 3)] == [20, 40, 80]
    assert sum(recipe.round_steps(20, k) for k in (1, 2, 3)) == 20 * (2 ** 3 - 1)
    assert recipe.round_steps(0, 3) == 0
    with pytest.raises(ValueError, match="round_ >= 1"):
        recipe.round_steps(20, 0)

"""turnscale.learner.signal.SignalWatch: a run without RL signal says so, with the cause and the knobs."""

import pytest

from turnscale.learner.signal import SignalWatch


def _feed(w: SignalWatch, groups: list[tuple[list[float], list[bool]]]) -> list[str]:
    return [msg for r, s in groups for msg in [w.observe(r, s)] if msg]


def test_all_failing_groups_warn_once_per_window_with_the_warm_start_and_turn_knobs():
    w = SignalWatch(window=10, threshold=0.9)
    msgs = _feed(w, [([0.0] * 4, [False] * 4)] * 25)
    assert len(msgs) == 2  # after 10 groups and after 20, not at every group
    assert "100% of the last 10 groups had equal rewards (all failed: 10, all succeeded: 0)" in msgs[0]
    assert "run.warm_start.steps" in msgs[0] and "schedule.turns" in msgs[0] and "env.options.levels" in msgs[0]
    assert w.fraction == 1.0


def test_all_succeeding_groups_point_to_harder_tasks():
    w = SignalWatch(window=8, threshold=0.9)
    msgs = _feed(w, [([0.7] * 4, [True] * 4)] * 8)
    assert len(msgs) == 1 and "all succeeded: 8" in msgs[0] and "harder tasks" in msgs[0]


def test_groups_with_reward_differences_are_signal_and_stay_quiet():
    w = SignalWatch(window=10, threshold=0.9)
    # 8 degenerate groups out of 10 is 80%: under the threshold
    groups = [([0.0] * 4, [False] * 4)] * 8 + [([0.0, 0.9, 0.0, 0.0], [False, True, False, False])] * 2
    assert _feed(w, groups * 3) == []
    assert w.fraction == pytest.approx(0.8)


def test_no_warning_before_a_full_window():
    w = SignalWatch(window=64)
    assert _feed(w, [([0.0] * 2, [False] * 2)] * 63) == [] and w.fraction == 1.0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        SignalWatch(window=0)
    with pytest.raises(ValueError):
        SignalWatch(threshold=0.0)

"""ScalingInter-RL turn schedule: stage boundaries and resume at every boundary."""

from __future__ import annotations

import pytest

from turnscale.learner.schedule import ScheduleMismatch, TurnSchedule

S = TurnSchedule(turns=[10, 20, 30], every=100)


def test_stage_boundaries():
    assert [S.limit_at(s) for s in (0, 99, 100, 199, 200, 10_000)] == [10, 10, 20, 20, 30, 30]
    assert [S.stage_at(s) for s in (0, 99, 100, 200)] == [0, 0, 1, 2]
    assert S.next_boundary(0) == 100 and S.next_boundary(150) == 200 and S.next_boundary(250) is None


def test_a_single_entry_is_a_fixed_limit():
    fixed = TurnSchedule(turns=[7], every=3)
    assert {fixed.limit_at(s) for s in range(50)} == {7}


def _run(schedule, start, stop):
    return [schedule.limit_at(s) for s in range(start, stop)]


@pytest.mark.parametrize("resume_at", [1, 98, 99, 100, 101, 199, 200, 201, 300])
def test_resume_at_any_boundary_continues_the_same_stage_and_skips_none(resume_at):
    straight = _run(S, 0, 320)
    state = S.state_dict(resume_at)  # the checkpoint taken after resume_at completed steps
    restored = TurnSchedule(turns=[10, 20, 30], every=100)
    assert restored.check_resume(state, resume_at) == S.stage_at(resume_at)
    resumed = _run(S, 0, resume_at) + _run(restored, resume_at, 320)
    assert resumed == straight
    assert sorted(set(resumed)) == [10, 20, 30]  # every stage visited


def test_resume_one_step_before_a_boundary_keeps_the_full_next_stage():
    # AgentGym-RL's resume is off by one and can skip a stage.  Here, resuming after 99
    # steps still trains exactly 100 steps at 20 turns before moving to 30.
    restored = TurnSchedule(turns=[10, 20, 30], every=100)
    restored.check_resume(S.state_dict(99), 99)
    after = _run(restored, 99, 300)
    assert after[0] == 10 and after.count(20) == 100 and after[101:] == [30] * 100


def test_resume_under_a_changed_schedule_is_an_error():
    with pytest.raises(ScheduleMismatch, match="differs"):
        TurnSchedule(turns=[10, 20], every=100).check_resume(S.state_dict(150), 150)
    with pytest.raises(ScheduleMismatch, match="stage"):
        S.check_resume({**S.state_dict(150), "stage": 2}, 150)


def test_bad_schedules_are_rejected():
    with pytest.raises(ValueError):
        TurnSchedule(turns=[], every=10)
    with pytest.raises(ValueError):
        TurnSchedule(turns=[5], every=0)


def test_a_checkpoint_without_schedule_state_resumes_at_the_stage_of_its_step():
    assert S.check_resume(None, 150) == 1

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnscale.benchmarks.makespan import (
    ideal_speedup,
    list_schedule_makespan,
    lockstep_makespan,
    work_conserving_makespan,
)


def test_list_schedule_puts_each_job_on_the_earliest_free_slot():
    # slots: [3], [1, 1, 1] -> the short jobs share the second slot.
    assert list_schedule_makespan([3, 1, 1, 1], 2) == 3
    assert list_schedule_makespan([1, 1, 1, 3], 2) == 4  # order matters: greedy, not optimal
    assert list_schedule_makespan([2, 2, 2], 1) == 6
    assert list_schedule_makespan([], 4) == 0


def test_lockstep_waits_for_the_slowest_group_of_every_step():
    # 2 slots, 2 groups per step: step makespans 5 and 4.
    d = [5, 1, 1, 4]
    assert lockstep_makespan(d, 2, 2) == 9
    assert lockstep_makespan(d, 2, 2, train_s=0.5) == 10
    # a trailing partial step is a step
    assert lockstep_makespan([5, 1, 1], 2, 2, train_s=1) == 5 + 1 + 1 + 1


def test_work_conserving_spreads_all_work_over_the_slots():
    d = [5, 1, 1, 4]
    assert work_conserving_makespan(d, 2, 2) == 5.5
    assert ideal_speedup(d, 2, 2) == pytest.approx(9 / 5.5)


def test_training_time_overlaps_only_when_asynchronous():
    d = [1.0] * 8
    # 4 steps of 2 groups on 2 slots: rollouts 4 s; training 4 x 2 s dominates async.
    assert lockstep_makespan(d, 2, 2, train_s=2) == 4 * (1 + 2)
    assert work_conserving_makespan(d, 2, 2, train_s=2) == max(4, 8)  # the learner is the bottleneck
    assert work_conserving_makespan(d, 2, 2, train_s=0.5) == 4  # training hidden under rollouts
    assert ideal_speedup(d, 2, 2, train_s=0.5) == pytest.approx(4 * 1.5 / 4)


def test_uniform_durations_give_no_speedup():
    assert ideal_speedup([2.0] * 12, 4, 4) == pytest.approx(1.0)


def test_long_tail_gives_a_large_ideal_speedup():
    # one slow group in every step of 8: lock-step pays it every step (5 x 10 s), the
    # work-conserving schedule spreads 85 s of work over 8 slots.
    d = [10, 1, 1, 1, 1, 1, 1, 1] * 5
    assert lockstep_makespan(d, 8, 8) == 50
    assert work_conserving_makespan(d, 8, 8) == pytest.approx(85 / 8)
    assert ideal_speedup(d, 8, 8) == pytest.approx(50 / (85 / 8))


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError):
        list_schedule_makespan([1], 0)
    with pytest.raises(ValueError):
        list_schedule_makespan([-1], 2)
    with pytest.raises(ValueError):
        lockstep_makespan([1], 2, 0)
    with pytest.raises(ValueError):
        work_conserving_makespan([float("nan")], 2, 1)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), max_size=40),
    st.integers(1, 8),
    st.integers(1, 8),
    st.floats(min_value=0, max_value=10),
)
def test_barrier_never_helps(durations, slots, per_step, train_s):
    ls = lockstep_makespan(durations, slots, per_step, train_s)
    ws = work_conserving_makespan(durations, slots, per_step, train_s)
    assert ws <= ls + 1e-9
    assert ws >= sum(durations) / slots - 1e-9
    assert ideal_speedup(durations, slots, per_step, train_s) >= 1 - 1e-9

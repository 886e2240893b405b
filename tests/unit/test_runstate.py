"""``learner.runstate.RunState``: one owner for the run's step, version and identity; the
turn limit is derived, and the lease manager reads version and turn limit from it."""

from __future__ import annotations

import pytest

from turnscale.learner.leases import LeaseManager
from turnscale.learner.runstate import RunState
from turnscale.learner.schedule import TurnSchedule
from turnscale.learner.tasks import TaskStream, parse_task_spec


def test_turn_limit_follows_the_step_and_the_lease_manager_reads_it_live():
    run = RunState(TurnSchedule(turns=[3, 5], every=2))
    m = LeaseManager(stream=TaskStream(parse_task_spec("0:50", "babyai")), group_size=2, groups_per_step=1,
                     max_staleness=0, ttl_s=10.0, policy=run)
    (a,) = m.grant("a1", 5, now=0)
    assert (a.turn_limit, a.policy_version, run.turn_limit) == (3, 0, 3)
    run.advance(1, 1)
    run.advance(2, 1)
    assert run.turn_limit == 5 and m.grant("a1", 5, now=0) == []  # admission: still version 0
    run.publish(1)
    (b,) = m.grant("a1", 5, now=0)
    assert (b.turn_limit, b.policy_version, m.version, m.turn_limit) == (5, 1, 1, 5)
    with pytest.raises(ValueError, match="does not advance"):
        run.advance(2, 1)


def test_state_round_trips_and_keeps_the_run_id_but_not_the_incarnation():
    run = RunState(TurnSchedule(turns=[3, 5], every=2))
    run.advance(3, 8)
    run.publish(2)
    extra = run.state()
    assert extra == {"step": 3, "version": 2, "run_id": run.run_id, "trained_groups": 8}
    again = RunState(TurnSchedule(turns=[3, 5], every=2))
    again.load({**extra, "turn_limit": 3}, trainer_step=3)  # a pre-schema-3 checkpoint's turn_limit is ignored
    assert (again.step, again.version, again.run_id, again.trained_groups, again.turn_limit) == (3, 2, run.run_id, 8, 5)
    assert again.incarnation != run.incarnation
    with pytest.raises(RuntimeError, match="trainer restored step 4"):
        RunState(TurnSchedule(turns=[3], every=1)).load(extra, trainer_step=4)

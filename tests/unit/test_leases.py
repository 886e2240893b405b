from dataclasses import replace

from hypothesis import example, given, settings
from hypothesis import strategies as st

from turnscale.learner.leases import FixedPolicy, LeaseManager
from turnscale.learner.tasks import TaskStream, parse_task_spec
from tests.unit.fakes import make_group

TASKS = parse_task_spec("0:50", "babyai")


def manager(**kw) -> LeaseManager:
    args = dict(stream=TaskStream(TASKS, seed=0), group_size=2, groups_per_step=4, max_staleness=1, ttl_s=10.0)
    args.update(kw)
    return LeaseManager(**args)


def test_admission_follows_areal_rule():
    m = manager(max_staleness=1, groups_per_step=4)
    assert len(m.grant("a1", 100, now=0)) == 8  # (1 + 0 + 1) * 4
    assert m.grant("a1", 1, now=0) == []
    m.policy.version = 1
    assert len(m.grant("a1", 100, now=0)) == 4


def test_synchronous_mode_issues_one_batch_per_version():
    m = manager(max_staleness=0, groups_per_step=3)
    leases = m.grant("a1", 10, now=0)
    assert len(leases) == 3 and all(l.policy_version == 0 for l in leases)
    for l in leases[:2]:
        assert m.intake(make_group(l), now=1).accepted
    assert m.grant("a1", 10, now=1) == []  # waiting for the last group
    assert m.intake(make_group(leases[2]), now=1).accepted
    assert m.grant("a1", 10, now=1) == []  # all in, but not trained/published yet
    m.policy.version = 1
    nxt = m.grant("a1", 10, now=2)
    assert len(nxt) == 3 and all(l.policy_version == 1 for l in nxt)


def test_publish_every_scales_the_window():
    m = manager(max_staleness=0, groups_per_step=2, publish_every=3)
    assert len(m.grant("a1", 100, now=0)) == 6


def test_expired_lease_is_reissued_with_same_task_new_id():
    m = manager(ttl_s=5.0)
    (l1,) = m.grant("a1", 1, now=0)
    assert m.expire(now=4.9) == []
    assert m.expire(now=5.0) == [l1]
    (l2,) = m.grant("b", 1, now=5.0)
    assert l2.task == l1.task and l2.lease_id != l1.lease_id


def test_every_expiry_is_reported_once_whichever_call_expired_it():
    m = manager(ttl_s=5.0)
    l1, l2, l3 = m.grant("a1", 3, now=0)
    m.heartbeat("a1", [l3.lease_id], now=4)  # l3 lives until 9
    (l4,) = m.grant("b", 1, now=6)  # expiring l1 and l2 inside grant, not through expire()
    assert l4.task == l1.task
    assert m.take_expired() == [l1, l2]
    assert m.take_expired() == []
    assert not m.intake(make_group(l3), now=9.5).accepted  # expired inside intake
    assert m.take_expired() == [l3]


def test_heartbeat_renews_deadline_and_names_unknown_leases():
    m = manager(ttl_s=5.0)
    (l1,) = m.grant("a1", 1, now=0)
    assert m.heartbeat("a1", [l1.lease_id, "nope"], now=4) == ["nope"]
    assert m.expire(now=8) == []
    assert m.heartbeat("b", [l1.lease_id], now=8) == [l1.lease_id]  # not b's lease
    assert m.expire(now=9) == [l1]
    assert m.heartbeat("a1", [l1.lease_id], now=9) == [l1.lease_id]


def test_intake_drop_reasons():
    m = manager(ttl_s=5.0)
    l1, l2, l3, l4 = m.grant("a1", 4, now=0)
    assert m.intake(make_group(l1), now=1).accepted
    assert m.intake(make_group(l1), now=1).reason == "duplicate"
    assert m.intake(make_group(replace(l1, lease_id="zzz")), now=1).reason == "unknown_lease"
    r = m.intake(make_group(l2, failed=True), now=1)
    assert (r.accepted, r.reason) == (False, "failed")
    assert m.grant("a1", 1, now=1)[0].task == l2.task  # failed group's task goes first
    bad = make_group(replace(l3, turn_limit=l3.turn_limit + 1))
    assert m.intake(bad, now=1).reason == "mismatch"
    m.expire(now=100)
    assert m.intake(make_group(l4), now=100).reason == "expired"
    assert m.accepted == 1


def test_group_stale_on_arrival_is_dropped_and_its_task_reissued():
    m = manager(max_staleness=1)
    (l1, l2) = m.grant("a1", 2, now=0)
    m.policy.version = 2
    r = m.intake(make_group(l1, version=0), now=1)
    assert (r.accepted, r.reason, r.staleness) == (False, "stale", 2)
    assert m.stream.pending_reissue == [l1.task]
    r = m.intake(make_group(l2, version=1), now=1)
    assert r.accepted and r.staleness == 1


def test_group_fresh_on_arrival_but_stale_when_the_batch_forms_is_not_trained():
    """Sampled at v0, accepted at v1 (staleness 1 = the bound), still waiting when v2 is
    published: training it now would be staleness 2.  form_batch drops and re-issues it."""
    m = manager(max_staleness=1, groups_per_step=1)
    (l1, l2) = m.grant("a1", 2, now=0)
    m.policy.version = 1
    r1 = m.intake(make_group(l1, version=0), now=1)
    assert r1.accepted and r1.staleness == 1
    ready = [m.ready(make_group(l1, version=0), r1)]
    m.policy.version = 2
    r2 = m.intake(make_group(l2, version=1), now=1)
    ready.append(m.ready(make_group(l2, version=1), r2))
    batch, rest, stale = m.form_batch(ready, 1)
    assert [r.lease.lease_id for r in stale] == [l1.lease_id]
    assert [r.lease.lease_id for r in batch] == [l2.lease_id] and rest == []
    assert m.stream.pending_reissue == [l1.task]
    assert m.accepted == 1  # the stale group's admission slot is free again


def test_goodbye_releases_leases_for_reissue():
    m = manager()
    mine = m.grant("a1", 2, now=0)
    m.grant("b", 1, now=0)
    assert m.release_actor("a1") == mine
    assert m.in_flight == 1
    assert [l.task for l in m.grant("c", 2, now=0)] == [l.task for l in mine]


def test_group_leased_under_previous_turn_limit_is_trained_within_staleness():
    m = manager(policy=FixedPolicy(turn_limit=6))
    (l1,) = m.grant("a1", 1, now=0)
    m.policy.turn_limit = 13
    (l2,) = m.grant("a1", 1, now=0)
    assert (l1.turn_limit, l2.turn_limit) == (6, 13)
    assert m.intake(make_group(l1), now=1).accepted


def test_checkpoint_state_reissues_live_and_untrained_tasks():
    m = manager()
    leases = m.grant("a1", 3, now=0)
    m.intake(make_group(leases[0]), now=0)
    st_ = m.state(trained_groups=0, untrained=[leases[0].task])
    m2 = manager()
    m2.load_state(st_, TASKS)
    assert m2.accepted == 0 and m2.in_flight == 0
    got = [l.task for l in m2.grant("x", 3, now=0)]
    assert got == [l.task for l in leases]
    assert m2.grant("x", 1, now=0)[0].task == m.grant("y", 1, now=0)[0].task


@settings(max_examples=400, deadline=None)
@example(1, 1, 1, [("grant", 1), ("return", 0), ("train", 0), ("grant", 0), ("return", 1), ("return", 1), ("train", 0),
                   ("train", 0)])  # v0 sampled, accepted at v1 behind a fresher group, trained at v2 without the re-check
@given(st.integers(0, 3), st.integers(1, 4), st.integers(1, 3),
       st.lists(st.tuples(st.sampled_from(["grant", "return", "fail", "tick", "train"]), st.integers(0, 5)), max_size=100))
def test_no_group_is_trained_beyond_max_staleness_and_nothing_is_lost_or_trained_twice(max_staleness, gps, publish_every, ops):
    """Random interleavings of lease grants, arrivals (sampled at any version the actor may
    hold), expiries and train steps (batches formed by ``form_batch``; a publication every
    ``publish_every`` steps).  At training time no group exceeds ``max_staleness``; no
    lease is trained twice; admission holds; and every task handed out is, at every
    moment, in exactly one place: a live lease, the ready buffer, trained, or queued for
    re-issue."""
    from collections import Counter

    from turnscale.learner.tasks import TaskStream, parse_task_spec

    tasks = parse_task_spec("0:5000", "babyai")
    m = LeaseManager(stream=TaskStream(tasks, seed=0), group_size=2, groups_per_step=gps, max_staleness=max_staleness,
                     ttl_s=3.0, publish_every=publish_every)
    now, held, ready, trained_ids, trained_tasks, steps = 0.0, [], [], set(), [], 0
    for op, k in ops:
        if op == "grant":
            held += m.grant("a1", k + 1, now)
        elif op in ("return", "fail") and held:
            lease = held.pop(k % len(held))
            v = max(lease.policy_version, m.version - k)  # any version the actor may hold, never the future
            group = make_group(lease, version=v, failed=op == "fail")
            r = m.intake(group, now)
            if r.accepted:
                ready.append(m.ready(group, r))
            assert not m.intake(make_group(lease, version=v), now).accepted  # a resend never is
        elif op == "tick":
            now += k
            m.expire(now)
        elif op == "train":
            batch, ready, stale = m.form_batch(ready, gps)
            for r in batch:
                assert m.version - r.oldest <= max_staleness, "trained beyond max_staleness"
                assert m.version - r.oldest >= 0
                assert r.lease.lease_id not in trained_ids, "trained twice"
                trained_ids.add(r.lease.lease_id)
                trained_tasks.append(r.lease.task)
            if batch:
                steps += 1
                if steps % publish_every == 0:
                    m.policy.version += 1
        assert m.in_flight + m.accepted <= m.limit
        assert m.accepted == len(trained_ids) + len(ready)
        assert m.stream.cursor.epoch == 0
        fresh = TaskStream(tasks, seed=0)
        handed_out = Counter(fresh.next() for _ in range(m.stream.cursor.position))
        places = Counter([*trained_tasks, *(r.lease.task for r in ready), *(rec.lease.task for rec in m.live.values()),
                          *m.stream.pending_reissue])
        assert places == handed_out, "a task was lost or duplicated"


def test_heartbeats_without_progress_do_not_keep_a_lease_past_the_progress_timeout():
    """An actor whose engine hangs while its heartbeat task runs: its leases expire
    ``progress_timeout_s`` after issue although every heartbeat names them."""
    m = manager(ttl_s=10.0, progress_timeout_s=30.0)
    l1, l2 = m.grant("a1", 2, now=0)
    for t in range(5, 30, 5):
        assert m.heartbeat("a1", [l1.lease_id, l2.lease_id], now=t) == []
    assert m.expire(now=29.9) == []
    assert m.expire(now=30.0) == [l1, l2]
    assert m.heartbeat("a1", [l1.lease_id, l2.lease_id], now=31) == [l1.lease_id, l2.lease_id]  # abandon them
    assert [l.task for l in m.grant("b", 2, now=31)] == [l1.task, l2.task]  # re-issued


def test_progress_renews_the_progress_deadline_of_every_lease_of_that_actor_only():
    m = manager(ttl_s=10.0, progress_timeout_s=30.0)
    a1, a2 = m.grant("a1", 2, now=0)
    (b1,) = m.grant("b", 1, now=0)
    for t in range(5, 75, 5):
        m.heartbeat("a1", [a1.lease_id, a2.lease_id], now=t)
        m.heartbeat("b", [b1.lease_id], now=t)
        if t in (20, 45):
            m.progress("a1", now=t)  # e.g. its heartbeat reported more generated tokens
    assert m.take_expired() == [b1]  # at 30: b made no progress
    assert m.expire(now=74.9) == [] and m.expire(now=75.0) == [a1, a2]


def test_a_group_returned_is_progress_for_the_holders_other_leases():
    m = manager(ttl_s=100.0, progress_timeout_s=30.0)
    l1, l2 = m.grant("a1", 2, now=0)
    assert not m.intake(make_group(l1, actor_id="b"), now=25).accepted  # someone else's group: no progress
    assert m.intake(make_group(l1), now=25).accepted
    assert m.expire(now=54.9) == [] and m.expire(now=55.0) == [l2]


def test_only_growth_of_generated_tokens_or_decode_steps_is_reported_progress():
    from turnscale.learner.leases import reported_progress

    assert reported_progress({"tokens_generated": 10.0}, {"tokens_generated": 11.0, "engine_busy": 0.5})
    assert reported_progress({}, {"tokens_generated": 1.0})  # the first heartbeat after some generation
    assert reported_progress({"tokens_generated": 10.0, "decode_steps": 5.0},
                             {"tokens_generated": 10.0, "decode_steps": 9.0})  # one long generation under way
    assert not reported_progress({"tokens_generated": 10.0}, {"tokens_generated": 10.0, "engine_busy": 0.9})
    assert not reported_progress({"tokens_generated": 10.0}, {"tokens_generated": 3.0})  # engine rebuilt: not yet
    assert not reported_progress({"tokens_generated": 10.0}, {})


def test_revoke_ends_the_youngest_leases_of_that_actor_and_reissues_their_tasks():
    m = manager(ttl_s=10.0)
    old, mid, young = m.grant("a1", 3, now=0)
    (other,) = m.grant("b", 1, now=1)
    assert m.revoke("a1", 2) == [young, mid]
    assert set(m.live) == {old.lease_id, other.lease_id}
    assert m.heartbeat("a1", [young.lease_id], now=2) == [young.lease_id]  # the holder abandons it
    assert (m.intake(make_group(young), now=2).reason) == "expired"  # a late group is not trained
    assert [l.task for l in m.grant("c", 2, now=2)] == [young.task, mid.task]
    assert m.take_expired() == []  # revoked, not expired: the service reports them itself

"""ScienceWorld: AgentGym's task list, pooled JVMs reused across episodes, gold path reaches 100."""

from __future__ import annotations

import shutil
import threading
import time

import pytest

import collections

from turnscale.envhub.sciworld import EXCLUDED_TASKS, Game, JvmPool, PoolExhausted, SciWorldFamily, spread_split

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="needs Java 17 for scienceworld")


class _FakeJvm:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _FakePool(JvmPool):
    def _start(self):
        self.started += 1
        return _FakeJvm()


def test_pool_reuses_idle_jvms_and_caps_live_ones():
    pool = _FakePool(2)
    a = pool.acquire(1)
    pool.release(a)
    assert pool.acquire(1) is a and pool.started == 1
    b = pool.acquire(1)
    assert pool.live == 2
    with pytest.raises(PoolExhausted, match="jvm_pool"):
        pool.acquire(0.05)
    pool.discard(b)
    assert b.closed and pool.live == 1
    c = pool.acquire(1)
    assert pool.started == 3 and c is not b
    pool.release(c)
    pool.release(a)
    pool.close()
    assert a.closed and c.closed and pool.live == 0


def test_pool_limits_how_many_callers_wait():
    pool = _FakePool(1, max_waiting=1)
    a = pool.acquire(1)
    t = threading.Thread(target=lambda: pytest.raises(PoolExhausted, pool.acquire, 3))
    t.start()
    deadline = time.monotonic() + 5
    while pool._waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(PoolExhausted, match="1 resets already waiting"):
        pool.acquire(5)  # fails at once instead of waiting 5 s
    t.join(5)
    pool.release(a)


def test_pool_waiter_gets_the_released_jvm():
    pool = _FakePool(1)
    a = pool.acquire(1)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(5)))
    t.start()
    pool.release(a)
    t.join(5)
    assert got == [a] and pool.started == 1


def test_spread_split_covers_every_task_type():
    games = [Game(f"t{t}", f"task{t}", v) for t in range(23) for v in range(10 + 7 * t)]
    train, test = spread_split(games, 200)
    assert len(test) == 200 and len(train) + len(test) == len(games) and not set(train) & set(test)
    per = collections.Counter(games[i].task_id for i in test)
    assert len(per) == 23 and set(per.values()) == {8, 9}
    assert spread_split(games, 200) == (train, test)


@pytest.fixture(scope="module")
def family():
    pytest.importorskip("scienceworld")
    if shutil.which("java") is None:
        pytest.skip("needs Java 17 for scienceworld")
    fam = SciWorldFamily(jvm_pool=1, jvm_wait_s=0.5)
    yield fam
    fam.close()


@needs_java
def test_task_list_is_agentgyms_23_types_flattened_in_package_order(family):
    from scienceworld.constants import ID2TASK

    ids = list(dict.fromkeys(g.task_id for g in family.games))
    assert len(ids) == 23 and not EXCLUDED_TASKS & set(ids)
    assert ids == [t for t in ID2TASK if t not in EXCLUDED_TASKS]
    first = [g for g in family.games if g.task_id == ids[0]]
    assert [g.variation for g in first] == list(range(len(first)))
    assert family.games[: len(first)] == first


@needs_java
def test_gold_actions_reach_score_100_with_return_one(family):
    env = family.create()
    r = env.reset(0)
    assert r.info["category"] == "boil" and r.extra["task_name"] == "boil" and r.extra["score"] == 0
    assert r.observation.startswith(r.extra["task_description"] + "\n")
    total, scores = 0.0, []
    for action in env.gold_actions():
        s = env.step(action)
        total += s.reward
        scores.append(s.extra["score"])
        if s.done:
            break
    assert s.done and s.info["success"] and s.extra["score"] == 100
    assert total == pytest.approx(1.0) and scores == sorted(scores)
    assert family.pool.live == 1  # the finished episode gave its JVM back
    with pytest.raises(RuntimeError, match="reset"):
        env.step("look around")
    env.close()


@needs_java
def test_jvm_is_reused_across_episodes_and_instances(family):
    started = family.pool.started
    a, b = family.create(), family.create()
    a.reset(5)
    assert a.step("look around").info["success"] is False
    with pytest.raises(PoolExhausted):
        b.reset(7)  # the only JVM is busy with a's episode
    a.reset(6)  # a new episode on the same instance: same JVM
    a.close()
    r = b.reset(1000)
    assert r.info["task_id"] == family.games[1000].task_id
    assert family.pool.started == started  # no new JVM for any of these episodes
    b.close()


@needs_java
def test_hints_list_valid_actions(family):
    env = family.create()
    env.reset(0)
    assert "look around" in env.valid_actions()
    hint = env.action_hint()
    assert "open OBJ" in hint["possible_actions"] and hint["possible_objects"]
    env.close()


def test_agentgym_reset_text_is_the_room_alone_and_extra_routes_answer(family):
    """AgentGym's SciworldEnvClient shows ``task_description + "\\n" + observation``: its server's
    reset observation is the room alone (ours keeps the description in ``observation``)."""
    env = family.create()
    r = env.reset(0)
    desc, room = r.extra["task_description"], r.extra["observation"]
    assert r.observation == f"{desc}\n{room}" and desc not in room
    assert env.agentgym_task_description() == {"task_description": desc}
    assert isinstance(env.agentgym_goals()["goals"], str) and env.agentgym_goals()["goals"]
    assert isinstance(env.agentgym_object_tree()["object_tree"], str)
    state = env.agentgym_state()
    assert state["task_description"] == desc and 0 < len(state["possible_actions"]) <= 10
    assert env.agentgym_detail()["task_name"] == "boil"
    env.close()

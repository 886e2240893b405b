"""``learner.screen``: large control messages are checked in a child process (its own GIL)
before the learner decodes them; a failed child is replaced."""

from __future__ import annotations

import msgpack
import pytest

from turnscale.learner.screen import Screen, ScreenFailed
from turnscale.protocol import codec
from turnscale.protocol import messages as m
from tests.unit.message_examples import group


@pytest.fixture
def screen():
    s = Screen(codec.Limits(max_header_bytes=1 << 20), max_lease_ids=4, timeout_s=20)
    yield s
    s.close()


def test_a_legal_group_passes_with_its_data_frames_stood_in_for(screen):
    frames = codec.encode(group(n_episodes=4, n_tokens=20_000))
    assert len(frames) > 1  # arrays out of band: the child sees only their sizes
    assert screen.check(frames) == ""


def test_a_dense_or_bad_header_is_refused_with_the_decoders_message(screen):
    dense = msgpack.packb({"v": m.SCHEMA_VERSION, "t": "Hello", "b": {"actor_id": "f", "host": [{}] * 500_000}})
    assert screen.check([dense]).startswith("Hello.host: expected str, got list")
    assert "over 1048576" in screen.check([b"\x90" * (2 << 20)])


def test_a_heartbeat_naming_more_leases_than_an_actor_holds_is_refused(screen):
    ok = m.Heartbeat(actor_id="a", lease_ids=["l1", "l2", "l3", "l4"], policy_version=0)
    assert screen.check(codec.encode(ok)) == ""
    problem = screen.check(codec.encode(m.Heartbeat(actor_id="a", lease_ids=[f"l{i}" for i in range(5)], policy_version=0)))
    assert "5 lease ids, but an actor holds at most 4 (learner.max_leases_per_actor)" in problem


def test_a_dead_child_fails_one_check_and_the_next_starts_a_new_one(screen):
    frames = codec.encode(group())
    assert screen.check(frames) == ""
    screen._proc.kill()
    screen._proc.wait(timeout=5)
    try:
        assert screen.check(frames) == ""  # noticed before sending: a new child answers
    except ScreenFailed:
        assert screen.check(frames) == ""  # noticed while sending: the next check restarts it

"""Two processes on 127.0.0.1: this test (actor-shaped, trio) against a learner-shaped
child (``tests/integration/zmq_peer.py``) over DEALER/ROUTER and PUB/SUB."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import trio
import zmq

from turnscale.protocol import codec
from turnscale.protocol import messages as m
from turnscale.protocol.errors import RemoteError
from turnscale.protocol.transport import AsyncSocket, Requester, SocketLimits, configure, tcp_endpoint
from tests.integration.zmq_peer import digest

pytestmark = pytest.mark.timeout(120)


def _read_ready(proc: subprocess.Popen, timeout_s: float) -> tuple[int, int]:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            raise AssertionError(f"peer did not start (rc={proc.poll()}, got {line!r})")
        if sel.select(left):
            chunk = os.read(proc.stdout.fileno(), 1)
            if not chunk:
                continue
            line += chunk
    parts = line.split()
    assert parts[0] == b"READY", line
    return int(parts[1]), int(parts[2])


@pytest.fixture
def peer():
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.zmq_peer", "--lifetime-s", "90"], stdout=subprocess.PIPE)
    try:
        yield _read_ready(proc, 30)
        assert proc.poll() is None, "peer died during the test"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
        proc.stdout.close()


def _group(n_episodes: int, n_tokens: int, seed: int) -> m.TrajectoryGroup:
    rng = np.random.default_rng(seed)
    eps = []
    for _ in range(n_episodes):
        mask = (rng.random(n_tokens) < 0.5).astype(np.uint8)
        mask[:10] = 0
        eps.append(m.Episode(token_ids=rng.integers(0, 32_000, n_tokens, dtype=np.int32), loss_mask=mask,
                             logprobs=np.where(mask == 1, -rng.random(n_tokens), 0).astype(np.float32),
                             versions=np.where(mask == 1, 2, -1).astype(np.int32), prompt_len=10, turns=[],
                             finish_reason="done", reward=1.0, success=True, turn_limit=5))
    return m.TrajectoryGroup(lease_id="l-0", actor_id="a", task=m.Task(env="babyai", data_idx=0), turn_limit=5, episodes=eps)


def test_dealer_router_request_response_between_two_processes(peer):
    router_port, _ = peer
    ctx = zmq.Context()

    async def main():
        dealer = configure(ctx.socket(zmq.DEALER), SocketLimits(max_message_bytes=64 << 20))
        dealer.connect(tcp_endpoint("127.0.0.1", router_port))
        sock = AsyncSocket(dealer)
        req = Requester(sock)
        with trio.fail_after(60):
            welcome = await req.request(m.Hello(actor_id="a-1", host="h", pid=os.getpid(), engine="sim", device="cpu", max_groups=2),
                                        timeout_s=10, expect=m.Welcome)
            assert welcome.actor_id == "a-1" and welcome.policy.version == 0
            grant = await req.request(m.LeaseRequest(actor_id="a-1", max_leases=3), timeout_s=10, expect=m.LeaseGrant)
            assert [lease.lease_id for lease in grant.leases] == ["l-0", "l-1", "l-2"]
            # small (inline arrays) and ~4 MB (out-of-band arrays) groups arrive intact
            for n_eps, n_tok in ((2, 100), (8, 40_000)):
                group = _group(n_eps, n_tok, seed=n_tok)
                ack = await req.request(group, timeout_s=20, expect=m.GroupAck)
                assert ack.accepted and ack.reason == digest(group)
            # a malformed message gets a typed error and the peer keeps serving
            await sock.send_multipart([b"bad-rid-1", b"\x93not a message"])
            late = await sock.recv_multipart()
            err = codec.decode(late[1:])
            assert late[0].bytes == b"bad-rid-1" and isinstance(err, m.ErrorReply) and err.code == "bad_message"
            with pytest.raises(RemoteError) as info:
                await req.request(m.Goodbye(actor_id="a-1"), timeout_s=10, expect=m.GroupAck)
            assert info.value.code == "unexpected"
            ack = await req.request(m.Heartbeat(actor_id="a-1", lease_ids=["l-0"], policy_version=0), timeout_s=10, expect=m.HeartbeatAck)
            assert ack.unknown_lease_ids == []
        sock.close()

    try:
        trio.run(main)
    finally:
        ctx.destroy(linger=0)


def test_pub_sub_announcements_between_two_processes(peer):
    _, pub_port = peer
    ctx = zmq.Context()

    async def main():
        sub = configure(ctx.socket(zmq.SUB))
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(tcp_endpoint("127.0.0.1", pub_port))
        sock = AsyncSocket(sub)
        versions = []
        with trio.fail_after(30):
            while len(versions) < 5:
                ann = await sock.recv_msg(expect=m.PolicyAnnouncement)
                versions.append(ann.version)
        assert versions == sorted(versions) and len(set(versions)) == 5
        sock.close()

    try:
        trio.run(main)
    finally:
        ctx.destroy(linger=0)
